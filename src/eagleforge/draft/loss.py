"""The draft's lm_head + training loss against the teacher, in chunks of rows.

A plain implementation keeps, for every TTT step, the [n, W] fp32 logits and log-probs alive
until backward, and autograd then builds one [W, H] lm_head gradient per step. Here the rows
of *all* TTT steps go through one call: each chunk of rows gathers its teacher rows, goes
through the lm_head, the loss, the argmax, the expected acceptance α *and* the gradients at
once, in the forward pass, and the gradients of the differentiable output -- Σ_rows scale_r ·
loss_r, with the step's loss weight and normaliser in ``scale`` -- are what is kept: one
[n, H] tensor and a single [W, H] buffer. Transient memory is one chunk of [rows, W]
buffers, sized so every loss kind peaks at the same bytes as ``kl`` (fewer rows per chunk
for kinds that need more buffers); numbers equal the plain computation to float tolerance.

The loss kinds (``LossConfig.kind``, docs/losses.md) are functions of the draft's
q = softmax(z) and the teacher row p, with α = Σ_v min(p_v, q_v), the probability that
speculative sampling accepts the draft's token. Each has a closed-form gradient in the logits
z, computed chunk by chunk; ``lk_lambda`` mixes with a weight that depends on the mean α of
a whole TTT step, so it first runs a pass without gradients for α (``lk_lambda_kl_weights``).

Shape suffixes: n rows (counted positions of all steps), H draft hidden, W draft vocab,
M teacher rows (flattened batch positions), c rows of one chunk, g groups (TTT steps).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import torch

from eagleforge.batch import CHUNK_BYTES, chunk_bytes, rows_per_chunk
from eagleforge.errors import ConfigError

# The kl loss holds two such buffers per chunk (logits turned log-probs turned gradient, and
# the teacher rows), so it uses half the budget each -- but at least LOSS_MIN_ROWS rows, since
# every chunk also reads and writes the whole [W, H] lm_head gradient buffer once. Other kinds
# scale both by their buffers (``loss_chunk_rows``).
LOSS_CHUNK_BYTES = CHUNK_BYTES // 2
LOSS_MIN_ROWS = 256

# neg_log_alpha's floor under α (speculators' ``_NLA_EPS``): below it the loss is constant.
NEG_LOG_ALPHA_EPS = 1e-5
# reverse_kl reads log p at teacher probabilities that are exactly 0 (softmax underflow in
# fp32, or rows never computed) as log of the smallest normal fp32: the stored teacher cannot
# tell smaller values apart, and log 0 = -inf would make KL(q || p) infinite.
REVERSE_KL_MIN_PROB = torch.finfo(torch.float32).tiny


class LossKind(str, Enum):
    """The draft's training loss per counted position (formulas in docs/losses.md)."""

    kl = "kl"  # soft cross-entropy -Σ p log q: forward KL(p || q) up to the teacher's entropy
    lk_alpha = "lk_alpha"  # SpecForge's LK-α: step mean of -log α
    lk_lambda = "lk_lambda"  # SpecForge's LK-λ: w·CE + (1-w)·(1-ᾱ), w from the step's mean α
    tv = "tv"  # total variation 1 - α (speculators' tv)
    neg_log_alpha = "neg_log_alpha"  # -log max(α, 1e-5) (speculators' nla)
    kl_tv = "kl_tv"  # λ·KL + (1-λ)·(1-α), λ = exp(-η·α) per row (speculators' lk_hybrid)
    jsd = "jsd"  # Jensen-Shannon divergence (speculators' jsd)
    reverse_kl = "reverse_kl"  # KL(q || p) (speculators' rkl)


class LossKernel(str, Enum):
    """What computes the lm_head's loss chunks (docs/performance.md#the-loss-and-the-teacher)."""

    auto = "auto"  # triton on CUDA where triton imports and the kind has it, else torch
    torch = "torch"  # the chunked torch path: every device, every kind (the reference)
    triton = "triton"  # two Triton kernels over logits kept in the matmul's dtype (CUDA)


# The kinds the Triton kernels compute: the cross-entropy, α, and mixes of the two.
TRITON_KINDS = frozenset(
    {
        LossKind.kl,
        LossKind.tv,
        LossKind.neg_log_alpha,
        LossKind.lk_alpha,
        LossKind.kl_tv,
        LossKind.lk_lambda,
    }
)


@dataclass
class LossConfig:
    """The `loss` config section: what the draft is trained to match (see docs/losses.md)."""

    # Loss per counted position; kl (default) is the soft cross-entropy of EAGLE-3.
    kind: LossKind = LossKind.kl
    # lk_lambda: the KL weight at ᾱ = 0, w = kl_scale · exp(-kl_decay · ᾱ) (SpecForge: 1.0).
    kl_scale: float = 1.0
    # lk_lambda: decay of w with the step's mean α (SpecForge default 1.0; the LK paper uses 3).
    kl_decay: float = 1.0
    # kl_tv: λ = exp(-kl_tv_eta · α) per position (speculators' lk_hybrid eta, the paper's 3.0).
    kl_tv_eta: float = 3.0
    # auto | torch | triton: what computes the lm_head and the loss, chunk by chunk. auto is
    # triton on CUDA where the triton package imports and the kind has its kernel, else torch.
    kernel: LossKernel = LossKernel.auto

    def kernel_for(self, device: torch.device) -> LossKernel:
        """The kernel that runs on ``device``; ConfigError where ``triton`` cannot."""
        problem = None
        # On CPU only Triton's interpreter runs the kernels (slow: for checking them), and
        # only when asked for by name
        interpreted = os.environ.get("TRITON_INTERPRET") == "1" and self.kernel != LossKernel.auto
        if device.type != "cuda" and not interpreted:
            problem = f"it runs on CUDA, and this run trains on {device.type}"
        elif self.kind not in TRITON_KINDS:
            problem = (
                f"loss.kind={self.kind.value} has no Triton kernel (it has: "
                f"{', '.join(sorted(k.value for k in TRITON_KINDS))})"
            )
        elif importlib.util.find_spec("triton") is None:
            problem = "the triton package is not installed"
        if self.kernel == LossKernel.triton and problem is not None:
            raise ConfigError(f"loss.kernel=triton: {problem}; set loss.kernel=torch or auto.")
        if self.kernel == LossKernel.auto:
            return LossKernel.torch if problem is not None else LossKernel.triton
        return self.kernel

    def __post_init__(self) -> None:
        for name in ("kl_scale", "kl_decay", "kl_tv_eta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"loss.{name} must be a finite number >= 0, got {value}.")
        if self.kl_scale > 1:
            # above 1 the acceptance term's weight 1 - w turns negative at small ᾱ
            raise ConfigError(
                f"loss.kl_scale must be in [0, 1] (1 - w weighs the acceptance term), got "
                f"{self.kl_scale}."
            )


# How many [c, W] compute-dtype buffers each kind holds at its peak: a bool mask counts 1/4,
# a row-blocked temporary of ``_row_sums`` 1/8. Chunks get kl's rows times kl's buffers over
# the kind's, so every kind peaks at kl's bytes (tests/unit/test_losses.py measures it).
LOSS_BUFFERS = {
    LossKind.kl: 2.125,  # logits turned gradient, teacher; α's temporary
    LossKind.reverse_kl: 2.25,  # logits, teacher turned log-ratio; α's two temporaries
    LossKind.tv: 2.25,  # probabilities, teacher turned ∂α/∂z, mask p > q
    LossKind.neg_log_alpha: 2.25,
    LossKind.lk_alpha: 2.25,
    LossKind.jsd: 3.0,  # logits, teacher, log of the mixture turned gradient
    LossKind.kl_tv: 3.25,  # probabilities, teacher turned gradient, ∂α/∂z, mask
    LossKind.lk_lambda: 3.25,
}


def loss_chunk_rows(kind: LossKind, width: int, device: torch.device | None = None) -> int:
    """Rows per chunk for ``kind`` over a [width] vocabulary (kl: the rows it always had; on
    CUDA, ``chunk_bytes``'s larger budget)."""
    share = LOSS_BUFFERS[LossKind.kl] / LOSS_BUFFERS[kind]
    budget = LOSS_CHUNK_BYTES if device is None else chunk_bytes(device) // 2
    return rows_per_chunk(width, int(budget * share), math.ceil(LOSS_MIN_ROWS * share))


def _row_sums(fn: Callable[..., torch.Tensor], *tensors_cW: torch.Tensor) -> torch.Tensor:
    """Σ_v fn(*tensors)[r, v] per row, an eighth of the rows at a time, so the temporary that
    ``fn`` builds is 1/8 of a chunk buffer rather than a whole one."""
    rows = tensors_cW[0].shape[0]
    step = max(1, -(-rows // 8))
    return torch.cat(
        [fn(*(t[s : s + step] for t in tensors_cW)).sum(-1) for s in range(0, rows, step)]
    )


def _dot(a_cW: torch.Tensor, b_cW: torch.Tensor) -> torch.Tensor:
    """Row-wise Σ_v a·b as a batched dot product: no [c, W] product tensor."""
    return (a_cW.unsqueeze(1) @ b_cW.unsqueeze(2)).view(-1)


def _overlap_of_log_q(p_cW: torch.Tensor, logq_cW: torch.Tensor) -> torch.Tensor:
    """α = Σ min(p, exp(log q)) per row, for kinds that still need log q afterwards."""
    return _row_sums(lambda p, logq: torch.minimum(p, logq.exp()), p_cW, logq_cW)


def _grad_overlap(q_cW: torch.Tensor, above_cW: torch.Tensor, out_cW: torch.Tensor) -> torch.Tensor:
    """∂α/∂z = q ⊙ (1[p > q] - S), S = Σ q·1[p > q], written into ``out_cW``.

    Where p = q exactly (measure zero) the minimum is read as p, so that entry has no gradient.
    """
    grad_cW = torch.mul(q_cW, above_cW, out=out_cW)
    return grad_cW.addcmul_(q_cW, grad_cW.sum(-1, keepdim=True), value=-1)


# A kind's chunk: (log q [c, W], teacher p [c, W], with_grad, config, lk_lambda's KL weight per
# row or None) -> (loss [c], α [c], ∂Σloss/∂z [c, W] or None). Both buffers may be overwritten.
ChunkFn = Callable[
    [torch.Tensor, torch.Tensor, bool, LossConfig, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
]


def _kl_chunk(
    logq_cW: torch.Tensor,
    p_cW: torch.Tensor,
    with_grad: bool,
    config: LossConfig,
    kl_weight_c: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    loss_c = -_dot(p_cW, logq_cW)
    q_cW = logq_cW.exp_()
    alpha_c = _row_sums(torch.minimum, p_cW, q_cW)
    if not with_grad:
        return loss_c, alpha_c, None
    # d/dz of -Σ p log softmax(z) = softmax(z)·Σp - p (exact for rows whose p does not sum to 1)
    return loss_c, alpha_c, q_cW.mul_(p_cW.sum(-1, keepdim=True)).sub_(p_cW)


def _reverse_kl_chunk(
    logq_cW: torch.Tensor,
    p_cW: torch.Tensor,
    with_grad: bool,
    config: LossConfig,
    kl_weight_c: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    alpha_c = _overlap_of_log_q(p_cW, logq_cW)
    # h = log q - log max(p, tiny), in the teacher's buffer
    h_cW = p_cW.clamp_(min=REVERSE_KL_MIN_PROB).log_().neg_().add_(logq_cW)
    q_cW = logq_cW.exp_()
    loss_c = _dot(q_cW, h_cW)
    if not with_grad:
        return loss_c, alpha_c, None
    # d/dz of Σ q·h = q ⊙ (h - Σ q·h): the +1 of d(q log q)/dq cancels since Σ q = 1
    return loss_c, alpha_c, h_cW.sub_(loss_c[:, None]).mul_(q_cW)


def _jsd_chunk(
    logq_cW: torch.Tensor,
    p_cW: torch.Tensor,
    with_grad: bool,
    config: LossConfig,
    kl_weight_c: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    alpha_c = _overlap_of_log_q(p_cW, logq_cW)
    plogp_c = _row_sums(torch.special.xlogy, p_cW, p_cW)  # 0 log 0 = 0
    # log m = log((p + q) / 2) from log p (-inf where p = 0) and log q: finite everywhere
    logm_cW = torch.log(p_cW)
    torch.logaddexp(logm_cW, logq_cW, out=logm_cW).sub_(math.log(2.0))
    p_logm_c = _dot(p_cW, logm_cW)
    del p_cW
    d_cW = logm_cW.neg_().add_(logq_cW)  # log q - log m
    q_cW = logq_cW.exp_()
    q_d_c = _dot(q_cW, d_cW)
    loss_c = 0.5 * (plogp_c - p_logm_c) + 0.5 * q_d_c
    if not with_grad:
        return loss_c, alpha_c, None
    # dJSD/dq_v = ½ log(q_v / m_v) (the p- and q-terms of dm cancel), then through softmax
    return loss_c, alpha_c, d_cW.sub_(q_d_c[:, None]).mul_(q_cW).mul_(0.5)


def acceptance_terms(
    config: LossConfig,
    alpha_c: torch.Tensor,
    ce_c: torch.Tensor | None,
    plogp_c: torch.Tensor | None,
    kl_weight_c: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The kinds built from the cross-entropy CE and α, per row: the loss, and the coefficients
    of its gradient ∂loss/∂z = a·∂CE/∂z + b·∂α/∂z (``a`` None: no CE term). ``plogp_c``,
    Σ p log p, is read by kl_tv (its KL) alone."""
    kind = config.kind
    a_c: torch.Tensor | None = None
    if kind == LossKind.kl:
        assert ce_c is not None
        loss_c, a_c, b_c = ce_c, torch.ones_like(ce_c), torch.zeros_like(ce_c)
    elif kind == LossKind.tv:
        loss_c, b_c = 1 - alpha_c, torch.full_like(alpha_c, -1.0)
    elif kind == LossKind.neg_log_alpha:
        # speculators clamps α: below the floor the loss is constant, without gradient
        loss_c = -alpha_c.clamp(min=NEG_LOG_ALPHA_EPS).log()
        b_c = torch.where(alpha_c >= NEG_LOG_ALPHA_EPS, -1 / alpha_c, 0.0)
    elif kind == LossKind.lk_alpha:
        # SpecForge reads log α = 0 where α = 0 (a row with no teacher mass): no loss, no gradient
        positive_c = alpha_c > 0
        loss_c = torch.where(positive_c, -alpha_c.log(), 0.0)
        b_c = torch.where(positive_c, -1 / alpha_c, 0.0)
    elif kind == LossKind.kl_tv:
        assert ce_c is not None
        # KL(p || q) = Σ p log p + CE; λ is a constant of the gradient (speculators detach α)
        lam_c = torch.exp(-config.kl_tv_eta * alpha_c)
        assert plogp_c is not None
        loss_c = lam_c * (plogp_c + ce_c) + (1 - lam_c) * (1 - alpha_c)
        a_c, b_c = lam_c, lam_c - 1
    elif kind == LossKind.lk_lambda:
        assert ce_c is not None
        if kl_weight_c is None:
            raise ValueError("lk_lambda needs each row's KL weight: call chunked_loss")
        # SpecForge mixes its KL loss -- the cross-entropy -Σ p log q -- not KL itself
        loss_c = kl_weight_c * ce_c + (1 - kl_weight_c) * (1 - alpha_c)
        a_c, b_c = kl_weight_c, kl_weight_c - 1
    else:
        raise ValueError(f"not a loss of the cross-entropy and α: {kind}")
    return loss_c, a_c, b_c


def _acceptance_chunk(
    logq_cW: torch.Tensor,
    p_cW: torch.Tensor,
    with_grad: bool,
    config: LossConfig,
    kl_weight_c: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kinds built from α (and, for kl_tv and lk_lambda, the cross-entropy)."""
    with_ce = config.kind in (LossKind.kl_tv, LossKind.lk_lambda)
    ce_c = -_dot(p_cW, logq_cW) if with_ce else None
    q_cW = logq_cW.exp_()
    alpha_c = _row_sums(torch.minimum, p_cW, q_cW)
    plogp_c = _row_sums(torch.special.xlogy, p_cW, p_cW) if config.kind == LossKind.kl_tv else None
    loss_c, a_c, b_c = acceptance_terms(config, alpha_c, ce_c, plogp_c, kl_weight_c)
    if not with_grad:
        return loss_c, alpha_c, None
    above_cW = p_cW > q_cW
    if a_c is None:  # the teacher rows are not needed any more: ∂α/∂z in their buffer
        return loss_c, alpha_c, _grad_overlap(q_cW, above_cW, p_cW).mul_(b_c[:, None])
    grad_alpha_cW = _grad_overlap(q_cW, above_cW, torch.empty_like(q_cW))
    del above_cW
    # a·(q·Σp - p) + b·∂α/∂z, in the teacher's buffer
    a_cW = a_c[:, None]
    mass_cW = p_cW.sum(-1, keepdim=True)
    grad_cW = p_cW.mul_(-a_cW).addcmul_(q_cW, a_cW * mass_cW)
    return loss_c, alpha_c, grad_cW.add_(grad_alpha_cW.mul_(b_c[:, None]))


CHUNK_FNS: dict[LossKind, ChunkFn] = {
    LossKind.kl: _kl_chunk,
    LossKind.reverse_kl: _reverse_kl_chunk,
    LossKind.jsd: _jsd_chunk,
    LossKind.tv: _acceptance_chunk,
    LossKind.neg_log_alpha: _acceptance_chunk,
    LossKind.lk_alpha: _acceptance_chunk,
    LossKind.kl_tv: _acceptance_chunk,
    LossKind.lk_lambda: _acceptance_chunk,
}


class _Chunked(NamedTuple):
    loss_n: torch.Tensor
    argmax_n: torch.Tensor
    alpha_n: torch.Tensor
    grad_hidden_nH: torch.Tensor | None
    grad_weight_WH: torch.Tensor | None


def _outputs(
    hidden_nH: torch.Tensor, weight_WH: torch.Tensor, dtype: torch.dtype, with_grad: bool
) -> _Chunked:
    """A chunk loop's buffers, filled chunk by chunk: per-row results in ``dtype``, and with
    ``with_grad`` the gradients (the lm_head's summed in ``dtype``)."""
    rows, device = hidden_nH.shape[0], hidden_nH.device
    return _Chunked(
        torch.empty(rows, dtype=dtype, device=device),
        torch.empty(rows, dtype=torch.long, device=device),
        torch.empty(rows, dtype=dtype, device=device),
        torch.empty_like(hidden_nH) if with_grad else None,
        torch.zeros_like(weight_WH, dtype=dtype) if with_grad else None,
    )


# The Triton path's chunk: one [rows, W] buffer in the matmul's dtype (bf16 in training) and no
# fp32 copy, so its chunks are larger -- and its matmuls fill a GPU better -- at kl's bytes.
FUSED_CHUNK_BYTES = 256 * 2**20
FUSED_MIN_ROWS = 1024


def fused_chunk_rows(width: int, dtype: torch.dtype) -> int:
    """Rows per chunk of the Triton path over a [width] vocabulary in ``dtype``."""
    row_bytes = width * torch.empty((), dtype=dtype).element_size()
    return max(FUSED_MIN_ROWS, FUSED_CHUNK_BYTES // row_bytes)


def fused_chunk_loop(
    hidden_nH: torch.Tensor,
    weight_WH: torch.Tensor,
    teacher_MW: torch.Tensor,
    teacher_rows_n: torch.Tensor,
    scale_n: torch.Tensor | None,
    kl_weight_n: torch.Tensor | None,
    config: LossConfig,
    chunk_size: int | None,
    with_grad: bool,
) -> _Chunked:
    """``_chunk_loop`` with the row work in ``draft/fused_loss.py``'s kernels: the logits stay
    in the hidden state's dtype, the gradient is written over them, the teacher rows are read
    in place. The lm_head gradient sums each chunk's product in fp32 (a bf16 product per
    chunk: bf16 tolerance, as the matmul itself)."""
    from eagleforge.draft import fused_loss  # triton: imported only where this path runs

    rows, width = hidden_nH.shape[0], weight_WH.shape[0]
    device = hidden_nH.device
    # the matmul's dtype: autocast's where it is on (the trainer's bf16), else the input's
    if torch.is_autocast_enabled(device.type):
        mm_dtype = torch.get_autocast_dtype(device.type)
    elif hidden_nH.dtype in (torch.bfloat16, torch.float16):
        mm_dtype = hidden_nH.dtype
    else:
        mm_dtype = torch.promote_types(hidden_nH.dtype, torch.float32)
    if chunk_size is None:
        chunk_size = fused_chunk_rows(width, mm_dtype)
    with_grad = with_grad and scale_n is not None
    loss_n, argmax_n, alpha_n, grad_hidden, grad_weight = _outputs(
        hidden_nH, weight_WH, torch.float32, with_grad
    )
    weight = weight_WH.to(mm_dtype)
    teacher_MW = teacher_MW if teacher_MW.stride(-1) == 1 else teacher_MW.contiguous()
    teacher_rows = teacher_rows_n.contiguous()
    for start in range(0, rows, chunk_size):
        end = min(start + chunk_size, rows)
        h_cH = hidden_nH[start:end].to(mm_dtype)
        z_cW = h_cH @ weight.T
        rows_c = teacher_rows[start:end]
        stats = fused_loss.row_stats(z_cW, teacher_MW, rows_c)
        kl_weight_c = None if kl_weight_n is None else kl_weight_n[start:end].float()
        loss_c, a_c, b_c = acceptance_terms(
            config,
            stats.alpha_c,
            stats.ce_c,
            stats.plogp_c,
            kl_weight_c,
        )
        loss_n[start:end], alpha_n[start:end] = loss_c, stats.alpha_c
        argmax_n[start:end] = stats.argmax_c
        if grad_hidden is not None and grad_weight is not None:
            assert scale_n is not None
            scale_c = scale_n[start:end].float()
            a_c = torch.zeros_like(b_c) if a_c is None else a_c
            g_cW = fused_loss.row_grad(
                z_cW, teacher_MW, rows_c, stats, a_c * scale_c, b_c * scale_c
            )
            grad_hidden[start:end] = (g_cW @ weight).to(hidden_nH.dtype)
            grad_weight.add_(g_cW.T @ h_cH)
        del z_cW
    return _Chunked(loss_n, argmax_n, alpha_n, grad_hidden, grad_weight)


def _chunk_loop(
    hidden_nH: torch.Tensor,
    weight_WH: torch.Tensor,
    teacher_MW: torch.Tensor,
    teacher_rows_n: torch.Tensor,
    scale_n: torch.Tensor | None,
    kl_weight_n: torch.Tensor | None,
    config: LossConfig,
    chunk_size: int | None,
    with_grad: bool,
) -> _Chunked:
    rows = hidden_nH.shape[0]
    if chunk_size is None:
        chunk_size = loss_chunk_rows(config.kind, weight_WH.shape[0], hidden_nH.device)
    # half-precision logits are upcast: the softmax over W terms needs fp32 at least
    compute = torch.promote_types(hidden_nH.dtype, torch.float32)
    with_grad = with_grad and scale_n is not None
    loss_n, argmax_n, alpha_n, grad_hidden, grad_weight = _outputs(
        hidden_nH, weight_WH, compute, with_grad
    )
    chunk_fn = CHUNK_FNS[config.kind]
    for start in range(0, rows, chunk_size):
        end = min(start + chunk_size, rows)
        h_cH = hidden_nH[start:end]
        # The logits buffer is turned into log-probs, then probs, then (most kinds) the logit
        # gradient, in place; the kind's function holds the teacher rows and its own buffers.
        z_cW = (h_cH @ weight_WH.T).to(compute)
        argmax_n[start:end] = z_cW.argmax(dim=-1)
        z_cW.sub_(torch.logsumexp(z_cW, dim=-1, keepdim=True))
        loss_c, alpha_c, g_cW = chunk_fn(
            z_cW,
            teacher_MW[teacher_rows_n[start:end]].to(compute),
            with_grad,
            config,
            None if kl_weight_n is None else kl_weight_n[start:end].to(compute),
        )
        loss_n[start:end], alpha_n[start:end] = loss_c, alpha_c
        if g_cW is not None and grad_hidden is not None and grad_weight is not None:
            assert scale_n is not None
            g_cW.mul_(scale_n[start:end, None].to(compute))
            grad_hidden[start:end] = (g_cW.to(weight_WH.dtype) @ weight_WH).to(hidden_nH.dtype)
            grad_weight.addmm_(g_cW.T, h_cH.to(compute))
        # freed before the next chunk's logits exist, or two chunks' buffers would overlap
        del z_cW, g_cW
    return _Chunked(loss_n, argmax_n, alpha_n, grad_hidden, grad_weight)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_nH: torch.Tensor,
        weight_WH: torch.Tensor,
        teacher_MW: torch.Tensor,
        teacher_rows_n: torch.Tensor,
        scale_n: torch.Tensor | None,
        kl_weight_n: torch.Tensor | None,
        config: LossConfig,
        chunk_size: int | None,
        with_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        loop = fused_chunk_loop if config.kernel == LossKernel.triton else _chunk_loop
        out = loop(
            hidden_nH,
            weight_WH,
            teacher_MW,
            teacher_rows_n,
            scale_n,
            kl_weight_n,
            config,
            chunk_size,
            with_grad,
        )
        grads = (out.grad_hidden_nH, out.grad_weight_WH)
        ctx.save_for_backward(*(t for t in grads if t is not None))
        ctx.weight_dtype = weight_WH.dtype
        ctx.mark_non_differentiable(out.loss_n, out.argmax_n, out.alpha_n)
        weighted = (
            (out.loss_n * scale_n.to(out.loss_n.dtype)).sum()
            if scale_n is not None
            else torch.zeros((), dtype=out.loss_n.dtype, device=hidden_nH.device)
        )
        return weighted, out.loss_n, out.argmax_n, out.alpha_n

    @staticmethod
    def backward(ctx: Any, grad_weighted: torch.Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if not ctx.saved_tensors:
            raise RuntimeError("chunked_loss kept no gradients: give scale_n, with grad enabled")
        grad_hidden, grad_weight = ctx.saved_tensors
        # in place: the [W, H] buffer is the largest tensor here (a second backward through
        # this graph is refused by autograd's saved-tensor version check)
        return (
            grad_hidden.mul_(grad_weighted),
            grad_weight.mul_(grad_weighted).to(ctx.weight_dtype),
            *(None,) * 7,
        )


class ChunkedLoss(NamedTuple):
    """What ``chunked_loss`` returns; only ``weighted`` is differentiable."""

    weighted: torch.Tensor  # Σ_r scale_r · loss_r (0 without scale_n)
    loss_n: torch.Tensor  # the kind's loss per row
    argmax_n: torch.Tensor  # argmax of the draft's logits per row (draft-vocab id)
    alpha_n: torch.Tensor  # expected acceptance Σ_v min(p_v, q_v) per row


def lk_lambda_kl_weights(
    alpha_n: torch.Tensor, group_n: torch.Tensor, num_groups: int, config: LossConfig
) -> torch.Tensor:
    """LK-λ's KL weight per row, w = kl_scale · exp(-kl_decay · ᾱ_g): ᾱ_g is the mean α over
    the rows of the row's group (TTT step) in this call, a constant of the gradient as in
    SpecForge (``acc_det``)."""
    count_g = torch.zeros(num_groups, dtype=alpha_n.dtype, device=alpha_n.device)
    count_g.index_add_(0, group_n, torch.ones_like(alpha_n))
    mean_g = torch.zeros_like(count_g).index_add_(0, group_n, alpha_n) / count_g.clamp(min=1)
    return (config.kl_scale * torch.exp(-config.kl_decay * mean_g))[group_n]


def chunked_loss(
    hidden_nH: torch.Tensor,
    weight_WH: torch.Tensor,
    teacher_MW: torch.Tensor,
    teacher_rows_n: torch.Tensor,
    scale_n: torch.Tensor | None = None,
    chunk_size: int | None = None,
    loss: LossConfig | None = None,
    group_n: torch.Tensor | None = None,
    num_groups: int = 1,
) -> ChunkedLoss:
    """The ``loss`` kind of ``softmax(h·Wᵀ)`` against ``teacher_MW[teacher_rows_n]`` per row.

    Gradients of ``weighted`` are computed (in this forward pass) only when ``scale_n`` is
    given and autograd is recording. ``group_n`` (values below ``num_groups``; default: one
    group) says which rows share lk_lambda's mean α -- the TTT step.

    lk_lambda's KL weight needs the mean α of every row of a group before any row's gradient,
    so it runs the chunks twice: once without gradients for α, then with them. The first pass
    costs one more lm_head matmul (2·n·H·W FLOPs, a third of the loss's three) and one more
    softmax over [n, W], and no memory beyond [n] vectors; every other kind runs once.
    """
    config = loss if loss is not None else LossConfig()
    with_grad = (
        scale_n is not None
        and torch.is_grad_enabled()
        and (hidden_nH.requires_grad or weight_WH.requires_grad)
    )
    if config.kernel == LossKernel.auto:  # a caller's own: the trainer's comes resolved
        config = dataclasses.replace(config, kernel=config.kernel_for(hidden_nH.device))
    triton = config.kernel == LossKernel.triton
    rows = (hidden_nH, weight_WH, teacher_MW, teacher_rows_n)
    kl_weight_n = None
    if config.kind == LossKind.lk_lambda:
        if group_n is None:
            group_n = torch.zeros_like(teacher_rows_n)
        # α alone, through the tv kind's chunk: the cheapest that computes it
        alpha_first = LossConfig(kind=LossKind.tv, kernel=config.kernel)
        loop = fused_chunk_loop if triton else _chunk_loop
        with torch.no_grad():
            alpha_n = loop(*rows, None, None, alpha_first, chunk_size, False).alpha_n
        kl_weight_n = lk_lambda_kl_weights(alpha_n, group_n, num_groups, config)
    return ChunkedLoss(
        *_ChunkedLoss.apply(*rows, scale_n, kl_weight_n, config, chunk_size, with_grad)
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

    Returns ``(Σ_r scale_r · loss_r, loss_n, argmax_n)`` (the first is 0 without ``scale_n``):
    ``chunked_loss`` with the kl kind.
    """
    out = chunked_loss(hidden_nH, weight_WH, teacher_MW, teacher_rows_n, scale_n, chunk_size)
    return out.weighted, out.loss_n, out.argmax_n
