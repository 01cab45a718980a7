"""USP on 2 GPUs with nccl (the CPU/gloo twin is tests/dist/test_usp_training.py): offline
training with the sequence split over ulysses or ring ranks trains like one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.ranks import run_ranks
from helpers.runs import SP_DATA, prepare_store, tiny_run_overrides, train_on_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.mark.parametrize("split", ["parallel.sp_ulysses=2", "parallel.sp_ring=2"])
def test_sequence_parallel_on_two_gpus(tmp_path: Path, split: str) -> None:
    store = prepare_store(tmp_path, *SP_DATA)
    common = [*SP_DATA, f"data.features={store}", "trainer.max_num_steps=3", "draft.ttt_length=3",
              "parallel.device=cuda", "parallel.mixed_precision=false"]  # fmt: skip
    one = train_on_rank(
        0, tiny_run_overrides(tmp_path, *common, "draft.attention=eager", name="one")
    )
    ranks = run_ranks(
        train_on_rank,
        2,
        tiny_run_overrides(tmp_path, *common, "draft.attention=usp", split, name="sp"),
    )
    torch.testing.assert_close(
        torch.tensor(ranks[0][0]), torch.tensor(one[0]), rtol=2e-2, atol=1e-2
    )
