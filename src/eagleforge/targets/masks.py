"""Attention masks of a target forward with padding, packed documents, sliding windows and
attention chunks, shared by the transformers and the custom backend.

transformers builds a model's masks itself from a 2-D padding mask, but uses a 4-D mask (or
a dict of them by layer type) as given; packed rows need that, so the per-layer-kind
restrictions (window, chunk) are applied here, by position within each document.

Shape suffixes: B batch, T sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagleforge.layers import causal_document_mask

# The layer kinds (transformers' config.layer_types) a mask can be built for here; others
# (linear or recurrent layers) cannot run packed rows.
MASKABLE_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer's attention sees, besides causality and the document."""

    kind: str  # a transformers layer type: full_attention | sliding_attention | ...
    size: int | None = None  # the window or chunk, tokens (None for full attention)


FULL = LayerAttention("full_attention")


def layer_attention(text: Any) -> list[LayerAttention]:
    """Each decoder layer's attention, from a transformers text config: ``layer_types`` when
    the config has them, else one sliding window for every layer when ``sliding_window`` is
    set (and ``use_sliding_window`` not false), as transformers' models without layer types
    apply it."""
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None)
    if kinds is None:
        use_window = window is not None and getattr(text, "use_sliding_window", True)
        layer = LayerAttention("sliding_attention", window) if use_window else FULL
        return [layer] * text.num_hidden_layers
    sizes = {
        "sliding_attention": window,
        "chunked_attention": getattr(text, "attention_chunk_size", None),
    }
    return [LayerAttention(kind, sizes.get(kind)) for kind in kinds]


def attention_masks(
    attention_mask_BT: torch.Tensor,
    document_ids_BT: torch.Tensor | None,
    position_ids_BT: torch.Tensor,
    layers: set[LayerAttention],
) -> dict[LayerAttention, torch.Tensor | None]:
    """A [B, 1, T, T] boolean mask for each kind of layer attention; None where plain causal
    attention is exact (no padding, one document per row, no window or chunk the positions
    reach), so SDPA can take its causal kernel."""
    plain = bool(attention_mask_BT.all()) and document_ids_BT is None
    longest = int(position_ids_BT.max()) + 1 if position_ids_BT.numel() else 0
    # a window or chunk at least as long as every document restricts nothing
    restricting = {a for a in layers if a.size is not None and a.size < longest}
    if plain and not restricting:
        return dict.fromkeys(layers)
    # causal within the document; (right) padding queries see the real keys before them,
    # as in transformers, so no row is empty
    base_B1TT = causal_document_mask(attention_mask_BT, document_ids_BT).unsqueeze(1)
    masks: dict[LayerAttention, torch.Tensor | None] = {}
    for layer in layers:
        if layer not in restricting:
            masks[layer] = None if plain else base_B1TT
            continue
        assert layer.size is not None
        query_BT1, key_B1T = position_ids_BT.unsqueeze(2), position_ids_BT.unsqueeze(1)
        if layer.kind == "chunked_attention":
            allowed_BTT = query_BT1 // layer.size == key_B1T // layer.size
        else:  # a sliding window: the last `size` positions, the query's own included
            allowed_BTT = query_BT1 - key_B1T < layer.size
        masks[layer] = base_B1TT & allowed_BTT.unsqueeze(1)
    return masks
