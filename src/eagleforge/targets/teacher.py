"""The teacher: the target's next-token distribution restricted to the draft vocabulary.

Computed from the target's final (normed) hidden state through its lm_head alone, in chunks
along the sequence, so no [T, V] fp32 tensor is ever held: only [chunk, V] at a time.

Shape suffixes: B batch, T sequence, H target hidden, V target vocab, W draft vocab.
"""

from __future__ import annotations

import torch

from eagleforge.batch import (
    IMAGE_KEYS,
    BlockBatch,
    Teacher,
    TTTBatch,
    chunk_bytes,
    rows_per_chunk,
    shift_left,
    shift_right,
)
from eagleforge.targets.base import TargetBackend, TargetOutput


@torch.no_grad()
def compute_teacher(
    final_hidden_BTH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    draft_ids_W: torch.Tensor,
    t2d_V: torch.Tensor,
    chunk_size: int | None = None,
    needed_BT: torch.Tensor | None = None,
) -> Teacher:
    """Teacher from the target's final hidden states, ``chunk_size`` positions at a time
    (default: as many as make 32 MiB of fp32 logits, 512 MiB on CUDA).

    Only positions in ``needed_BT`` (default: all) go through the lm_head; elsewhere the
    probabilities are zero and ``in_draft`` is False, so those positions never count.
    """
    batch, seq, hidden = final_hidden_BTH.shape
    if needed_BT is None:
        needed_BT = torch.ones(batch, seq, dtype=torch.bool, device=final_hidden_BTH.device)
    if chunk_size is None:
        chunk_size = rows_per_chunk(lm_head_VH.shape[0], chunk_bytes(final_hidden_BTH.device))
    rows_N = needed_BT.reshape(-1).nonzero().squeeze(1)
    flat_NH = final_hidden_BTH.reshape(batch * seq, hidden)
    probs_BTW = torch.zeros(
        batch * seq, draft_ids_W.numel(), dtype=torch.float32, device=flat_NH.device
    )
    target_ids_BT = torch.zeros(batch * seq, dtype=torch.long, device=flat_NH.device)
    for start in range(0, rows_N.numel(), chunk_size):
        rows = rows_N[start : start + chunk_size]
        logits_CV = (flat_NH[rows] @ lm_head_VH.T).float()
        target_ids_BT[rows] = logits_CV.argmax(dim=-1)
        draft_logits_CW = logits_CV.index_select(1, draft_ids_W)
        del logits_CV
        probs_BTW[rows] = draft_logits_CW.sub_(draft_logits_CW.logsumexp(-1, keepdim=True)).exp_()
    needed_flat = needed_BT.reshape(-1)
    return Teacher(
        probs_BTW=probs_BTW.view(batch, seq, -1),
        target_ids_BT=target_ids_BT.view(batch, seq),
        in_draft_BT=(t2d_V[target_ids_BT] & needed_flat).view(batch, seq),
    )


def target_states(target: TargetBackend, batch: dict[str, torch.Tensor]) -> TargetOutput:
    """The target's states of a collated batch: captured (offline, by eagleforge.prepare) or
    computed by the target now (online)."""
    if "aux_hidden" in batch:
        return TargetOutput(
            batch["aux_hidden"], batch["final_hidden"], batch.get("mrope_position_ids")
        )
    # images go only to targets that take them (a VLM batch on another backend fails there)
    images = {k: batch[k] for k in IMAGE_KEYS if k in batch}
    return target.forward(
        batch["input_ids"],
        batch["attention_mask"],
        batch.get("document_ids"),
        batch.get("position_ids"),
        **images,
    )


def block_batch(target: TargetBackend, batch: dict[str, torch.Tensor]) -> BlockBatch:
    """A block draft's batch (no teacher: its labels are the tokens); anchors still to draw."""
    return BlockBatch(
        input_ids_BT=batch["input_ids"],
        valid_BT=batch["attention_mask"],
        loss_mask_BT=batch["loss_mask"],
        aux_BTA=target_states(target, batch).aux_BTA,
        document_ids_BT=batch.get("document_ids"),
        position_ids_BT=batch.get("position_ids"),
    )


def teacher_batch(
    target: TargetBackend,
    batch: dict[str, torch.Tensor],
    draft_ids_W: torch.Tensor,
    t2d_V: torch.Tensor,
    chunk_size: int | None,
    count_after_supervised: bool = False,
) -> TTTBatch:
    """Run the target on a collated batch and assemble what the TTT needs (a ``TTTBatch``).

    Its ``loss_mask_BT`` marks the tokens whose prediction counts: the supervised ones, or
    with ``count_after_supervised`` each token after a supervised one in its document (the
    draft's ``LossPositions.fed``)."""
    document_ids, position_ids = batch.get("document_ids"), batch.get("position_ids")
    out = target_states(target, batch)
    valid_BT = batch["attention_mask"].bool()
    loss_mask_BT = batch["loss_mask"].bool()
    if count_after_supervised:
        loss_mask_BT = shift_right(loss_mask_BT, 1) & valid_BT
        if document_ids is not None:
            loss_mask_BT &= shift_right(document_ids, 1) == document_ids
    # The teacher at position p is only ever used to predict a counted token x_{p+1}.
    needed_BT = shift_left(loss_mask_BT & valid_BT, 1)
    teacher = compute_teacher(
        out.final_hidden_BTH, target.lm_head_weight(), draft_ids_W, t2d_V, chunk_size, needed_BT
    )
    return TTTBatch(
        input_ids_BT=batch["input_ids"],
        valid_BT=batch["attention_mask"],
        loss_mask_BT=loss_mask_BT,
        aux_BTA=out.aux_BTA,
        teacher=teacher,
        document_ids_BT=document_ids,
        position_ids_BT=position_ids,
        position_ids_3BT=out.position_ids_3BT,
    )
