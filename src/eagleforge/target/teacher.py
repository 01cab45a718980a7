"""The teacher: the target's next-token distribution restricted to the draft vocabulary.

Computed from the target's final (normed) hidden state through its lm_head alone, in chunks
along the sequence, so no [T, V] fp32 tensor is ever held: only [chunk, V] at a time.

Shape suffixes: B batch, T sequence, H target hidden, V target vocab, W draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Teacher:
    """What the loss needs from the target at each position t (predicting x_{t+1})."""

    probs_BTW: torch.Tensor  # fp32 softmax over draft-vocab ids, renormalised
    target_ids_BT: torch.Tensor  # argmax over the full target vocab
    in_draft_BT: torch.Tensor  # bool: that argmax is a draft-vocab id


@torch.no_grad()
def compute_teacher(
    final_hidden_BTH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    draft_ids_W: torch.Tensor,
    t2d_V: torch.Tensor,
    chunk_size: int = 1024,
) -> Teacher:
    """Teacher from the target's final hidden states, ``chunk_size`` positions at a time."""
    batch, seq, hidden = final_hidden_BTH.shape
    flat_NH = final_hidden_BTH.reshape(batch * seq, hidden)
    probs, target_ids = [], []
    for start in range(0, flat_NH.shape[0], chunk_size):
        logits_CV = (flat_NH[start : start + chunk_size] @ lm_head_VH.T).float()
        target_ids.append(logits_CV.argmax(dim=-1))
        probs.append(torch.softmax(logits_CV[:, draft_ids_W], dim=-1))
    target_ids_BT = torch.cat(target_ids).view(batch, seq)
    return Teacher(
        probs_BTW=torch.cat(probs).view(batch, seq, -1),
        target_ids_BT=target_ids_BT,
        in_draft_BT=t2d_V[target_ids_BT],
    )


def teacher_batch(
    target,  # type: ignore[no-untyped-def]  # a TargetBackend
    batch: dict[str, torch.Tensor],
    draft_ids_W: torch.Tensor,
    t2d_V: torch.Tensor,
    chunk_size: int,
):  # type: ignore[no-untyped-def]
    """Run the target on a collated batch and assemble what the TTT needs (a ``TTTBatch``)."""
    from eagleforge.draft.ttt import TTTBatch

    out = target.forward(batch["input_ids"], batch["attention_mask"])
    teacher = compute_teacher(out.final_hidden_BTH, target.lm_head_weight(), draft_ids_W, t2d_V, chunk_size)
    return TTTBatch(
        input_ids_BT=batch["input_ids"],
        valid_BT=batch["attention_mask"],
        loss_mask_BT=batch["loss_mask"],
        aux_BTA=out.aux_BTA,
        teacher=teacher,
    )
