"""What the trainer runs for either draft family: a module whose forward is the family's
training pass over one micro-batch (``ttt.TTTModule``, ``dflash.BlockModule``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class PositionStats:
    """Per-step sums over one micro-batch; divide by global counts for the loss and accuracy."""

    loss: torch.Tensor  # Σ_i scale_i · loss_sum_i, differentiable (0 without loss scales)
    loss_sum_k: torch.Tensor  # the loss kind's value summed over counted positions (detached)
    num_counted_k: torch.Tensor  # counted positions (long)
    num_correct_k: torch.Tensor  # counted positions where d2t(argmax draft) == target argmax
    alpha_sum_k: torch.Tensor  # expected acceptance Σ_v min(p_v, q_v) summed over counted positions


class TrainingModule(nn.Module):
    """A draft (``self.draft``) with its training pass as ``forward``: per-position sums of
    the loss, counts, correct predictions and expected acceptance, over ``num_positions``
    positions (TTT steps, or block slots 1 .. B-1)."""

    draft: Any  # the family's draft module (Eagle3Draft, DFlashDraft)
    num_positions: int

    def stats(self, batch: Any, loss_scale_k: torch.Tensor | None = None) -> PositionStats:
        """This micro-batch's sums; ``loss_scale_k`` (``loss_scales``) makes them a loss.
        ``forward`` returns them as a tuple: FSDP2 hooks the backward through the outputs it
        can flatten."""
        return PositionStats(*self(batch, loss_scale_k))

    def count_positions(self, batch: Any) -> torch.Tensor:
        """Counted positions [num_positions] of a micro-batch (summed for the step's scales)."""
        raise NotImplementedError

    @staticmethod
    def loss_scales(global_counts_k: torch.Tensor, weights_k: torch.Tensor) -> torch.Tensor:
        """Per-position scales of the summed losses, from the whole step's counts."""
        raise NotImplementedError
