"""The two draft families behind one small surface: the draft module, its training module and
its batch (EAGLE-3: ``model.py`` / ``ttt.py``, a ``TTTBatch``; DFlash: ``dflash.py``, a
``BlockBatch``), and a whole copy of a draft (rank 0's replica of a sharded one)."""

from __future__ import annotations

from eagleforge.batch import BlockBatch, TTTBatch
from eagleforge.draft.dflash import DFlashDraft
from eagleforge.draft.model import Eagle3Draft
from eagleforge.draft.training import TrainingModule

AnyDraft = Eagle3Draft | DFlashDraft
AnyBatch = TTTBatch | BlockBatch
__all__ = ["AnyBatch", "AnyDraft", "TrainingModule", "empty_like"]


def empty_like(draft: AnyDraft) -> AnyDraft:
    """A draft of the same architecture on the same device, holding whatever ``draft`` holds
    outside its state dict (a DFlash draft's view of the target's embedding and lm_head)."""
    device = next(draft.parameters()).device
    if isinstance(draft, DFlashDraft):
        copy = DFlashDraft(draft.arch).to(device)
        copy.set_target_weights(draft.embed_VH, draft.lm_head_VH)
        return copy
    return Eagle3Draft(draft.arch).to(device)
