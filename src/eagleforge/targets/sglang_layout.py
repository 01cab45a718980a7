"""How eagleforge's tensors map onto SGLang's (``target=sglang``, ``sglang.py``): our aux layer
ids as SGLang's EAGLE-3 capture takes them, and the order it returns them in; right-padded
[B, T] rows as one SGLang prefill request per row (its real tokens only,
``rows_to_sequences``) and SGLang's flat per-token results put back into the [B, T, ...]
layout, zeros in the padding (``sequences_to_rows``); the whole vocab matrix from SGLang's
vocab-parallel shards.

Pure torch: nothing here imports sglang.

Shape suffixes: B batch, T sequence, N real tokens of a batch (all rows, flat), H target
hidden, A = 3H (the three aux states), V target vocab, X any trailing width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleforge.errors import ConfigError

# --- layer ids --------------------------------------------------------------------------------


def sglang_aux_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids to hand SGLang's EAGLE-3 capture (``return_aux_hidden_state_layer_ids``, which
    reaches the model's ``set_eagle3_layers_to_capture``) for our output-of-layer ids.

    SGLang's Llama/Qwen models add one to each id and snapshot the residual stream *entering*
    that decoder layer, i.e. the output of layer ``id``: the same 0-based output-of-layer
    numbering as ours (and as the exported draft's ``eagle_aux_hidden_state_layer_ids``), so
    the numbers pass unchanged. The last layer's output enters no further layer, so SGLang
    cannot capture it: ConfigError for that id. A repeated id is captured once (SGLang tests
    "is this layer captured", and refuses repeats), so it is a ConfigError too.
    """
    if len(set(aux_layer_ids)) != len(aux_layer_ids):
        raise ConfigError(
            f"model.aux_layer_ids {list(aux_layer_ids)} repeats a layer, which SGLang captures "
            f"once; set three distinct ids (a {num_layers}-layer target's default repeats one "
            "when it has fewer than 7 layers)."
        )
    bad = [i for i in aux_layer_ids if not 0 <= i < num_layers - 1]
    if bad:
        raise ConfigError(
            f"model.aux_layer_ids {list(aux_layer_ids)} has {bad}, but target=sglang captures "
            f"the outputs of layers 0..{num_layers - 2} only (SGLang snapshots a layer's output "
            f"as the next layer's input, and the last of the {num_layers} layers has none); "
            "choose other ids or use target=hf."
        )
    return list(aux_layer_ids)


def sglang_snapshot_layers(sglang_ids: list[int]) -> list[int]:
    """The decoder layers whose *input* SGLang copies for these capture ids (its
    ``layers_to_capture``): one higher, as its ``set_eagle3_layers_to_capture`` computes."""
    return [i + 1 for i in sglang_ids]


def aux_in_our_order(aux_NA: torch.Tensor, aux_layer_ids: list[int]) -> torch.Tensor:
    """SGLang concatenates the captured states in layer order (it collects them as its layer
    loop passes); ours follow ``aux_layer_ids`` as given (like the hf backend and the exported
    draft's fc input). Reorder the [.., 3H] blocks when the ids are not ascending."""
    ranked = sorted(aux_layer_ids)
    order = [ranked.index(i) for i in aux_layer_ids]
    if order == list(range(len(order))):
        return aux_NA
    blocks = aux_NA.chunk(len(order), dim=-1)
    return torch.cat([blocks[j] for j in order], dim=-1)


# --- padded rows <-> SGLang's flat token layout -------------------------------------------------


@dataclass(frozen=True)
class RowLayout:
    """How a right-padded [B, T] batch maps onto SGLang's flat layout: the requests are the
    rows with at least one real token, in row order, their tokens back to back."""

    lengths: list[int]  # real tokens of each row (0: a row of padding only, sent nowhere)
    seq_len: int  # T

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def rows_to_sequences(
    input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> tuple[list[list[int]], RowLayout]:
    """One token-id list per row that has real tokens (SGLang's requests, in row order) and
    the layout to put the results back. The rows must be right-padded: mask ones, then zeros."""
    batch, seq = input_ids_BT.shape
    mask_BT = attention_mask_BT.bool()
    lengths_B = mask_BT.sum(dim=1)
    prefix_BT = torch.arange(seq, device=mask_BT.device) < lengths_B.unsqueeze(1)
    if not torch.equal(mask_BT, prefix_BT):
        raise ValueError(
            "target=sglang takes right-padded rows (attention_mask: ones, then zeros); this "
            "batch has padding before or between real tokens."
        )
    lengths: list[int] = lengths_B.tolist()
    ids_BT = input_ids_BT.cpu()  # one transfer for the whole batch
    sequences = [ids_BT[row, :n].tolist() for row, n in enumerate(lengths) if n > 0]
    return sequences, RowLayout(lengths, seq)


def sequences_to_rows(flat_NX: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """SGLang's per-token results [N, X] (requests back to back, row order) as [B, T, X],
    zeros at the padding positions."""
    if flat_NX.shape[0] != layout.num_tokens:
        raise RuntimeError(
            f"SGLang returned {flat_NX.shape[0]} token rows for a batch of {layout.num_tokens} "
            "real tokens."
        )
    lengths_B = torch.tensor(layout.lengths, device=flat_NX.device)
    real_BT = torch.arange(layout.seq_len, device=flat_NX.device) < lengths_B.unsqueeze(1)
    out_BTX = flat_NX.new_zeros(len(layout.lengths), layout.seq_len, *flat_NX.shape[1:])
    # boolean-mask assignment walks the mask row by row, left to right: SGLang's order
    out_BTX[real_BT] = flat_NX
    return out_BTX


def vocab_matrix_from_shards(shards: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """The whole [V, H] matrix from the row shards of an SGLang vocab-parallel layer, in tp-rank
    order: each rank holds one contiguous block of the padded vocabulary, and the padding rows
    (up to a multiple of 64 x tp) come last."""
    full_VH = torch.cat(shards, dim=0) if len(shards) > 1 else shards[0]
    if full_VH.shape[0] < vocab_size:
        raise RuntimeError(
            f"SGLang's vocab shards hold {full_VH.shape[0]} rows, fewer than the target's "
            f"vocab_size {vocab_size}."
        )
    return full_VH[:vocab_size]
