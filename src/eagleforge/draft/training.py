"""What the trainer runs for either draft family: a module whose forward is the family's
training pass over one micro-batch (``ttt.TTTModule``, ``dflash.BlockModule``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TrainingModule(nn.Module):
    """A draft (``self.draft``) with its training pass as ``forward``: per-position sums of
    the loss, counts, correct predictions and expected acceptance, over ``num_positions``
    positions (TTT steps, or block slots 1 .. B-1)."""

    draft: Any  # the family's draft module (Eagle3Draft, DFlashDraft)
    num_positions: int

    def stats(self, batch: Any, loss_scale_k: torch.Tensor | None = None) -> Any:
        """This micro-batch's sums; ``loss_scale_k`` (``loss_scales``) makes them a loss."""
        raise NotImplementedError

    def count_positions(self, batch: Any) -> torch.Tensor:
        """Counted positions [num_positions] of a micro-batch (summed for the step's scales)."""
        raise NotImplementedError

    @staticmethod
    def loss_scales(global_counts_k: torch.Tensor, weights_k: torch.Tensor) -> torch.Tensor:
        """Per-position scales of the summed losses, from the whole step's counts."""
        raise NotImplementedError
