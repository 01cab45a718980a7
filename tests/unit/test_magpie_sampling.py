"""Magpie's nucleus sampling (regeneration/magpie.py): the smallest set of most likely tokens
holding top_p of the mass, drawn in proportion to the full-vocabulary probabilities, at most
top_k wide; and the batched sampling loop stops once every row has ended."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagleforge.regeneration.config import MagpieConfig
from eagleforge.regeneration.magpie import nucleus_sample, sample_continuations

pytestmark = pytest.mark.unit


def draws(
    logits_V: torch.Tensor, top_p: float, n: int = 20_000, temperature: float = 1.0, top_k=256
):
    torch.manual_seed(0)
    tokens = nucleus_sample(logits_V.expand(n, -1), temperature, top_p, top_k)
    return torch.bincount(tokens, minlength=len(logits_V)).float() / n


def test_top_p_one_draws_the_softmax() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    assert torch.allclose(draws(probs.log(), 1.0), probs, atol=0.015)


def test_the_nucleus_is_the_smallest_set_holding_top_p() -> None:
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token is the last one kept; the fourth is never drawn
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    freq = draws(probs.log(), 0.8)
    assert freq[3] == 0
    assert torch.allclose(freq[:3], probs[:3] / 0.9, atol=0.015)


def test_a_tiny_top_p_is_greedy_and_temperature_sharpens() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert draws(logits, 1e-6)[1] == 1
    flat, sharp = draws(logits, 1.0), draws(logits, 1.0, temperature=0.25)
    assert sharp[1] > flat[1] + 0.2


def test_a_wide_nucleus_is_cut_to_the_top_k_candidates() -> None:
    freq = draws(torch.zeros(1024), 1.0, n=4_000, top_k=256)
    assert 200 < int((freq > 0).sum()) <= 256
    # the top_k most likely, with their full-vocabulary probabilities (renormalised)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    assert torch.allclose(
        draws(probs.log(), 1.0, top_k=2), torch.tensor([4, 3, 0, 0]) / 7, atol=0.015
    )


def test_top_k_zero_is_the_whole_vocabulary() -> None:
    freq = draws(torch.zeros(1024), 1.0, n=20_000, top_k=0)
    assert int((freq > 0).sum()) > 1000


class CountingModel(torch.nn.Module):
    """Next token = the last input token + 1 (vocab 16), so rows end when they reach 9."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input_ids, use_cache, past_key_values):  # type: ignore[no-untyped-def]
        self.calls += 1
        logits = torch.full((*input_ids.shape, 16), -1e4)
        logits.scatter_(-1, (input_ids + 1)[..., None] % 16, 0.0)
        return SimpleNamespace(logits=logits)

    config = None


def test_sampling_stops_when_every_row_has_ended() -> None:
    model = CountingModel()
    prompts = torch.tensor([[5], [7]])
    cfg = MagpieConfig(max_new_tokens=10)
    out = sample_continuations(model, prompts, cfg, stop_ids={9})
    # row 0 writes 6, 7, 8, 9 (ended); row 1 ended at its second token
    assert out.tolist() == [[6, 7, 8, 9], [8, 9, 10, 11]]
    assert model.calls == 4  # the prefill and one forward per token before the last
