"""The sdpa TTT attention backend matches the eager reference in outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from eagleforge.draft.attention import AttentionBackend, eager_ttt_attention, sdpa_ttt_attention
from eagleforge.draft.ttt import (
    count_positions,
    loss_scales,
    step_weights,
    ttt_forward,
)
from helpers.drafts import random_batch, tiny_draft

pytestmark = pytest.mark.unit


def _outputs_and_grads(fn, q, keys, values, valid, upstream):  # type: ignore[no-untyped-def]
    leaves = [q, *keys, *values]
    for leaf in leaves:
        leaf.grad = None
    out = fn(q, keys, values, None if bool(valid.all()) else valid)  # None: no padding
    # only real (non-padded) queries matter downstream
    (out * upstream * valid.unsqueeze(-1)).sum().backward()
    return out.detach() * valid.unsqueeze(-1), [leaf.grad.clone() for leaf in leaves]


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_matches_eager(steps: int, heads: int, kv_heads: int, padded: bool) -> None:
    generator = torch.Generator().manual_seed(steps * 10 + heads + kv_heads)
    batch, seq, dim = 2, 11, 8
    valid = torch.ones(batch, seq, dtype=torch.bool)
    if padded:
        valid[1, 7:] = False
    q = torch.randn(batch, heads, seq, dim, generator=generator).requires_grad_()
    keys = [
        torch.randn(batch, kv_heads, seq, dim, generator=generator).requires_grad_()
        for _ in range(steps)
    ]
    values = [
        torch.randn(batch, kv_heads, seq, dim, generator=generator).requires_grad_()
        for _ in range(steps)
    ]
    upstream = torch.randn(batch, seq, heads * dim, generator=generator)
    eager = _outputs_and_grads(eager_ttt_attention, q, keys, values, valid, upstream)
    sdpa = _outputs_and_grads(sdpa_ttt_attention, q, keys, values, valid, upstream)
    torch.testing.assert_close(sdpa[0], eager[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(sdpa[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_ttt_forward_sdpa_equals_eager() -> None:
    """The whole unrolled TTT (loss sums, counts, correct) and the draft gradients agree."""
    draft = tiny_draft(seed=1)
    batch_ = random_batch(draft.arch, seed=3, padded_row=0, real_length=9, supervised_share=0.7)
    results = {}
    for backend in (AttentionBackend.eager, AttentionBackend.sdpa):
        draft.zero_grad(set_to_none=True)
        scale_k = loss_scales(count_positions(batch_, 4), step_weights(4, 0.8))
        stats = ttt_forward(draft, batch_, 4, scale_k, attention=backend)
        stats.loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        results[backend] = (stats, grads)
    (eager, eager_grads), (sdpa, sdpa_grads) = (
        results[AttentionBackend.eager],
        results[AttentionBackend.sdpa],
    )
    torch.testing.assert_close(sdpa.loss_sum_k, eager.loss_sum_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(sdpa.num_counted_k, eager.num_counted_k)
    assert torch.equal(sdpa.num_correct_k, eager.num_correct_k)
    assert (
        eager_grads.keys() == sdpa_grads.keys()
        and "midlayer.self_attn.q_proj.weight" in eager_grads
    )
    for name in eager_grads:
        torch.testing.assert_close(
            sdpa_grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name
        )
