"""TTT attention: which keys each query of each unrolled step may see, and the eager reference.

Query (i, t) attends to step-0 keys at positions s <= t of the same sequence (causal, padding
excluded) and to the keys of steps 1..i at position t only (the "diagonal"). The eager
implementation materialises that mask over all (i+1)*T keys; it is the reference every fast
backend is tested against.

Shape suffixes: B batch, T sequence, S keys, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import torch


def ttt_attention_mask(valid_BT: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Boolean mask [B, T, num_steps * T]: True where query t of step num_steps-1 sees the key."""
    batch, seq = valid_BT.shape
    device = valid_BT.device
    causal_TT = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    step0_BTT = causal_TT.unsqueeze(0) & valid_BT.bool().unsqueeze(1)
    diagonal_BTT = torch.eye(seq, dtype=torch.bool, device=device).expand(batch, seq, seq)
    return torch.cat([step0_BTT] + [diagonal_BTT] * (num_steps - 1), dim=-1)


def eager_ttt_attention(
    q_BNTD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid_BT: torch.Tensor,
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
    mask_B1TS = ttt_attention_mask(valid_BT, len(keys)).unsqueeze(1)
    scores_BNTS = scores_BNTS.float().masked_fill(~mask_B1TS, float("-inf"))
    probs_BNTS = torch.softmax(scores_BNTS, dim=-1).to(v_BKSD.dtype)
    out_BNTD = probs_BNTS @ v_BKSD
    return out_BNTD.transpose(1, 2).reshape(batch, seq, num_heads * head_dim)
