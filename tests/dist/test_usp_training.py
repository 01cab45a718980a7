"""USP end to end: offline training with the sequence split over 2 sp ranks gives the loss
trace and weights of one process on the same sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.ranks import run_ranks
from helpers.runs import (
    SP_DATA,
    assert_close_weights,
    prepare_store,
    tiny_run_overrides,
    train_on_rank,
    weights,
)
from safetensors.torch import load_file

from eagleforge.config import compose_config, to_typed
from eagleforge.prepare import run as prepare
from eagleforge.train import run

pytestmark = pytest.mark.dist


# ring is slow only: ring attention equals eager with its gradients in tests/dist/test_usp.py,
# and the sequence-parallel training around it runs with ulysses.
@pytest.mark.parametrize(
    "split", ["parallel.sp_ulysses=2", pytest.param("parallel.sp_ring=2", marks=pytest.mark.slow)]
)
def test_sequence_parallel_training_matches_one_process(tmp_path: Path, split: str) -> None:
    store = prepare_store(tmp_path, *SP_DATA)
    common = [*SP_DATA, f"data.features={store}", "data.max_tokens_per_batch=256",
              "trainer.max_num_steps=3", "optimizer.lr=1e-3", "optimizer.eps=1e-4",
              "draft.ttt_length=3", "parallel.device=cpu"]  # fmt: skip
    one = train_on_rank(
        0, tiny_run_overrides(tmp_path, *common, "draft.attention=eager", name="one")
    )
    ranks = run_ranks(
        train_on_rank,
        2,
        tiny_run_overrides(tmp_path, *common, "draft.attention=usp", split, name="sp"),
    )
    losses, final_eval, checkpoint = ranks[0]
    assert ranks[1][0] == losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=1e-5, atol=1e-6)
    assert final_eval["eval/num_counted_0"] == one[1]["eval/num_counted_0"]
    assert_close_weights(weights(checkpoint), weights(one[2]))
