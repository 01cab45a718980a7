"""The draft's lm_head + soft cross-entropy against the teacher, in chunks of rows.

A plain implementation keeps, for every TTT step, the [n, W] fp32 logits and log-probs alive
until backward: k copies of the largest tensors of the step. Here each chunk of rows goes
through the lm_head, the loss, the argmax *and* the gradients at once, in the forward pass
(the loss is always differentiated when gradients are on), so only the [n, H] and [W, H]
gradients are kept. Numbers equal the plain computation to float tolerance.

Shape suffixes: n counted positions, H draft hidden, W draft vocab.
"""

from __future__ import annotations

from typing import Any

import torch


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_nH: torch.Tensor,
        weight_WH: torch.Tensor,
        target_probs_nW: torch.Tensor,
        chunk_size: int,
        with_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden_nH.shape[0]
        # half-precision logits are upcast: the softmax over W terms needs fp32 at least
        compute = torch.promote_types(hidden_nH.dtype, torch.float32)
        loss = torch.zeros((), dtype=compute, device=hidden_nH.device)
        argmax_n = torch.empty(rows, dtype=torch.long, device=hidden_nH.device)
        grad_hidden = torch.empty_like(hidden_nH) if with_grad else None
        grad_weight = torch.zeros_like(weight_WH, dtype=compute) if with_grad else None
        for start in range(0, rows, chunk_size):
            end = min(start + chunk_size, rows)
            h_cH = hidden_nH[start:end]
            logits_cW = (h_cH @ weight_WH.T).to(compute)
            log_probs_cW = torch.log_softmax(logits_cW, dim=-1)
            p_cW = target_probs_nW[start:end]
            loss -= (p_cW * log_probs_cW).sum()
            argmax_n[start:end] = logits_cW.argmax(dim=-1)
            if grad_hidden is not None and grad_weight is not None:
                # d/dlogits of -sum(p * log_softmax(z)) = softmax(z) * sum(p) - p
                g_cW = log_probs_cW.exp_().mul_(p_cW.sum(-1, keepdim=True)).sub_(p_cW)
                grad_hidden[start:end] = (g_cW.to(weight_WH.dtype) @ weight_WH).to(hidden_nH.dtype)
                grad_weight += g_cW.T @ h_cH.to(compute)
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight) if t is not None))
        ctx.weight_dtype = weight_WH.dtype
        ctx.mark_non_differentiable(argmax_n)
        return loss, argmax_n

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_argmax: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if not ctx.saved_tensors:
            raise RuntimeError("chunked_soft_cross_entropy was called without gradients enabled")
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_loss,
            (grad_weight * grad_loss).to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def chunked_soft_cross_entropy(
    hidden_nH: torch.Tensor,
    weight_WH: torch.Tensor,
    target_probs_nW: torch.Tensor,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_rows −Σ_v p(v)·log softmax(h·Wᵀ)(v), argmax of h·Wᵀ per row) without keeping [n, W] logits."""
    with_grad = torch.is_grad_enabled() and (hidden_nH.requires_grad or weight_WH.requires_grad)
    loss, argmax_n = _ChunkedSoftCrossEntropy.apply(
        hidden_nH, weight_WH, target_probs_nW, chunk_size, with_grad
    )
    return loss, argmax_n
