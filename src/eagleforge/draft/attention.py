"""TTT attention: which keys each query of each unrolled step may see, and the eager reference.

Query (i, t) attends to step-0 keys at positions s <= t of the same sequence (causal, padding
excluded) and to the keys of steps 1..i at position t only (the "diagonal"). The eager
implementation materialises that mask over all (i+1)*T keys; it is the reference every fast
backend is tested against.

Backends: ``eager`` (the reference), ``sdpa`` (step-0 keys through PyTorch's flash kernel,
diagonal keys as dot products, merged exactly by log-sum-exp; O(T) extra memory; CPU) and
``flex`` (flex_attention with the TTT mask as a BlockMask; CUDA, forward-only on CPU).

Every backend takes ``valid_BT`` (True for real tokens) or None when the batch has no padding,
which lets ``sdpa`` use the plain causal kernel, and ``document_ids_BT`` for packed rows (step-0
attention never crosses a document boundary) or None.

Shape suffixes: B batch, T sequence, S keys, N query heads, K kv heads, J diagonal steps,
D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from eagleforge.errors import ConfigError

SDPA_CPU_ONLY = (
    "draft.attention=sdpa runs on CPU in this release; use draft.attention=eager on CUDA."
)


def ttt_attention_mask(
    valid_BT: torch.Tensor, num_steps: int, document_ids_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean mask [B, T, num_steps * T]: True where query t of step num_steps-1 sees the key.

    With ``document_ids_BT`` (packed rows), step-0 keys must also be in the query's document.
    Padding queries see every earlier real key, so no row is fully masked.
    """
    batch, seq = valid_BT.shape
    device = valid_BT.device
    valid = valid_BT.bool()
    causal_TT = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    step0_BTT = causal_TT.unsqueeze(0) & valid.unsqueeze(1)
    if document_ids_BT is not None:
        same_document = document_ids_BT.unsqueeze(2) == document_ids_BT.unsqueeze(1)
        step0_BTT &= same_document | ~valid.unsqueeze(2)
    diagonal_BTT = torch.eye(seq, dtype=torch.bool, device=device).expand(batch, seq, seq)
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


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):  # type: ignore[no-untyped-def]
    """Causal (or additively masked) attention with its log-sum-exp, PyTorch's CPU flash kernel."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, mask is None, attn_mask=mask
    )


class _MergedTTTAttention(torch.autograd.Function):
    """Step-0 keys through the flash kernel, diagonal keys as dot products, merged by log-sum-exp.

    Backward runs the flash backward with the *merged* output and log-sum-exp, which gives the
    exact gradients of the union attention with respect to the step-0 part; the diagonal part
    is differentiated by hand. Keys and values stay in their K kv heads (the N = K * G query
    heads are grouped, never the keys repeated), and the diagonal steps' keys are the tensors
    the steps already hold: extra memory is O(T * steps), never O(T^2).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_BNTD: torch.Tensor,
        k0_BKTD: torch.Tensor,
        v0_BKTD: torch.Tensor,
        mask_B1TT: torch.Tensor | None,
        *diagonal: torch.Tensor,  # keys of steps 1..J, then their values, each [B, K, T, D]
    ) -> torch.Tensor:
        scale = q_BNTD.shape[-1] ** -0.5
        kd, vd = diagonal[: len(diagonal) // 2], diagonal[len(diagonal) // 2 :]
        out0, lse0_BNT = _flash_cpu(q_BNTD, k0_BKTD, v0_BKTD, mask_B1TT)
        q_BKGTD = _grouped(q_BNTD.float(), k0_BKTD.shape[1])
        scores_BKGTJ = (
            torch.stack([(q_BKGTD * k.float().unsqueeze(2)).sum(-1) * scale for k in kd], dim=-1)
            if kd
            else q_BKGTD.new_zeros(*q_BKGTD.shape[:-1], 0)
        )
        lse_BKGT = torch.logaddexp(
            _grouped(lse0_BNT.float(), k0_BKTD.shape[1]), torch.logsumexp(scores_BKGTJ, dim=-1)
        )
        probs_BKGTJ = torch.exp(scores_BKGTJ - lse_BKGT.unsqueeze(-1))
        out = torch.exp(_grouped(lse0_BNT.float(), k0_BKTD.shape[1]) - lse_BKGT).unsqueeze(
            -1
        ) * _grouped(out0.float(), k0_BKTD.shape[1])
        for j, v in enumerate(vd):
            out += probs_BKGTJ[..., j, None] * v.float().unsqueeze(2)
        out = out.flatten(1, 2).to(q_BNTD.dtype)
        lse_BNT = lse_BKGT.flatten(1, 2)
        ctx.save_for_backward(q_BNTD, k0_BKTD, v0_BKTD, out, lse_BNT, probs_BKGTJ, *diagonal)
        ctx.mask, ctx.scale = mask_B1TT, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k0, v0, out, lse, probs_BKGTJ, *diagonal = ctx.saved_tensors
        kd, vd = diagonal[: len(diagonal) // 2], diagonal[len(diagonal) // 2 :]
        grad_out = grad_out.contiguous()
        dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k0, v0, out, lse.to(q.dtype), 0.0, ctx.mask is None, attn_mask=ctx.mask
        )
        groups = k0.shape[1]
        g_BKGTD = _grouped(grad_out.float(), groups)
        q_BKGTD = _grouped(q.float(), groups)
        delta_BKGT = (g_BKGTD * _grouped(out.float(), groups)).sum(-1)
        dq_BKGTD = _grouped(dq.float(), groups)
        dkd, dvd = [], []
        for j, (k, v) in enumerate(zip(kd, vd, strict=True)):
            p_BKGT = probs_BKGTJ[..., j]
            dvd.append((p_BKGT.unsqueeze(-1) * g_BKGTD).sum(2).to(v.dtype))
            dprobs_BKGT = (g_BKGTD * v.float().unsqueeze(2)).sum(-1)
            dscores_BKGT = p_BKGT * (dprobs_BKGT - delta_BKGT) * ctx.scale
            dq_BKGTD += dscores_BKGT.unsqueeze(-1) * k.float().unsqueeze(2)
            dkd.append((dscores_BKGT.unsqueeze(-1) * q_BKGTD).sum(2).to(k.dtype))
        return dq_BKGTD.flatten(1, 2).to(q.dtype), dk0, dv0, None, *dkd, *dvd


def _grouped(x_BN: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, N, ...] -> [B, K, G, ...]: query heads grouped by the kv head they share."""
    return x_BN.unflatten(1, (kv_heads, x_BN.shape[1] // kv_heads))


def sdpa_ttt_attention(
    q_BNTD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid_BT: torch.Tensor | None,
    document_ids_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as ``eager_ttt_attention`` without materialising the [T, steps*T] scores."""
    if q_BNTD.device.type != "cpu":  # also checked at config time (DraftConfig.attention_for)
        raise ConfigError(SDPA_CPU_ONLY)
    batch, num_heads, seq, head_dim = q_BNTD.shape
    mask = None
    if valid_BT is not None or document_ids_BT is not None:
        if valid_BT is None:
            valid_BT = torch.ones(batch, seq, dtype=torch.bool, device=q_BNTD.device)
        allowed = ttt_attention_mask(valid_BT, 1, document_ids_BT).unsqueeze(1)
        mask = torch.zeros(allowed.shape, dtype=q_BNTD.dtype, device=q_BNTD.device).masked_fill_(
            ~allowed, float("-inf")
        )
    out = _MergedTTTAttention.apply(
        q_BNTD.contiguous(),
        keys[0].contiguous(),
        values[0].contiguous(),
        mask,
        *keys[1:],
        *values[1:],
    )
    return out.transpose(1, 2).reshape(batch, seq, num_heads * head_dim)


_compiled_flex: Any = None


def flex_ttt_attention(
    q_BNTD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid_BT: torch.Tensor | None,
    document_ids_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """flex_attention over the keys of all steps with the TTT mask as a BlockMask.

    Compiled into a fused kernel on CUDA (forward and backward). On CPU it runs PyTorch's
    unfused reference forward only, which is what the CPU tests check against eager.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    batch, num_heads, seq, head_dim = q_BNTD.shape
    k_BKSD, v_BKSD = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    valid = (
        valid_BT.bool()
        if valid_BT is not None
        else torch.ones(batch, seq, dtype=torch.bool, device=q_BNTD.device)
    )

    def ttt_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        position, step = kv_idx % seq, kv_idx // seq
        step0 = (step == 0) & (position <= q_idx) & valid[b, position]
        if document_ids_BT is not None:
            step0 = step0 & (
                (document_ids_BT[b, position] == document_ids_BT[b, q_idx]) | ~valid[b, q_idx]
            )
        return step0 | ((step > 0) & (position == q_idx))

    block_mask = create_block_mask(
        ttt_mask, batch, None, seq, k_BKSD.shape[2], device=q_BNTD.device
    )
    attend = flex_attention
    if q_BNTD.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        attend = _compiled_flex
    out = attend(
        q_BNTD, k_BKSD, v_BKSD, block_mask=block_mask, enable_gqa=k_BKSD.shape[1] != num_heads
    )
    return out.transpose(1, 2).reshape(batch, seq, num_heads * head_dim)
