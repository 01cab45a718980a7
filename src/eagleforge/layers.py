"""Torch building blocks the drafts and the targets share: RMSNorm, the SiLU-gated MLP, RoPE's
half rotation, and the causal mask of padded or packed rows. Imports nothing of eagleforge.

Shape suffixes: B batch, T sequence.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn


def causal_document_mask(
    valid_BT: torch.Tensor, document_ids_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean mask [B, T, T]: True where query t sees key s -- s <= t, s a real token and, with
    ``document_ids_BT`` (packed rows), in t's document. Padding queries see every earlier real
    key, so no row is fully masked."""
    seq = valid_BT.shape[1]
    valid = valid_BT.bool()
    causal_TT = torch.ones(seq, seq, dtype=torch.bool, device=valid_BT.device).tril()
    mask_BTT = causal_TT.unsqueeze(0) & valid.unsqueeze(1)
    if document_ids_BT is not None:
        same_document = document_ids_BT.unsqueeze(2) == document_ids_BT.unsqueeze(1)
        mask_BTT &= same_document | ~valid.unsqueeze(2)
    return mask_BTT


class _RMSNorm(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2) + eps)) with the normalisation in fp32 (as SGLang does).

    Keeps only x and the [.., 1] rsqrt for backward -- autograd of the plain expression would
    also keep the normalised x -- and recomputes that cheap elementwise product instead.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        normed32 = x.float() * rstd
        grad_weight = (grad_y * normed32.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
        grad_normed32 = (grad_y * weight).float()
        mean_dot = (grad_normed32 * normed32).mean(-1, keepdim=True)
        grad_x = ((grad_normed32 - normed32 * mean_dot) * rstd).to(x.dtype)
        return grad_x, grad_weight.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)  # type: ignore[no-any-return]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class SwiGLU(nn.Module):
    """The Llama / Qwen MLP: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@torch.no_grad()
def init_trainable(module: nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """Normal(0, std) for every trainable matrix, ones for norm gains, zero biases; frozen
    parameters (a copied embedding) are kept. Draws in parameter order from ``generator``."""
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if "norm" in name and param.ndim == 1:  # every RMSNorm gain
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * std)


# A CPU's fp32 matmul library packs the weight of ``x @ W.T`` for every call: with a few rows
# of x (decoding: the verified tokens of one round) that costs 3-4x the one-row product, where
# ``W @ x.T`` streams W once, as a one-row product does (docs/performance.md#cpu-kinds).
SKINNY_ROWS = 16
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _skinny_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > SKINNY_ROWS or torch.is_grad_enabled() or x.device.type != "cpu":
        return F.linear(x, self.weight, self.bias)
    out = (self.weight @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], -1)
    return out if self.bias is None else out + self.bias


def skinny_linears(model: ModuleT) -> ModuleT:
    """``model`` with each fp32 ``nn.Linear`` on a CPU computing few-row inputs without
    gradients (decoding's forwards) as ``W @ x.T``; everything else as before."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) is nn.Linear
            and isinstance(weight, torch.Tensor)
            and weight.dtype == torch.float32
            and weight.device.type == "cpu"
        ):
            module.forward = _skinny_linear.__get__(module)  # type: ignore[method-assign]
    return model
