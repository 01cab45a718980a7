"""The loss chunk's row work in two Triton kernels (``loss.kernel=triton``, CUDA).

``draft/loss.py``'s torch path turns each chunk's logits into fp32 log-probabilities, then
probabilities, then the gradient, through a dozen elementwise passes and two [rows, W] fp32
buffers. Here the logits stay in the matmul's dtype (bf16 in training) in the one [rows, W]
buffer the matmul wrote, and the teacher rows are read where they are (no gathered copy):

- ``row_stats`` reads each row twice (max and Σ exp online, then the sums that need q) and
  writes per row: the log-normaliser, the argmax (first of equal maxima, as torch's), the
  cross-entropy -Σ p log q, the teacher mass Σ p, α = Σ min(p, q), S = Σ q·1[p > q] and
  Σ p log p;
- ``row_grad`` writes, over the logits, a·(q·Σp - p) + b·q·(1[p > q] - S): every kind built
  from the cross-entropy and α (``draft/loss.py``'s coefficients a and b per row).

All arithmetic is fp32 in registers. The kernels also run under ``TRITON_INTERPRET=1`` on CPU
tensors (fp32 and fp16; numpy has no bf16), which is how the CPU tests check them.

Shape suffixes: c rows of one chunk, W draft vocab, M teacher rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Columns a program reads at once: one row of a 32k vocab in 16 blocks.
BLOCK_W = 2048


@triton.jit
def _row_stats_kernel(
    z_ptr,
    z_stride,
    p_ptr,
    p_stride,
    p_rows_ptr,
    width,
    lse_ptr,
    argmax_ptr,
    ce_ptr,
    mass_ptr,
    alpha_ptr,
    above_ptr,
    plogp_ptr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    p_row = p_ptr + tl.load(p_rows_ptr + row).to(tl.int64) * p_stride
    offsets = tl.arange(0, BLOCK)
    # pass 1: the running max and Σ exp(z - max), and the first index of the largest logit
    top = -float("inf")
    top_index = 0
    total = 0.0
    for start in range(0, width, BLOCK):
        cols = start + offsets
        z = tl.load(z_row + cols, mask=cols < width, other=-float("inf")).to(tl.float32)
        block_top = tl.max(z, 0)
        block_index = tl.argmax(z, 0) + start
        better = block_top > top
        top_index = tl.where(better, block_index, top_index)
        new_top = tl.maximum(top, block_top)
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(z - new_top), 0)
        top = new_top
    lse = top + tl.log(total)
    # pass 2: the sums over the teacher row, q = exp(z - lse)
    pz = 0.0
    mass = 0.0
    alpha = 0.0
    above = 0.0
    plogp = 0.0
    for start in range(0, width, BLOCK):
        cols = start + offsets
        inside = cols < width
        z = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
        p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
        q = tl.where(inside, tl.exp(z - lse), 0.0)
        pz += tl.sum(p * z, 0)
        mass += tl.sum(p, 0)
        alpha += tl.sum(tl.minimum(p, q), 0)
        above += tl.sum(tl.where(p > q, q, 0.0), 0)
        plogp += tl.sum(tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0), 0)
    tl.store(lse_ptr + row, lse)
    tl.store(argmax_ptr + row, top_index)  # stored as the pointer's int64
    tl.store(ce_ptr + row, lse * mass - pz)
    tl.store(mass_ptr + row, mass)
    tl.store(alpha_ptr + row, alpha)
    tl.store(above_ptr + row, above)
    tl.store(plogp_ptr + row, plogp)


@triton.jit
def _row_grad_kernel(
    z_ptr,
    z_stride,
    p_ptr,
    p_stride,
    p_rows_ptr,
    width,
    lse_ptr,
    mass_ptr,
    above_ptr,
    a_ptr,
    b_ptr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    p_row = p_ptr + tl.load(p_rows_ptr + row).to(tl.int64) * p_stride
    lse = tl.load(lse_ptr + row)
    mass = tl.load(mass_ptr + row)
    above = tl.load(above_ptr + row)
    a = tl.load(a_ptr + row)
    b = tl.load(b_ptr + row)
    offsets = tl.arange(0, BLOCK)
    for start in range(0, width, BLOCK):
        cols = start + offsets
        inside = cols < width
        z = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
        p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
        q = tl.exp(z - lse)
        grad = a * (q * mass - p) + b * q * (tl.where(p > q, 1.0, 0.0) - above)
        tl.store(z_row + cols, grad.to(z_ptr.dtype.element_ty), mask=inside)


class RowStats(NamedTuple):
    """Per row of a chunk (fp32 [c], argmax long [c])."""

    lse_c: torch.Tensor  # log Σ exp z
    argmax_c: torch.Tensor  # the first index of the largest logit
    ce_c: torch.Tensor  # -Σ p log q
    mass_c: torch.Tensor  # Σ p
    alpha_c: torch.Tensor  # Σ min(p, q)
    above_c: torch.Tensor  # Σ q·1[p > q]
    plogp_c: torch.Tensor  # Σ p log p (0 log 0 = 0)


def _block(width: int) -> int:
    return min(BLOCK_W, triton.next_power_of_2(width))


def row_stats(z_cW: torch.Tensor, teacher_MW: torch.Tensor, rows_c: torch.Tensor) -> RowStats:
    """The row sums of the logits ``z_cW`` against ``teacher_MW[rows_c]`` (nothing written
    over ``z_cW``)."""
    rows, width = z_cW.shape
    stats = RowStats(
        torch.empty(rows, dtype=torch.float32, device=z_cW.device),
        torch.empty(rows, dtype=torch.long, device=z_cW.device),
        *(torch.empty(rows, dtype=torch.float32, device=z_cW.device) for _ in range(5)),
    )
    if rows:
        _row_stats_kernel[(rows,)](
            z_cW, z_cW.stride(0), teacher_MW, teacher_MW.stride(0), rows_c, width, *stats,
            BLOCK=_block(width),
        )  # fmt: skip
    return stats


def row_grad(
    z_cW: torch.Tensor,
    teacher_MW: torch.Tensor,
    rows_c: torch.Tensor,
    stats: RowStats,
    a_c: torch.Tensor,
    b_c: torch.Tensor,
) -> torch.Tensor:
    """a·(q·Σp - p) + b·∂α/∂z per row, written over ``z_cW`` (returned)."""
    rows, width = z_cW.shape
    if rows:
        _row_grad_kernel[(rows,)](
            z_cW, z_cW.stride(0), teacher_MW, teacher_MW.stride(0), rows_c, width,
            stats.lse_c, stats.mass_c, stats.above_c,
            a_c.to(torch.float32).contiguous(), b_c.to(torch.float32).contiguous(),
            BLOCK=_block(width),
        )  # fmt: skip
    return z_cW
