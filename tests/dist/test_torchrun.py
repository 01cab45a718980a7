"""The documented torchrun command, for real: 2 CPU processes, FSDP2 over gloo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import tiny_run_overrides

pytestmark = pytest.mark.dist


def test_torchrun_two_processes_train_and_save(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun) if torchrun.exists() else shutil.which("torchrun") or "torchrun",
        "--standalone", "--nproc-per-node", "2", "-m", "eagleforge.train",
        *tiny_run_overrides(
            tmp_path, "data.max_num_samples=30", "data.num_eval_samples=4", "data.max_length=64",
            "trainer.max_num_steps=2", "parallel.device=cpu", "parallel.num_threads=1",
            "tracker=mlflow",
            # real τ on rank 0, from a whole copy of the sharded draft
            "trainer.eval_tau_every_n_steps=2", "trainer.eval_tau_prompts=1",
            "eval.max_new_tokens=8", name=None,
        ),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    summaries = [run / "summary.json" for run in runs if (run / "summary.json").exists()]
    assert len(summaries) == 1  # rank 0 reports once
    summary = json.loads(summaries[0].read_text())
    assert summary["step"] == 2 and Path(summary["checkpoint"]).is_dir()
    assert list(summary["tau_by_step"]) == ["2"] and summary["tau_by_step"]["2"] >= 1.0
    assert Path(summary["best_checkpoint"]).is_dir()
    assert done.stdout.count("Trained 2 steps.") == 1

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = mlflow.search_runs(experiment_names=["eagleforge"])
    assert len(found) == 1  # one MLflow run, logged by rank 0
