"""Attention masks of a target forward with padding, packed documents and sliding windows,
shared by the transformers and the custom backend.

Shape suffixes: B batch, T sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from eagleforge.draft.attention import ttt_attention_mask


def sliding_windows(text: Any) -> list[int | None]:
    """Each layer's sliding attention window in tokens (None: full attention)."""
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    # Mistral's configs have no layer_types: a window, when set, holds for every layer.
    return [window if text.model_type == "mistral" else None] * text.num_hidden_layers


def attention_masks(
    attention_mask_BT: torch.Tensor,
    document_ids_BT: torch.Tensor | None,
    position_ids_BT: torch.Tensor,
    windows: set[int | None],
) -> dict[int | None, torch.Tensor | None]:
    """A [B, 1, T, T] boolean mask per sliding window; None where plain causal attention is
    exact (no padding, one document per row, no window), so SDPA can take its causal kernel."""
    plain = bool(attention_mask_BT.all()) and document_ids_BT is None
    if plain and windows == {None}:
        return {None: None}
    valid_BT = attention_mask_BT.bool()
    # causal within the document; (right) padding queries see the real keys before them,
    # as in transformers, so no row is empty
    base_BTT = ttt_attention_mask(valid_BT, 1, document_ids_BT)
    masks: dict[int | None, torch.Tensor | None] = {}
    for window in windows:
        if window is None:
            masks[None] = None if plain else base_BTT.unsqueeze(1)
            continue
        distance_BTT = position_ids_BT.unsqueeze(2) - position_ids_BT.unsqueeze(1)
        masks[window] = (base_BTT & (distance_BTT < window)).unsqueeze(1)
    return masks
