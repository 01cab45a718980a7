"""The draft vocabulary: the W most frequent supervised target tokens, and its id maps.

``d2t[i]`` is the offset from draft id i to its target id (target_id = i + d2t[i]), as SGLang
and vLLM read it; ``t2d[v]`` is True for target ids in the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagleforge.atomic import atomic_file
from eagleforge.files import save_safetensors


@dataclass
class VocabMap:
    d2t_W: torch.Tensor  # int64 offsets
    t2d_V: torch.Tensor  # bool

    @property
    def draft_ids_W(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, ascending."""
        return torch.arange(self.d2t_W.numel()) + self.d2t_W


def count_supervised_tokens(
    samples: Iterable[tuple[list[int], list[int]]], vocab_size: int
) -> torch.Tensor:
    """How often each target id is a supervised token, [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        mask_t = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids_t[mask_t], minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab_map(counts_V: torch.Tensor, draft_vocab_size: int) -> VocabMap:
    """Keep the ``draft_vocab_size`` most frequent ids (ties and unseen ids by lowest id)."""
    vocab_size = counts_V.numel()
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft vocab {draft_vocab_size} exceeds the target vocab {vocab_size}")
    order = torch.sort(-counts_V, stable=True).indices
    kept = torch.sort(order[:draft_vocab_size]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return VocabMap(d2t_W=kept - torch.arange(draft_vocab_size), t2d_V=t2d)


def cached_vocab_map(
    samples: Iterable[tuple[list[int], list[int]]],
    vocab_size: int,
    draft_vocab_size: int,
    cache_file: Path,
) -> VocabMap:
    """``build_vocab_map`` of the samples' supervised-token counts, cached in ``cache_file``."""
    if cache_file.exists():
        tensors = load_file(str(cache_file))
        return VocabMap(d2t_W=tensors["d2t"], t2d_V=tensors["t2d"])
    vocab = build_vocab_map(count_supervised_tokens(samples, vocab_size), draft_vocab_size)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(cache_file) as tmp:  # readers see the old state or the complete file
        save_safetensors({"d2t": vocab.d2t_W, "t2d": vocab.t2d_V}, tmp)
    return vocab
