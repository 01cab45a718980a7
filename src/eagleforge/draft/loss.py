"""The draft's lm_head + soft cross-entropy against the teacher, in chunks of rows.

A plain implementation keeps, for every TTT step, the [n, W] fp32 logits and log-probs alive
until backward, and autograd then builds one [W, H] lm_head gradient per step. Here the rows
of *all* TTT steps go through one call: each chunk of rows gathers its teacher rows, goes
through the lm_head, the loss, the argmax *and* the gradients at once, in the forward pass,
and the gradients of the differentiable output -- Σ_rows scale_r · loss_r, with the step's
loss weight and normaliser in ``scale`` -- are what is kept: one [n, H] tensor and a single
[W, H] buffer. Transient memory is one chunk of [rows, W] fp32; numbers equal the plain
computation to float tolerance.

Shape suffixes: n rows (counted positions of all steps), H draft hidden, W draft vocab,
M teacher rows (flattened batch positions).
"""

from __future__ import annotations

from typing import Any

import torch

from eagleforge.batch import CHUNK_BYTES, rows_per_chunk

# The loss holds two such buffers per chunk (logits turned log-probs turned gradient, and the
# teacher rows), so it uses half the budget each -- but at least LOSS_MIN_ROWS rows, since
# every chunk also reads and writes the whole [W, H] lm_head gradient buffer once.
LOSS_CHUNK_BYTES = CHUNK_BYTES // 2
LOSS_MIN_ROWS = 256


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_nH: torch.Tensor,
        weight_WH: torch.Tensor,
        teacher_MW: torch.Tensor,
        teacher_rows_n: torch.Tensor,
        scale_n: torch.Tensor | None,
        chunk_size: int,
        with_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = hidden_nH.shape[0]
        # half-precision logits are upcast: the softmax over W terms needs fp32 at least
        compute = torch.promote_types(hidden_nH.dtype, torch.float32)
        loss_n = torch.empty(rows, dtype=compute, device=hidden_nH.device)
        argmax_n = torch.empty(rows, dtype=torch.long, device=hidden_nH.device)
        grad_hidden = torch.empty_like(hidden_nH) if with_grad else None
        grad_weight = torch.zeros_like(weight_WH, dtype=compute) if with_grad else None
        for start in range(0, rows, chunk_size):
            end = min(start + chunk_size, rows)
            h_cH = hidden_nH[start:end]
            # At most two [c, W] buffers live at once: the logits (turned into log-probs, then
            # into the logit gradient, in place) and the teacher rows.
            z_cW = (h_cH @ weight_WH.T).to(compute)
            argmax_n[start:end] = z_cW.argmax(dim=-1)
            z_cW.sub_(torch.logsumexp(z_cW, dim=-1, keepdim=True))
            p_cW = teacher_MW[teacher_rows_n[start:end]].to(compute)
            # row-wise -sum(p * log_probs) as a batched dot product: no [c, W] product tensor
            loss_n[start:end] = -(p_cW.unsqueeze(1) @ z_cW.unsqueeze(2)).view(-1)
            if grad_hidden is not None and grad_weight is not None and scale_n is not None:
                # d/dlogits of -sum(p * log_softmax(z)) = softmax(z) * sum(p) - p, times the scale
                g_cW = z_cW.exp_().mul_(p_cW.sum(-1, keepdim=True)).sub_(p_cW)
                g_cW.mul_(scale_n[start:end, None].to(compute))
                del p_cW
                grad_hidden[start:end] = (g_cW.to(weight_WH.dtype) @ weight_WH).to(hidden_nH.dtype)
                grad_weight.addmm_(g_cW.T, h_cH.to(compute))
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight) if t is not None))
        ctx.weight_dtype = weight_WH.dtype
        ctx.mark_non_differentiable(loss_n, argmax_n)
        weighted = (
            (loss_n * scale_n.to(compute)).sum()
            if scale_n is not None
            else torch.zeros((), dtype=compute, device=hidden_nH.device)
        )
        return weighted, loss_n, argmax_n

    @staticmethod
    def backward(ctx: Any, grad_weighted: torch.Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if not ctx.saved_tensors:
            raise RuntimeError(
                "soft_cross_entropy kept no gradients: give scale_n, with grad enabled"
            )
        grad_hidden, grad_weight = ctx.saved_tensors
        # in place: the [W, H] buffer is the largest tensor here (a second backward through
        # this graph is refused by autograd's saved-tensor version check)
        return (
            grad_hidden.mul_(grad_weighted),
            grad_weight.mul_(grad_weighted).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def soft_cross_entropy(
    hidden_nH: torch.Tensor,
    weight_WH: torch.Tensor,
    teacher_MW: torch.Tensor,
    teacher_rows_n: torch.Tensor,
    scale_n: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row soft cross-entropy of ``softmax(h·Wᵀ)`` against ``teacher_MW[teacher_rows_n]``.

    Returns ``(Σ_r scale_r · loss_r, loss_n, argmax_n)`` (the first is 0 without ``scale_n``).
    Only the first is differentiable, and gradients are computed (in this forward pass) only
    when ``scale_n`` is given and autograd is recording. ``loss_n`` and the argmax of the
    logits per row are for metrics.
    """
    with_grad = (
        scale_n is not None
        and torch.is_grad_enabled()
        and (hidden_nH.requires_grad or weight_WH.requires_grad)
    )
    if chunk_size is None:
        chunk_size = rows_per_chunk(weight_WH.shape[0], LOSS_CHUNK_BYTES, LOSS_MIN_ROWS)
    return _SoftCrossEntropy.apply(  # type: ignore[no-any-return]
        hidden_nH, weight_WH, teacher_MW, teacher_rows_n, scale_n, chunk_size, with_grad
    )
