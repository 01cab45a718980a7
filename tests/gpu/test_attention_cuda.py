"""TTT attention backends on CUDA: flex (compiled) matches eager in outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from eagleforge.draft.attention import eager_ttt_attention, flex_ttt_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("steps", [1, 3])
def test_flex_matches_eager_with_gradients(steps: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(steps)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 256, 64
    valid = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
    valid[1, 200:] = False

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device="cuda").requires_grad_()

    q = leaf(batch, heads, seq, dim)
    keys = [leaf(batch, kv_heads, seq, dim) for _ in range(steps)]
    values = [leaf(batch, kv_heads, seq, dim) for _ in range(steps)]
    upstream = torch.randn(batch, seq, heads * dim, generator=generator, device="cuda")
    results = []
    for fn in (eager_ttt_attention, flex_ttt_attention):
        for t in (q, *keys, *values):
            t.grad = None
        out = fn(q, keys, values, valid)
        (out * upstream * valid.unsqueeze(-1)).sum().backward()
        results.append(
            (out.detach() * valid.unsqueeze(-1), [t.grad.clone() for t in (q, *keys, *values)])
        )
    (eager_out, eager_grads), (flex_out, flex_grads) = results
    torch.testing.assert_close(flex_out, eager_out, rtol=2e-3, atol=2e-3)
    for got, want in zip(flex_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
