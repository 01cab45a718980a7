"""A vision-language target with the draft data-parallel over 2 gloo ranks (FSDP2): each rank
runs the whole tiny Qwen2.5-VL on its own conversations with images, and the run trains like
one process with twice the accumulation (same losses, same weights)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.ranks import run_ranks
from helpers.runs import assert_close_weights, train_on_rank, weights
from helpers.vlm import tiny_vl_run_overrides, write_data

pytestmark = pytest.mark.dist


def _overrides(data: Path, tmp_path: Path, name: str, *extra: str) -> list[str]:
    return tiny_vl_run_overrides(
        data, tmp_path, "data.num_eval_samples=0", "trainer.batch_size=1", "optimizer.lr=1e-3",
        "optimizer.eps=1e-4", "parallel.device=cpu", *extra, name=name,
    )  # fmt: skip


def test_vlm_two_ranks_train_like_one_process(tmp_path: Path) -> None:
    data = write_data(tmp_path / "data")
    one = train_on_rank(0, _overrides(data, tmp_path, "one", "trainer.grad_accum_steps=2"))
    ranks = run_ranks(train_on_rank, 2, _overrides(data, tmp_path, "two", "parallel.dp=2"))
    (losses_0, _, checkpoint), (losses_1, _, _) = ranks
    assert losses_0 == losses_1 and len(losses_0) == 2
    torch.testing.assert_close(torch.tensor(losses_0), torch.tensor(one[0]), rtol=1e-4, atol=1e-5)
    assert_close_weights(weights(checkpoint), weights(one[2]))
