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
from ranks import run_ranks
from safetensors.torch import load_file

from eagleforge.config import compose_config
from eagleforge.train import run

pytestmark = pytest.mark.dist


def overrides(out: Path, *extra: str) -> list[str]:
    return [
        "+model=tiny", "data=chitchat", "data.max_num_samples=40", "data.num_eval_samples=5",
        "data.max_length=64", "data.max_tokens_per_batch=128", "trainer.max_num_steps=4",
        "trainer.progress_bar=false", "optimizer.lr=1e-3", "draft.ttt_length=3",
        # Adam's eps well above float noise: a near-zero gradient's update stays near zero
        "optimizer.eps=1e-4", "parallel.device=cpu", "tracker=console", f"output_root={out.parent}",
        f"output_dir={out}", *extra,
    ]  # fmt: skip


def train(rank: int, args: list[str]) -> tuple[list[float], dict[str, float], str]:
    result = run(compose_config(args))
    return result.train_losses, result.final_eval, str(result.checkpoint)


def weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(checkpoint) / "model.safetensors"))


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


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
    one = train(0, overrides(tmp_path / "one", *common, "trainer.grad_accum_steps=2"))
    ranks = run_ranks(train, 2, overrides(tmp_path / "two", *common, *layout.split()))
    (losses_0, eval_0, checkpoint), (losses_1, _, _) = ranks
    assert losses_0 == losses_1  # every rank logs the global loss
    torch.testing.assert_close(torch.tensor(losses_0), torch.tensor(one[0]), rtol=1e-4, atol=1e-5)
    assert eval_0["eval/num_counted_0"] == one[1]["eval/num_counted_0"]
    torch.testing.assert_close(eval_0["eval/loss"], one[1]["eval/loss"], rtol=1e-4, atol=1e-5)
    assert_close_weights(weights(checkpoint), weights(one[2]))


def test_two_rank_resume_is_bit_identical_and_reshards(tmp_path: Path) -> None:
    args = ("trainer.save_every_n_steps=2", "data.packing=false")
    full = run_ranks(train, 2, overrides(tmp_path / "full", *args))[0]
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    resumed_dir.mkdir(parents=True)
    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    shutil.copytree(step_2, resumed_dir / step_2.name)
    resumed = run_ranks(train, 2, overrides(tmp_path / "resumed", *args))[0]
    assert resumed[0] == full[0][2:]  # steps 3..4, bit for bit
    final_full, final_resumed = weights(full[2]), weights(resumed[2])
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)

    # the 2-rank checkpoint continues in one process (another data order: finishes, differs)
    alone_dir = tmp_path / "alone" / "checkpoints"
    alone_dir.mkdir(parents=True)
    shutil.copytree(step_2, alone_dir / step_2.name)
    alone = train(0, overrides(tmp_path / "alone", *args))
    assert len(alone[0]) == 2 and all(torch.isfinite(torch.tensor(alone[0])))
    assert weights(alone[2]).keys() == final_full.keys()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def test_two_ranks_killed_with_sigkill_resume_bit_identical(tmp_path: Path) -> None:
    """torchrun's whole process group SIGKILLed once step 2 is saved; the same 2-rank
    command then ends exactly as the run that never stopped."""
    args = ("trainer.save_every_n_steps=1", "trainer.max_num_steps=5", "data.packing=false")
    full = run_ranks(train, 2, overrides(tmp_path / "full", *args))[0]
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "eagleforge.train",
         *overrides(tmp_path / "killed", *args)],
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
    resumed = run_ranks(train, 2, overrides(tmp_path / "killed", *args))[0]
    assert resumed[0] == full[0][saved:]
    final_full, final_resumed = weights(full[2]), weights(resumed[2])
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
