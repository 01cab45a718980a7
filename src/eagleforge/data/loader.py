"""Batches of a dataset: the sample order (seeded shuffle, resume offset), padded or packed
batches, and their sharding across data-parallel ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from eagleforge.data.collate import Collator, PackedCollator

if TYPE_CHECKING:
    from eagleforge.targets.source import VisionProcessor


def pack_indices(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy packing: consecutive samples of ``order`` share a row while they fit ``max_tokens``."""
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for index in order:
        if row and used + lengths[index] > max_tokens:
            rows.append(row)
            row, used = [], 0
        row.append(index)
        used += lengths[index]
    if row:
        rows.append(row)
    return rows


@dataclass
class BatchPlan:
    """An epoch's batches: the samples of each (indices into ``dataset``, in order) and how
    they are collated."""

    dataset: Any  # the samples (with fillers for sharded ranks: see ``shard_batches``)
    batches: list[list[int]]
    collate: Callable[[list[tuple[Any, ...]]], dict[str, torch.Tensor]]
    seed: int  # of the loader's own generator

    def loader(self) -> torch.utils.data.DataLoader:
        # a generator of its own: each iterator otherwise draws its workers' base seed from
        # the global RNG, which a resumed run (its loader made anew) would then draw
        # differently from (DFlash draws its anchors from it)
        generator = torch.Generator().manual_seed(self.seed)
        return torch.utils.data.DataLoader(
            self.dataset, batch_sampler=self.batches, collate_fn=self.collate, generator=generator
        )


def plan_batches(
    dataset: Any,  # TokenizedDataset or data.features.FeatureDataset: samples and lengths()
    packing: bool,
    max_tokens_per_batch: int,
    batch_size: int,
    pad_token_id: int,
    shuffle_seed: int | None = None,
    shard: int = 0,
    num_shards: int = 1,
    start: int = 0,
    processor: VisionProcessor | None = None,
    limit: int | None = None,
) -> BatchPlan:
    """Batches of ``batch_size`` padded samples, or with ``packing`` one row of whole samples
    up to ``max_tokens_per_batch`` tokens per batch.

    ``shuffle_seed``: the order is a seeded permutation (one per epoch); None keeps file order.
    ``start``: leave out the order's first ``start`` batches (already used by a resumed run).
    ``shard`` of ``num_shards`` (data-parallel ranks): see ``shard_batches``.
    ``processor``: loads the images of vision-language samples (not with ``packing``).
    ``limit``: at most this many of this shard's batches (what the run still needs).
    """
    order = list(range(len(dataset)))
    if shuffle_seed is not None:
        order = torch.randperm(
            len(dataset), generator=torch.Generator().manual_seed(shuffle_seed)
        ).tolist()
    if packing:
        batches = pack_indices(dataset.lengths(), order, max_tokens_per_batch)
        collate: Any = PackedCollator()
    else:
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        collate = Collator(
            pad_token_id,
            processor.image_processor if processor is not None else None,
            processor.image_token_id if processor is not None else None,
        )
    batches = batches[start:]
    if num_shards > 1:
        batches = shard_batches(batches, shard, num_shards)
        dataset = _WithFillers(dataset)
    return BatchPlan(dataset, batches[:limit], collate, shuffle_seed or 0)


def make_loader(*args: Any, **kwargs: Any) -> torch.utils.data.DataLoader:
    """The loader of ``plan_batches(*args, **kwargs)``."""
    return plan_batches(*args, **kwargs).loader()


def shard_batches(batches: list[list[int]], shard: int, num_shards: int) -> list[list[int]]:
    """Shard ``shard``'s batches: every ``num_shards``-th batch of the global order, so that
    step s of N ranks sees the batches that one process with N x the accumulation would.

    Every shard gets the same number of batches (the ranks step together); a shard short of
    one gets *filler* batches, encoded as negative indices (-1 - i): sample i with nothing
    supervised, so no sample is skipped and none counts twice.
    """
    own = batches[shard::num_shards]
    count = -(-len(batches) // num_shards)
    fillers = [[-1 - i for i in batches[j % len(batches)]] for j in range(count - len(own))]
    return own + fillers


class _WithFillers(torch.utils.data.Dataset):
    """Index -1 - i reads sample i with its loss mask cleared (see ``shard_batches``)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if index >= 0:
            return self.dataset[index]
        ids, mask, *rest = self.dataset[-1 - index]
        return (ids, [0] * len(mask), *rest)
