"""TTT attention backends on CUDA match eager in outputs and gradients (run with -m gpu).

flex runs compiled in fp32; sdpa (PyTorch's variable-length flash kernel) and flash (the
flash-attn package) compute the step-0 part in bf16, hence their looser tolerance.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from eagleforge.draft.attention import (
    eager_ttt_attention,
    flash_ttt_attention,
    flex_ttt_attention,
    sdpa_ttt_attention,
)

pytestmark = pytest.mark.gpu

BACKENDS = {
    "flex": (flex_ttt_attention, 2e-3),
    "sdpa": (sdpa_ttt_attention, 3e-2),
    "flash": (flash_ttt_attention, 3e-2),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_backend_matches_eager_with_gradients(backend: str, steps: int, packed: bool) -> None:
    if backend == "flash" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (pip install 'eagleforge[flash]')")
    fn, tolerance = BACKENDS[backend]
    generator = torch.Generator(device="cuda").manual_seed(steps)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 256, 64
    valid = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
    valid[1, 200:] = False
    documents = None
    if packed:
        documents = (torch.arange(seq, device="cuda") // 70).expand(batch, seq).contiguous()

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device="cuda").requires_grad_()

    q = leaf(batch, heads, seq, dim)
    keys = [leaf(batch, kv_heads, seq, dim) for _ in range(steps)]
    values = [leaf(batch, kv_heads, seq, dim) for _ in range(steps)]
    upstream = torch.randn(batch, seq, heads * dim, generator=generator, device="cuda")
    mask = valid.unsqueeze(-1)
    results = []
    for attend in (eager_ttt_attention, fn):
        for t in (q, *keys, *values):
            t.grad = None
        out = attend(q, keys, values, valid, documents)
        (out * upstream * mask).sum().backward()
        results.append((out.detach() * mask, [t.grad.clone() for t in (q, *keys, *values)]))
    (eager_out, eager_grads), (got_out, got_grads) = results
    torch.testing.assert_close(got_out, eager_out, rtol=tolerance, atol=tolerance)
    for got, want in zip(got_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
