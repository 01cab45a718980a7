"""The draft's RMSNorm (a custom autograd function keeping less for backward) equals the plain
expression in outputs and gradients, in fp32, fp64 and bf16 inputs."""

from __future__ import annotations

import pytest
import torch

from eagleforge.layers import RMSNorm

pytestmark = pytest.mark.unit


def _plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_plain_expression(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(12, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=generator))
    x = (torch.randn(3, 5, 12, generator=generator) * 3).to(dtype).requires_grad_()
    upstream = torch.randn(3, 5, 12, generator=generator).to(dtype)
    (norm(x) * upstream).sum().backward()
    got = x.grad.clone(), norm.weight.grad.clone()  # type: ignore[union-attr]
    x.grad = norm.weight.grad = None
    (_plain(x, norm.weight, 1e-5) * upstream).sum().backward()
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(norm(x), _plain(x, norm.weight, 1e-5), **tolerance)
    torch.testing.assert_close(got[0], x.grad, **tolerance)
    torch.testing.assert_close(got[1], norm.weight.grad, **tolerance)
