"""The parallel config and the mesh built from torchrun's environment, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from helpers.ranks import run_ranks

from eagleforge.errors import ConfigError
from eagleforge.parallel import ParallelConfig, ParallelDims
from eagleforge.parallel.dist import init_distributed

pytestmark = pytest.mark.dist


def _world(rank: int, overrides: dict) -> tuple:
    world = init_distributed(ParallelConfig(device="cpu", **overrides))
    total = world.all_reduce_sum(torch.tensor([rank + 1.0]))
    return world.rank, world.size, world.data_rank, world.coordinate("tp"), float(total)


def test_two_data_parallel_ranks_read_different_shards() -> None:
    assert run_ranks(_world, 2, {}) == [(0, 2, 0, 0, 3.0), (1, 2, 1, 0, 3.0)]


def test_sequence_parallel_ranks_share_a_shard() -> None:
    ranks = run_ranks(_world, 2, {"sp_ulysses": 2})
    assert [r[2] for r in ranks] == [0, 0]


def test_tensor_parallel_ranks_read_their_own_shards() -> None:
    ranks = run_ranks(_world, 2, {"tp": 2})
    assert [(r[2], r[3]) for r in ranks] == [(0, 0), (1, 1)]


@pytest.mark.parametrize(
    ("fields", "world", "named"),
    [
        ({"dp": 2, "tp": 2}, 2, "parallel.dp=2 x tp=2"),
        ({"sp_ring": 3}, 2, "sp_ring=3"),
        ({"tp": 2, "sp_ulysses": 2}, 4, "parallel.tp=2 with"),
        ({"dp": 0}, 1, "parallel.dp must be"),
    ],
)
def test_sizes_that_do_not_fit_name_the_fields(
    monkeypatch: pytest.MonkeyPatch, fields: dict, world: int, named: str
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=named):
        ParallelConfig(**fields)


def test_auto_dp_fills_the_world() -> None:
    assert ParallelConfig(tp=2).dims(8) == ParallelDims(dp=4, tp=2)
    assert ParallelConfig(sp_ulysses=2, sp_ring=2).dims(8).data_shards == 2
