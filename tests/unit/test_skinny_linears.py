"""Decoding's few-row products on a CPU: ``W @ x.T`` equals ``x @ W.T`` to fp32 rounding, and
everything else (many rows, gradients, other dtypes) is left to F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eagleforge.layers import SKINNY_ROWS, skinny_linears

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rows", [1, 2, 5, SKINNY_ROWS, SKINNY_ROWS + 1, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_equal_the_plain_product(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    plain = nn.Linear(48, 80, bias=bias)
    skinny = skinny_linears(nn.Sequential(nn.Linear(48, 80, bias=bias)))[0]
    skinny.load_state_dict(plain.state_dict())
    x = torch.randn(1, rows, 48)
    with torch.no_grad():
        torch.testing.assert_close(skinny(x), plain(x))


def test_gradients_and_other_dtypes_keep_f_linear() -> None:
    layer = skinny_linears(nn.Linear(8, 4))
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()  # with gradients: F.linear, autograd as ever
    assert x.grad is not None and layer.weight.grad is not None
    bf16 = skinny_linears(nn.Linear(8, 4).bfloat16())
    assert "forward" not in vars(bf16)  # untouched
    assert "forward" in vars(layer)
