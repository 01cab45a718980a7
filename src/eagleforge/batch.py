"""The batch contract every layer shares: what one micro-batch of a draft family's training
holds (EAGLE-3's TTT, DFlash's blocks), and the teacher the target gives it. Imports nothing of eagleforge, so data, targets, the draft and
the trainer can all speak it without importing each other.

Shape suffixes: B batch, T sequence, A aux width (3 * target hidden), W draft vocab, 3 M-RoPE
position components.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The entries of a collated batch that carry a vision-language batch's images, for the target.
IMAGE_KEYS = ("pixel_values", "image_grid_thw")

# The loss and the teacher work in chunks of rows, each sized so that one [rows, width] fp32
# tensor takes about this much memory.
CHUNK_BYTES = 32 * 2**20


# On a GPU the chunks are 16x larger: a [rows, 128k] matmul of 65 rows leaves most of its
# cores idle, and 512 MiB is little beside its memory.
CUDA_CHUNK_BYTES = 512 * 2**20


def chunk_bytes(device: torch.device) -> int:
    """The budget of one chunk's fp32 buffer on ``device``."""
    return CUDA_CHUNK_BYTES if device.type == "cuda" else CHUNK_BYTES


def rows_per_chunk(width: int, chunk_bytes: int = CHUNK_BYTES, min_rows: int = 16) -> int:
    """How many [width] fp32 rows fit in ``chunk_bytes`` (at least ``min_rows``)."""
    return max(min_rows, chunk_bytes // (4 * width))


@dataclass
class Teacher:
    """What the loss needs from the target at each position t (predicting x_{t+1})."""

    probs_BTW: torch.Tensor  # fp32 softmax over draft-vocab ids, renormalised
    target_ids_BT: torch.Tensor  # argmax over the full target vocab
    in_draft_BT: torch.Tensor  # bool: that argmax is a draft-vocab id


@dataclass
class TTTBatch:
    """One micro-batch as the TTT sees it (right-padded)."""

    input_ids_BT: torch.Tensor
    valid_BT: torch.Tensor  # bool: real token (not padding)
    loss_mask_BT: torch.Tensor  # bool: supervised (assistant) token
    aux_BTA: torch.Tensor  # concat of the three target aux hidden states
    teacher: Teacher
    # Packed rows: the document of each position, and positions restarting at 0 per document.
    document_ids_BT: torch.Tensor | None = None
    position_ids_BT: torch.Tensor | None = None
    # A vision-language target's M-RoPE positions (time, height, width) as the target used
    # them; when set, the draft rotates by these instead of position_ids_BT.
    position_ids_3BT: torch.Tensor | None = None
    # Trailing positions only the shifts read (a sequence-parallel chunk's look-ahead, see
    # parallel/usp.py): neither computed nor counted.
    halo: int = 0

    @property
    def computed_length(self) -> int:
        """Positions the draft computes (and counts): the sequence without the halo."""
        return self.input_ids_BT.shape[1] - self.halo


@dataclass
class BlockBatch:
    """One micro-batch as a block draft (DFlash) sees it: the target's tapped states at every
    position and the anchors its blocks start at (no teacher: the labels are the tokens)."""

    input_ids_BT: torch.Tensor
    valid_BT: torch.Tensor  # bool: real token (not padding)
    loss_mask_BT: torch.Tensor  # bool: supervised (assistant) token
    aux_BTA: torch.Tensor  # concat of the tapped target states
    anchors_BN: torch.Tensor | None = None  # long: block start positions, -1 = none
    document_ids_BT: torch.Tensor | None = None
    position_ids_BT: torch.Tensor | None = None

    @property
    def computed_length(self) -> int:
        return self.input_ids_BT.shape[1]


def shift_left(x_BT: torch.Tensor, n: int) -> torch.Tensor:
    """out[:, t] = x[:, t + n], zero (False) past the end."""
    out = torch.zeros_like(x_BT)
    if n < x_BT.shape[1]:
        out[:, : x_BT.shape[1] - n] = x_BT[:, n:]
    return out


def shift_right(x_BT: torch.Tensor, n: int) -> torch.Tensor:
    """out[:, t] = x[:, t - n], zero (False) before the start."""
    out = torch.zeros_like(x_BT)
    if n < x_BT.shape[1]:
        out[:, n:] = x_BT[:, : x_BT.shape[1] - n]
    return out
