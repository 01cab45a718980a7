"""What every draft family's modules have in common, as types: the draft module, its training
module and its batch (EAGLE-3: ``model.py`` / ``ttt.py``, a ``TTTBatch``; DFlash:
``dflash.py``, a ``BlockBatch``). Each family itself -- how it is built, trained, decoded,
exported and served -- is ``eagleforge.families``'s."""

from __future__ import annotations

from eagleforge.batch import BlockBatch, TTTBatch
from eagleforge.draft.dflash import DFlashDraft
from eagleforge.draft.model import Eagle3Draft
from eagleforge.draft.training import TrainingModule

AnyDraft = Eagle3Draft | DFlashDraft
AnyBatch = TTTBatch | BlockBatch
__all__ = ["AnyBatch", "AnyDraft", "TrainingModule"]
