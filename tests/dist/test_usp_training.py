"""USP end to end: offline training with the sequence split over 2 sp ranks gives the loss
trace and weights of one process on the same sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from safetensors.torch import load_file

from eagleforge.config import compose_config, to_typed
from eagleforge.prepare import run as prepare
from eagleforge.train import run

pytestmark = pytest.mark.dist

DATA = ["+model=tiny", "data=chitchat", "data.max_num_samples=30", "data.num_eval_samples=4",
        "data.max_length=96"]  # fmt: skip


def train(rank: int, args: list[str]) -> tuple[list[float], dict[str, float], str]:
    result = run(compose_config(args))
    return result.train_losses, result.final_eval, str(result.checkpoint)


def prepare_store(tmp_path: Path) -> Path:
    store = tmp_path / "features"
    prepare(to_typed(compose_config([*DATA, f"prepare.output_dir={store}",
                                     f"output_dir={tmp_path / 'prep'}"])))  # fmt: skip
    return store


@pytest.mark.parametrize("split", ["parallel.sp_ulysses=2", "parallel.sp_ring=2"])
def test_sequence_parallel_training_matches_one_process(tmp_path: Path, split: str) -> None:
    store = prepare_store(tmp_path)
    common = [*DATA, f"data.features={store}", "data.max_tokens_per_batch=256",
              "trainer.max_num_steps=3", "trainer.progress_bar=false", "optimizer.lr=1e-3",
              "optimizer.eps=1e-4", "draft.ttt_length=3", "parallel.device=cpu",
              "tracker=console", f"output_root={tmp_path}"]  # fmt: skip
    one = train(0, [*common, "draft.attention=eager", f"output_dir={tmp_path / 'one'}"])
    ranks = run_ranks(
        train, 2, [*common, "draft.attention=usp", split, f"output_dir={tmp_path / 'sp'}"]
    )
    losses, final_eval, checkpoint = ranks[0]
    assert ranks[1][0] == losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=1e-5, atol=1e-6)
    assert final_eval["eval/num_counted_0"] == one[1]["eval/num_counted_0"]
    ours, reference = (
        load_file(f"{checkpoint}/model.safetensors"),
        load_file(f"{one[2]}/model.safetensors"),
    )
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-5)
