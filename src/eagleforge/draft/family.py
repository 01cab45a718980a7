"""What every draft family's modules have in common, as types: the draft module, its training
module and its batch (EAGLE-3: ``model.py`` / ``ttt.py``, a ``TTTBatch``; DFlash:
``dflash.py``, a ``BlockBatch``). Each family itself -- how it is built, trained, decoded,
exported and served -- is ``eagleforge.families``'s."""

from __future__ import annotations

from eagleforge.batch import BlockBatch, TTTBatch
from eagleforge.draft.dflash import DFlashArchitecture, DFlashDraft
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.draft.training import TrainingModule

AnyDraft = Eagle3Draft | DFlashDraft
AnyBatch = TTTBatch | BlockBatch
# a draft's shape as its config.json holds it (P-EAGLE's is EAGLE-3's, with a mask token)
AnyArchitecture = DraftArchitecture | DFlashArchitecture
__all__ = ["AnyArchitecture", "AnyBatch", "AnyDraft", "TrainingModule"]
