"""TTT attention: which keys each query of each unrolled step may see, and the eager reference.

Query (i, t) attends to step-0 keys at positions s <= t of the same sequence (causal, padding
excluded) and to the keys of steps 1..i at position t only (the "diagonal"). The eager
implementation materialises that mask over all (i+1)*T keys; it is the reference every fast
backend is tested against.

Backends: ``eager`` (the reference), ``sdpa`` (step-0 keys through PyTorch's flash kernel,
diagonal keys as dot products, merged exactly by log-sum-exp; O(T) extra memory; CPU) and
``flex`` (flex_attention with the TTT mask as a BlockMask; CUDA, forward-only on CPU).
``auto`` is ``sdpa`` on CUDA and, on a CPU, the faster of ``sdpa`` and ``eager`` for each kind
of call, measured once per machine (``FastestAttention``).

Every backend takes ``valid_BT`` (True for real tokens) or None when the batch has no padding,
which lets ``sdpa`` use the plain causal kernel, and ``document_ids_BT`` for packed rows (step-0
attention never crosses a document boundary) or None.

Shape suffixes: B batch, T sequence, S keys, N query heads, K kv heads, J diagonal steps,
D head dim.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from enum import Enum
from typing import Any, Protocol

import torch

from eagleforge.errors import ConfigError
from eagleforge.layers import causal_document_mask
from eagleforge.precision import measured_once

log = logging.getLogger(__name__)


class AttentionBackend(str, Enum):
    """How the TTT attention is computed (see ``draft/attention.py``)."""

    auto = "auto"  # CUDA: sdpa; CPU: the faster of sdpa and eager, measured per machine
    eager = "eager"  # materialised [T, steps*T] mask: the reference
    sdpa = "sdpa"  # PyTorch flash kernel for step-0 keys + log-sum-exp merge of the diagonal
    flex = "flex"  # flex_attention with a BlockMask (CUDA; on CPU forward only)
    flash = "flash"  # as sdpa, with the flash-attn package's varlen kernel (CUDA)
    usp = "usp"  # sequence parallel over the sp ranks: Ulysses all-to-all + ring (offline)


FLASH_CUDA_ONLY = (
    "draft.attention=flash runs on CUDA only (the flash-attn package); "
    "use draft.attention=sdpa or auto on CPU."
)


def ttt_attention_mask(
    valid_BT: torch.Tensor, num_steps: int, document_ids_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean mask [B, T, num_steps * T]: True where query t of step num_steps-1 sees the key.

    With ``document_ids_BT`` (packed rows), step-0 keys must also be in the query's document.
    Padding queries see every earlier real key, so no row is fully masked.
    """
    batch, seq = valid_BT.shape
    step0_BTT = causal_document_mask(valid_BT, document_ids_BT)
    diagonal_BTT = torch.eye(seq, dtype=torch.bool, device=valid_BT.device).expand(batch, seq, seq)
    return torch.cat([step0_BTT] + [diagonal_BTT] * (num_steps - 1), dim=-1)


def eager_ttt_attention(
    q_BNTD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid_BT: torch.Tensor | None,
    document_ids_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the newest step's queries over the keys of all steps so far -> [B, T, N*D].

    ``keys[j]``/``values[j]`` are step j's [B, K, T, D] tensors (RoPE already applied).
    """
    batch, num_heads, seq, head_dim = q_BNTD.shape
    k_BKSD = torch.cat(keys, dim=2)
    v_BKSD = torch.cat(values, dim=2)
    groups = num_heads // k_BKSD.shape[1]
    if groups > 1:
        k_BKSD = k_BKSD.repeat_interleave(groups, dim=1)
        v_BKSD = v_BKSD.repeat_interleave(groups, dim=1)
    scores_BNTS = (q_BNTD @ k_BKSD.transpose(-1, -2)) * head_dim**-0.5
    if valid_BT is None:
        valid_BT = torch.ones(batch, seq, dtype=torch.bool, device=q_BNTD.device)
    mask_B1TS = ttt_attention_mask(valid_BT, len(keys), document_ids_BT).unsqueeze(1)
    scores_BNTS = scores_BNTS.float().masked_fill(~mask_B1TS, float("-inf"))
    probs_BNTS = torch.softmax(scores_BNTS, dim=-1).to(v_BKSD.dtype)
    out_BNTD = probs_BNTS @ v_BKSD
    return out_BNTD.transpose(1, 2).reshape(batch, seq, num_heads * head_dim)


class StepZeroKernel(Protocol):
    """How ``MergedTTTAttention`` attends to the step-0 keys: a flash kernel here, the ring of
    sequence-parallel chunks in ``parallel/usp.py``. Tensors are [B, N, T, D] queries and
    [B, K, T, D] keys and values; the log-sum-exp is [B, N, T]."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse_BNT: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class _CpuFlashKernel:
    """Step-0 attention through PyTorch's CPU flash kernel (causal, or an additive mask).

    Kernels work in [B, N, T, D] / [B, K, T, D] layout and return the log-sum-exp as [B, N, T].
    """

    def __init__(self, mask_B1TT: torch.Tensor | None) -> None:
        self.mask = mask_B1TT

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # under CPU autocast v leaves its linear in bf16, while RoPE's fp32 cos/sin promote q
        # and k: the kernel takes one dtype (no copy when they already agree)
        k, v = k.to(q.dtype), v.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(  # type: ignore[no-any-return]
            q, k, v, 0.0, self.mask is None, attn_mask=self.mask
        )

    def backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse_BNT: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the kernel takes its log-sum-exp in fp32 whatever q's dtype (bf16 weights on CPU);
        # k and v as in forward: autograd casts their gradients back to their own dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(  # type: ignore[no-any-return]
            grad_out, q, k, v, out, lse_BNT.float(), 0.0, self.mask is None, attn_mask=self.mask
        )


class _VarlenFlashKernel:
    """Step-0 attention on CUDA through a variable-length flash kernel: every document (packed
    rows) or row (padded rows) is its own causal sequence, so neither padding nor document
    boundaries need a mask. ``flash_attn=False`` uses the FlashAttention-2 kernel bundled with
    PyTorch, ``True`` the flash-attn package. Both need fp16/bf16: fp32 inputs are computed in
    bf16. Padding positions form their own sequences; their outputs are never used.
    """

    def __init__(
        self,
        q_BNTD: torch.Tensor,
        valid_BT: torch.Tensor | None,
        document_ids_BT: torch.Tensor | None,
        use_flash_attn: bool,
    ) -> None:
        batch, _, seq, _ = q_BNTD.shape
        # One key per sequence: (row, document), and (row, padding) for the padded tail.
        slot_BT = torch.zeros(batch, seq, dtype=torch.long, device=q_BNTD.device)
        if document_ids_BT is not None:
            slot_BT = document_ids_BT.long() + 1
        if valid_BT is not None:
            slot_BT = torch.where(valid_BT.bool(), slot_BT, seq + 1)
        rows_B1 = torch.arange(batch, device=q_BNTD.device).unsqueeze(1)
        flat = (rows_B1 * (seq + 2) + slot_BT).reshape(-1)
        starts = (flat[1:] != flat[:-1]).nonzero().squeeze(1) + 1
        ends = torch.tensor([flat.numel()], device=flat.device)
        self.cu_seqlens = torch.cat([starts.new_zeros(1), starts, ends]).to(torch.int32)
        self.max_len = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        self.use_flash_attn = use_flash_attn
        self.rng_state: Any = None

    @staticmethod
    def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
        """The flash kernels take fp16/bf16 only."""
        return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16

    def _flat(self, x_BHTD: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] -> [B*T, H, D] in the kernel's dtype, as the varlen kernels take it."""
        dtype = self.kernel_dtype(x_BHTD.dtype)
        return x_BHTD.transpose(1, 2).flatten(0, 1).to(dtype).contiguous()

    def _unflat(self, x_ZHD: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        batch, _, seq, _ = like.shape
        return x_ZHD.unflatten(0, (batch, seq)).transpose(1, 2).to(like.dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_ZND, lse_NZ = self.varlen_forward(self._flat(q), self._flat(k), self._flat(v))
        batch, _, seq, _ = q.shape
        lse_BNT = lse_NZ.float().unflatten(1, (batch, seq)).transpose(0, 1)
        return self._unflat(out_ZND, q), lse_BNT

    def backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse_BNT: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse_NZ = lse_BNT.float().transpose(0, 1).flatten(1).contiguous()
        g, qf, kf, vf, of = (self._flat(x) for x in (grad_out, q, k, v, out))
        dq, dk, dv = self.varlen_backward(g, qf, kf, vf, of, lse_NZ)
        return self._unflat(dq, q), self._unflat(dk, k), self._unflat(dv, v)

    # The kernel calls, in the varlen layout: q [Z, N, D], k and v [Z, K, D] (Z = B*T tokens),
    # log-sum-exp [N, Z] fp32; causal within each sequence of ``cu_seqlens``.

    def varlen_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = q.shape[-1] ** -0.5
        cu, n = self.cu_seqlens, self.max_len
        if self.use_flash_attn:
            from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

            out, lse, _, self.rng_state = _flash_attn_varlen_forward(
                q, k, v, cu, cu, n, n, dropout_p=0.0, softmax_scale=scale, causal=True,
                window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                return_softmax=False,
            )  # fmt: skip
            return out, lse
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, n, n, 0.0, True, False, scale=scale
        )
        self.rng_state = (rng_state, unused)
        return out, lse

    def varlen_backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = q.shape[-1] ** -0.5
        cu, n = self.cu_seqlens, self.max_len
        if self.use_flash_attn:
            from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            _flash_attn_varlen_backward(
                grad_out, q, k, v, out, lse, dq, dk, dv, cu, cu, n, n, dropout_p=0.0,
                softmax_scale=scale, causal=True, window_size_left=-1, window_size_right=-1,
                softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=self.rng_state,
            )  # fmt: skip
            return dq, dk, dv
        rng_state, unused = self.rng_state
        grads = torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, cu, cu, n, n, 0.0, True, rng_state, unused, scale=scale
        )
        return grads[0], grads[1], grads[2]


class MergedTTTAttention(torch.autograd.Function):
    """Step-0 keys through a flash kernel, diagonal keys as dot products, merged by log-sum-exp.

    Backward runs the kernel's backward with the *merged* output and log-sum-exp, which gives
    the exact gradients of the union attention with respect to the step-0 part; the diagonal
    part is differentiated by hand. Keys and values stay in their K kv heads (the N = K * G
    query heads are grouped, never the keys repeated), and the diagonal steps' keys are the
    tensors the steps already hold: extra memory is O(T * steps), never O(T^2).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        kernel: StepZeroKernel,
        q_BNTD: torch.Tensor,
        k0_BKTD: torch.Tensor,
        v0_BKTD: torch.Tensor,
        *diagonal: torch.Tensor,  # keys of steps 1..J, then their values, each [B, K, T, D]
    ) -> torch.Tensor:
        scale = q_BNTD.shape[-1] ** -0.5
        kv_heads = k0_BKTD.shape[1]
        kd, vd = diagonal[: len(diagonal) // 2], diagonal[len(diagonal) // 2 :]
        out0, lse0_BNT = kernel.forward(q_BNTD, k0_BKTD, v0_BKTD)
        q_BKGTD = grouped_heads(q_BNTD.float(), kv_heads)
        scores_BKGTJ = (
            torch.stack([(q_BKGTD * k.float().unsqueeze(2)).sum(-1) * scale for k in kd], dim=-1)
            if kd
            else q_BKGTD.new_zeros(*q_BKGTD.shape[:-1], 0)
        )
        lse0_BKGT = grouped_heads(lse0_BNT.float(), kv_heads)
        lse_BKGT = torch.logaddexp(lse0_BKGT, torch.logsumexp(scores_BKGTJ, dim=-1))
        probs_BKGTJ = torch.exp(scores_BKGTJ - lse_BKGT.unsqueeze(-1))
        out = torch.exp(lse0_BKGT - lse_BKGT).unsqueeze(-1) * grouped_heads(out0.float(), kv_heads)
        for j, v in enumerate(vd):
            out += probs_BKGTJ[..., j, None] * v.float().unsqueeze(2)
        out = out.flatten(1, 2).to(q_BNTD.dtype)
        lse_BNT = lse_BKGT.flatten(1, 2)
        ctx.save_for_backward(q_BNTD, k0_BKTD, v0_BKTD, out, lse_BNT, probs_BKGTJ, *diagonal)
        ctx.kernel, ctx.scale = kernel, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k0, v0, out, lse, probs_BKGTJ, *diagonal = ctx.saved_tensors
        kd, vd = diagonal[: len(diagonal) // 2], diagonal[len(diagonal) // 2 :]
        grad_out = grad_out.contiguous()
        dq, dk0, dv0 = ctx.kernel.backward(grad_out, q, k0, v0, out, lse)
        kv_heads = k0.shape[1]
        g_BKGTD = grouped_heads(grad_out.float(), kv_heads)
        q_BKGTD = grouped_heads(q.float(), kv_heads)
        delta_BKGT = (g_BKGTD * grouped_heads(out.float(), kv_heads)).sum(-1)
        dq_BKGTD = grouped_heads(dq.float(), kv_heads)
        dkd, dvd = [], []
        for j, (k, v) in enumerate(zip(kd, vd, strict=True)):
            p_BKGT = probs_BKGTJ[..., j]
            dvd.append((p_BKGT.unsqueeze(-1) * g_BKGTD).sum(2).to(v.dtype))
            dprobs_BKGT = (g_BKGTD * v.float().unsqueeze(2)).sum(-1)
            dscores_BKGT = p_BKGT * (dprobs_BKGT - delta_BKGT) * ctx.scale
            dq_BKGTD += dscores_BKGT.unsqueeze(-1) * k.float().unsqueeze(2)
            dkd.append((dscores_BKGT.unsqueeze(-1) * q_BKGTD).sum(2).to(k.dtype))
        return None, dq_BKGTD.flatten(1, 2).to(q.dtype), dk0, dv0, *dkd, *dvd


def grouped_heads(x_BN: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, N, ...] -> [B, K, G, ...]: query heads grouped by the kv head they share."""
    return x_BN.unflatten(1, (kv_heads, x_BN.shape[1] // kv_heads))


def _merged(
    kernel: StepZeroKernel,
    q_BNTD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> torch.Tensor:
    batch, num_heads, seq, head_dim = q_BNTD.shape
    out = MergedTTTAttention.apply(
        kernel,
        q_BNTD.contiguous(),
        keys[0].contiguous(),
        values[0].contiguous(),
        *keys[1:],
        *values[1:],
    )
    return out.transpose(1, 2).reshape(batch, seq, num_heads * head_dim)  # type: ignore[no-any-return]


def right_padded(valid_BT: torch.Tensor) -> bool:
    """Whether every row's valid positions come first, its padding (if any) last."""
    return bool((valid_BT[:, 1:] <= valid_BT[:, :-1]).all())


def sdpa_ttt_attention(
    q_BNTD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid_BT: torch.Tensor | None,
    document_ids_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as ``eager_ttt_attention`` without materialising the [T, steps*T] scores:
    PyTorch's flash kernels for the step-0 keys (CPU: masked; CUDA: variable-length)."""
    if q_BNTD.device.type == "cuda":
        kernel = _VarlenFlashKernel(q_BNTD, valid_BT, document_ids_BT, use_flash_attn=False)
        return _merged(kernel, q_BNTD, keys, values)
    batch, _, seq, _ = q_BNTD.shape
    mask = None
    # right padding needs no mask: under causal attention a valid query never reaches the
    # padding's keys (and the padding's own outputs are never used), and the causal kernel
    # skips the blocks above the diagonal that a mask makes it compute
    if document_ids_BT is None and (valid_BT is None or right_padded(valid_BT)):
        valid_BT = None
    if valid_BT is not None or document_ids_BT is not None:
        if valid_BT is None:
            valid_BT = torch.ones(batch, seq, dtype=torch.bool, device=q_BNTD.device)
        allowed = ttt_attention_mask(valid_BT, 1, document_ids_BT).unsqueeze(1)
        mask = torch.zeros(allowed.shape, dtype=q_BNTD.dtype, device=q_BNTD.device).masked_fill_(
            ~allowed, float("-inf")
        )
    return _merged(_CpuFlashKernel(mask), q_BNTD, keys, values)


def flash_ttt_attention(
    q_BNTD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid_BT: torch.Tensor | None,
    document_ids_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """As ``sdpa`` on CUDA, with the flash-attn package's variable-length kernel (CUDA only)."""
    if q_BNTD.device.type != "cuda":
        raise ConfigError(FLASH_CUDA_ONLY)
    kernel = _VarlenFlashKernel(q_BNTD, valid_BT, document_ids_BT, use_flash_attn=True)
    return _merged(kernel, q_BNTD, keys, values)


_compiled_flex: Any = None


def _ttt_mask_mod(
    seq: int, valid_BT: torch.Tensor, document_ids_BT: torch.Tensor | None, upto: torch.Tensor
) -> Any:
    """The TTT mask over keys laid out step by step, of steps 0 to ``upto`` (a 0-dim tensor:
    a value the compiled kernel reads, so that every step runs the same kernel)."""

    def ttt_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        position, step = kv_idx % seq, kv_idx // seq
        step0 = (step == 0) & (position <= q_idx) & valid_BT[b, position]
        if document_ids_BT is not None:
            step0 = step0 & (
                (document_ids_BT[b, position] == document_ids_BT[b, q_idx]) | ~valid_BT[b, q_idx]
            )
        return step0 | ((step > 0) & (step <= upto) & (position == q_idx))

    return ttt_mask


class FlexUnroll:
    """flex_attention for one unroll of ``num_steps`` TTT steps, with one kernel for them all.

    Every step's keys are laid out over the slots of all ``num_steps`` steps (the later ones
    zero, and masked), so each step calls the kernel at the same shape: compiled once per
    sequence length (on CUDA) and reused by every step and batch. Each step's block mask
    (its creation compiled too) bounds the steps it sees by a tensor, ``upto``: the later
    steps' blocks are empty, skipped, and no value is baked into a graph. The price is
    memory: each step keeps keys of all steps for its backward, k·T rather than (i+1)·T.
    """

    def __init__(self, num_steps: int) -> None:
        self.num_steps = num_steps

    def __call__(
        self,
        q_BNTD: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        valid_BT: torch.Tensor | None,
        document_ids_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        global _compiled_flex
        batch, num_heads, seq, head_dim = q_BNTD.shape
        if len(keys) > self.num_steps:
            raise ValueError(f"step {len(keys)} of an unroll of {self.num_steps} steps")
        device = q_BNTD.device
        valid = (
            valid_BT.bool()
            if valid_BT is not None
            else torch.ones(batch, seq, dtype=torch.bool, device=device)
        )
        later = [torch.zeros_like(keys[0])] * (self.num_steps - len(keys))
        k_BKSD, v_BKSD = torch.cat([*keys, *later], dim=2), torch.cat([*values, *later], dim=2)
        upto = torch.tensor(len(keys) - 1, device=device)
        block_mask = create_block_mask(
            _ttt_mask_mod(seq, valid, document_ids_BT, upto), batch, None, seq,
            k_BKSD.shape[2], device=device, _compile=device.type == "cuda",
        )  # fmt: skip
        attend = flex_attention
        if device.type == "cuda":
            if _compiled_flex is None:
                _compiled_flex = torch.compile(flex_attention, dynamic=False)
            attend = _compiled_flex
        out = attend(
            q_BNTD, k_BKSD, v_BKSD, block_mask=block_mask, enable_gqa=k_BKSD.shape[1] != num_heads
        )
        return out.transpose(1, 2).reshape(batch, seq, num_heads * head_dim)


def flex_ttt_attention(
    q_BNTD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid_BT: torch.Tensor | None,
    document_ids_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """flex_attention over the keys of all steps with the TTT mask as a BlockMask (one call;
    the TTT unroll uses ``FlexUnroll``, which reuses one kernel across its steps).

    Compiled into a fused kernel on CUDA (forward and backward). On CPU it runs PyTorch's
    unfused reference forward only, which is what the CPU tests check against eager.
    """
    return FlexUnroll(len(keys))(q_BNTD, keys, values, valid_BT, document_ids_BT)


# sdpa | eager: what draft.attention=auto takes on a CPU instead of measuring (the test suite
# sets sdpa, so that its runs compute alike on every machine)
AUTO_ENV = "EAGLEFORGE_ATTENTION_AUTO"
KERNELS_FILE = "kernels.json"


class FastestAttention:
    """``draft.attention=auto`` on a CPU: for each kind of call -- dtype, query and kv heads,
    head width, sequence length (to the next power of two) and whether its rows need a mask
    (packed, or padded other than on the right) -- the faster of ``sdpa`` and ``eager``,
    timed forward and backward on random tensors of that shape the first time this machine
    meets it (``kernels.json`` in eagleforge's cache; ~0.1-3 s once), then read back. Which
    one is faster depends on the CPU: where its flash kernel runs AVX-512, ``sdpa``; on an
    AVX2-only CPU with a mask, often ``eager`` (docs/performance.md#cpu-kinds)."""

    def __init__(self) -> None:
        self.chosen: dict[tuple[Any, ...], AttentionBackend] = {}

    def __call__(
        self,
        q_BNTD: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        valid_BT: torch.Tensor | None,
        document_ids_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _, heads, seq, head_dim = q_BNTD.shape
        masked = document_ids_BT is not None or (
            valid_BT is not None and not right_padded(valid_BT)
        )
        kind = (
            q_BNTD.dtype,
            heads,
            keys[0].shape[1],
            head_dim,
            1 << (seq - 1).bit_length(),
            masked,
        )
        backend = self.chosen.get(kind)
        if backend is None:
            backend = self.chosen[kind] = self.choose(*kind)
        # unmasked rows are told so: the kernel does not test the padding's place again
        valid = valid_BT if masked else None
        return TTT_KERNELS[backend](q_BNTD, keys, values, valid, document_ids_BT)

    def choose(
        self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seq: int, masked: bool
    ) -> AttentionBackend:
        pinned = os.environ.get(AUTO_ENV, "").strip()
        if pinned:
            return AttentionBackend(pinned)
        dtype_name = str(dtype).removeprefix("torch.")
        key = f"ttt_attention/{dtype_name}/{heads}x{kv_heads}x{head_dim}/T{seq}/{'masked' if masked else 'causal'}"
        times = measured_once(
            KERNELS_FILE,
            key,
            lambda: time_ttt_attention(dtype, heads, kv_heads, head_dim, seq, masked),
        )
        backend = AttentionBackend(min(("sdpa", "eager"), key=lambda b: float(times[b])))
        log.info(
            "TTT attention auto at T<=%d (%s, %s): %s (sdpa %.1f ms, eager %.1f ms a step, "
            "measured on this CPU)",
            seq, "masked" if masked else "causal", dtype_name, backend.value,
            1e3 * times["sdpa"], 1e3 * times["eager"],
        )  # fmt: skip
        return backend


def time_ttt_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seq: int, masked: bool
) -> dict[str, float]:
    """Seconds of one forward and backward of each CPU backend over a row of ``seq`` tokens
    and two TTT steps (best of two after a warm-up; a backend slower than the other's whole
    measurement by 4x is timed once). The first call may come from an evaluation: gradients
    are on here whatever the caller's mode."""
    with torch.inference_mode(False), torch.enable_grad():
        generator = torch.Generator().manual_seed(0)

        def tensor(n: int) -> torch.Tensor:
            x = torch.randn(1, n, seq, head_dim, generator=generator)
            return x.to(dtype).requires_grad_()

        q = tensor(heads)
        keys = [tensor(kv_heads) for _ in range(2)]
        values = [tensor(kv_heads) for _ in range(2)]
        valid = torch.ones(1, seq, dtype=torch.bool) if masked else None
        documents = (torch.arange(seq) >= seq // 2).long().unsqueeze(0) if masked else None

        def step(fn: Callable[..., torch.Tensor]) -> float:
            started = time.perf_counter()
            fn(q, keys, values, valid, documents).sum().backward()
            return time.perf_counter() - started

        times: dict[str, float] = {}
        for name, fn in (("sdpa", sdpa_ttt_attention), ("eager", eager_ttt_attention)):
            first = step(fn)
            if times and first > 4 * min(times.values()):
                times[name] = first  # clearly the slower one: no need to time it again
                continue
            times[name] = min(step(fn), step(fn))
    return times


TTT_KERNELS: dict[AttentionBackend, Callable[..., torch.Tensor]] = {
    AttentionBackend.eager: eager_ttt_attention,
    AttentionBackend.sdpa: sdpa_ttt_attention,
}
