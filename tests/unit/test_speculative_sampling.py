"""Speculative verification is lossless: whatever the draft proposes, the emitted token
follows the target's distribution p (checked by sampling against exact p)."""

from __future__ import annotations

import pytest
import torch

from eagleforge.speculative.sampling import accept_proposals, accept_sampled

pytestmark = pytest.mark.unit

DRAWS = 30_000


def _distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(7, generator=generator) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(7, generator=generator) * 1.5, dim=-1)
    q[6] = 0.0  # a token outside the draft vocabulary
    return p, q / q.sum()


def _assert_follows(counts: torch.Tensor, p: torch.Tensor) -> None:
    empirical = counts / counts.sum()
    # 5 standard errors of a binomial share at DRAWS samples
    tolerance = 5 * (p * (1 - p) / DRAWS).sqrt() + 1e-4
    assert bool(((empirical - p).abs() <= tolerance).all()), (empirical, p)


def test_sampled_chain_token_is_accepted_so_that_the_output_follows_p() -> None:
    p, q = _distributions(0)
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(7)
    accepted = 0
    for token in torch.multinomial(q, DRAWS, replacement=True, generator=generator).tolist():
        ok, bonus = accept_sampled(p, q, token, generator)
        accepted += ok
        counts[token if ok else bonus] += 1
    _assert_follows(counts, p)
    # the acceptance probability of speculative sampling is sum(min(p, q))
    assert accepted / DRAWS == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.01)


@pytest.mark.parametrize("proposals", [[2], [3, 0, 5], [6, 1]])
def test_tree_proposals_are_accepted_so_that_the_output_follows_p(proposals: list[int]) -> None:
    p, _ = _distributions(2)
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(7)
    for _ in range(DRAWS):
        index, bonus = accept_proposals(p, proposals, generator)
        counts[proposals[index] if index is not None else bonus] += 1
    _assert_follows(counts, p)
