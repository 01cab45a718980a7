"""Data-parallel sharding: every batch of an epoch on exactly one rank, ranks stepping together."""

from __future__ import annotations

import pytest

from eagleforge.data.loader import make_loader, shard_batches
from eagleforge.data.preprocess import TokenizedDataset


@pytest.mark.parametrize(("num_batches", "num_shards"), [(7, 2), (8, 2), (1, 2), (5, 4), (3, 1)])
def test_shards_cover_every_batch_once_and_step_together(num_batches: int, num_shards: int) -> None:
    batches = [[2 * i, 2 * i + 1] for i in range(num_batches)]
    shards = [shard_batches(batches, s, num_shards) for s in range(num_shards)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of steps
    real = sorted(i for s in shards for batch in s for i in batch if i >= 0)
    assert real == list(range(2 * num_batches))  # none skipped, none twice
    fillers = [i for s in shards for batch in s for i in batch if i < 0]
    assert all(0 <= -1 - i < 2 * num_batches for i in fillers)
    # step j of the ranks holds global batches j*num_shards ... j*num_shards + num_shards - 1
    assert [s[0] for s in shards][: min(num_shards, num_batches)] == batches[:num_shards]


def test_filler_samples_supervise_nothing() -> None:
    dataset = TokenizedDataset([[1, 2, 3], [4, 5]], [[0, 1, 1], [1, 1]])
    loaders = [make_loader(dataset, False, 64, 1, 0, None, shard=s, num_shards=3) for s in range(3)]
    batches = [list(loader) for loader in loaders]
    assert [len(b) for b in batches] == [1, 1, 1]
    assert batches[2][0]["loss_mask"].sum() == 0  # the third rank's filler
    assert batches[2][0]["input_ids"].tolist() == [[1, 2, 3]]


@pytest.mark.parametrize(("used", "num_shards"), [(5, 2), (4, 3), (0, 2), (10, 2)])
def test_a_resumed_epoch_deals_only_the_unused_batches(used: int, num_shards: int) -> None:
    """After ``used`` global batches (saved on any number of ranks), the rest of the epoch is
    dealt to the new ranks: each remaining batch once, none of the used ones again."""
    dataset = TokenizedDataset([[i + 1] * 3 for i in range(10)], [[1, 1, 1]] * 10)
    loaders = [
        make_loader(dataset, False, 64, 1, 0, 7, shard=s, num_shards=num_shards, start=used)
        for s in range(num_shards)
    ]
    full_order = [b["input_ids"][0, 0].item() for b in make_loader(dataset, False, 64, 1, 0, 7)]
    seen = [
        b["input_ids"][0, 0].item() for loader in loaders for b in loader if b["loss_mask"].any()
    ]
    assert sorted(seen) == sorted(full_order[used:])
