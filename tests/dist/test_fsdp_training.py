"""FSDP2 data parallelism on 2 gloo ranks: the same training as one process with the same
global batch, exact resume across a restart, and resume on another world size."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.processes import descendants
from helpers.ranks import run_ranks
from helpers.runs import (
    FSDP_RUN,
    assert_close_weights,
    tiny_run_overrides,
    train_on_rank,
    weights,
)
from safetensors.torch import load_file

from eagleforge.config import compose_config
from eagleforge.train import run

pytestmark = pytest.mark.dist


def overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return tiny_run_overrides(tmp_path, *FSDP_RUN, *extra, name=name)


@pytest.mark.parametrize(
    ("packing", "layout"),
    [
        ("true", "parallel.dp=2"),
        ("false", "parallel.dp=2"),
        ("true", "parallel.tp=2"),
        ("false", "parallel.tp=2 target=custom"),
    ],
)
def test_two_ranks_train_like_one_process_with_the_same_global_batch(
    tmp_path: Path, packing: str, layout: str
) -> None:
    """dp=2, or tp=2 (one target split over both ranks, each rank its own micro-batch; with
    target=custom against the one-process transformers target)."""
    # 3 steps stay inside the first epoch (at its end a rank short of a batch gets a filler,
    # while one process would start the next epoch)
    common = (f"data.packing={packing}", "trainer.max_num_steps=3")
    one = train_on_rank(0, overrides(tmp_path, "one", *common, "trainer.grad_accum_steps=2"))
    ranks = run_ranks(train_on_rank, 2, overrides(tmp_path, "two", *common, *layout.split()))
    (losses_0, eval_0, checkpoint), (losses_1, _, _) = ranks
    assert losses_0 == losses_1  # every rank logs the global loss
    torch.testing.assert_close(torch.tensor(losses_0), torch.tensor(one[0]), rtol=1e-4, atol=1e-5)
    assert eval_0["eval/num_counted_0"] == one[1]["eval/num_counted_0"]
    torch.testing.assert_close(eval_0["eval/loss"], one[1]["eval/loss"], rtol=1e-4, atol=1e-5)
    assert_close_weights(weights(checkpoint), weights(one[2]))


def test_two_rank_resume_is_bit_identical_and_reshards(tmp_path: Path) -> None:
    args = ("trainer.save_every_n_steps=2", "data.packing=false")
    full = run_ranks(train_on_rank, 2, overrides(tmp_path, "full", *args))[0]
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    resumed_dir.mkdir(parents=True)
    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    shutil.copytree(step_2, resumed_dir / step_2.name)
    resumed = run_ranks(train_on_rank, 2, overrides(tmp_path, "resumed", *args))[0]
    assert resumed[0] == full[0][2:]  # steps 3..4, bit for bit
    final_full, final_resumed = weights(full[2]), weights(resumed[2])
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)

    # the 2-rank checkpoint continues in one process (another data order: finishes, differs)
    alone_dir = tmp_path / "alone" / "checkpoints"
    alone_dir.mkdir(parents=True)
    shutil.copytree(step_2, alone_dir / step_2.name)
    alone = train_on_rank(0, overrides(tmp_path, "alone", *args))
    assert len(alone[0]) == 2 and all(torch.isfinite(torch.tensor(alone[0])))
    assert weights(alone[2]).keys() == final_full.keys()


# Slow: a SIGKILL mid-save is cleaned up and resumed exactly in one process by default
# (tests/integration/test_resume.py), and two ranks resume exactly above.
@pytest.mark.slow
def test_two_ranks_killed_with_sigkill_resume_bit_identical(tmp_path: Path) -> None:
    """torchrun's whole process group SIGKILLed once step 2 is saved; the same 2-rank
    command then ends exactly as the run that never stopped."""
    args = ("trainer.save_every_n_steps=1", "trainer.max_num_steps=5", "data.packing=false")
    full = run_ranks(train_on_rank, 2, overrides(tmp_path, "full", *args))[0]
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "eagleforge.train",
         *overrides(tmp_path, "killed", *args)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    checkpoints = tmp_path / "killed" / "checkpoints"
    while not (checkpoints / "step_00000002").exists() and proc.poll() is None:
        time.sleep(0.01)
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun's workers run in other groups
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    saved = int(sorted(checkpoints.glob("step_*"))[-1].name.removeprefix("step_"))
    assert 2 <= saved < 5
    resumed = run_ranks(train_on_rank, 2, overrides(tmp_path, "killed", *args))[0]
    assert resumed[0] == full[0][saved:]
    final_full, final_resumed = weights(full[2]), weights(resumed[2])
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
