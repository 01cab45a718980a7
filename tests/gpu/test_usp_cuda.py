"""USP on 2 GPUs with nccl (the CPU/gloo twin is tests/dist/test_usp_training.py): offline
training with the sequence split over ulysses or ring ranks trains like one GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "dist"))  # the rank spawner of the dist tier
from ranks import run_ranks  # noqa: E402
from test_usp_training import DATA, prepare_store, train  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.mark.parametrize("split", ["parallel.sp_ulysses=2", "parallel.sp_ring=2"])
def test_sequence_parallel_on_two_gpus(tmp_path: Path, split: str) -> None:
    store = prepare_store(tmp_path)
    common = [*DATA, f"data.features={store}", "trainer.max_num_steps=3",
              "trainer.progress_bar=false", "draft.ttt_length=3", "parallel.device=cuda",
              "parallel.mixed_precision=false", "tracker=console", f"output_root={tmp_path}"]  # fmt: skip
    one = train(0, [*common, "draft.attention=eager", f"output_dir={tmp_path / 'one'}"])
    ranks = run_ranks(
        train, 2, [*common, "draft.attention=usp", split, f"output_dir={tmp_path / 'sp'}"]
    )
    torch.testing.assert_close(
        torch.tensor(ranks[0][0]), torch.tensor(one[0]), rtol=2e-2, atol=1e-2
    )
