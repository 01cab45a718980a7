"""launchers/slurm.sbatch run here with stand-ins for srun and scontrol: its tasks form one
2-rank gloo world, and SIGUSR1 before the time limit saves, exits 138 and requeues."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_fsdp_training import descendants

pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[2]

# srun: start SLURM_NTASKS copies of the command with their SLURM ids; exit with the highest
# status. scontrol: the node list is this host; a requeue is written down.
FAKE_SRUN = """#!/bin/bash
shift  # --kill-on-bad-exit=0
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid"; s=$?; (( s > status )) && status=$s; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then echo 127.0.0.1; else echo "$@" >> "$REQUEUED"; fi
"""


def start(tmp_path: Path, *overrides: str) -> subprocess.Popen[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(
        os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="2", SLURM_CPUS_PER_TASK="1",
        RUN_DIR=str(tmp_path / "run"), REQUEUED=str(tmp_path / "requeued"),
        PYTHON=sys.executable,
    )  # fmt: skip
    args = ["+model=tiny", "data=chitchat", "data.max_num_samples=30", "data.num_eval_samples=4",
            "data.max_length=64", "trainer.progress_bar=false", "parallel.device=cpu",
            "tracker=console", "trainer.log_every_n_steps=1", *overrides]  # fmt: skip
    return subprocess.Popen(
        ["bash", str(REPO / "launchers" / "slurm.sbatch"), *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_tasks_form_one_world_and_finish(tmp_path: Path) -> None:
    proc = start(tmp_path, "trainer.max_num_steps=2")
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()
    assert output.count("Trained 2 steps.") == 1 and not (tmp_path / "requeued").exists()


def test_the_time_limit_signal_saves_and_requeues(tmp_path: Path) -> None:
    proc = start(tmp_path, "trainer.max_num_steps=500")
    assert proc.stdout is not None
    for line in proc.stdout:
        if "step 2 train/loss" in line:
            break
    for pid in descendants(proc.pid):  # SLURM signals every task
        if "eagleforge.train" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
            os.kill(pid, signal.SIGUSR1)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 138, output[-3000:]
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("step_*")
    assert 2 <= int(checkpoint.name.removeprefix("step_")) < 500
