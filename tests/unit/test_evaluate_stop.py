"""An evaluation stopped by SIGTERM (SLURM's preemption, scancel) or Ctrl-C: one line saying
what to run to go on, its MLflow run marked KILLED with the signal, status 128 + the signal --
also when Ctrl-C arrives during the run's last MLflow write.

The command runs in its own process (a SIGTERM that is not handled would end the test run
itself); the signal arrives from within, once the MLflow run exists, as the target loads, or
while MLflow writes the run's end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.draft.model import Eagle3Draft
from eagleforge.formats.eagle3 import export_sglang
from eagleforge.targets.config import TargetConfig
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.source import resolve_model_dir
from helpers.drafts import random_draft, tiny_draft

pytestmark = pytest.mark.unit

# evaluate's main, with the target's loading replaced by the signal under test
SCRIPT = """
import os, signal, sys, time
from eagleforge import evaluate

signum = int(sys.argv[1])
# Ctrl-C as at a terminal, also where this test runs in a background job (SIGINT ignored there)
signal.signal(signal.SIGINT, signal.default_int_handler)

def load_target(*args, **kwargs):
    os.kill(os.getpid(), signum)
    time.sleep(60)

evaluate.build_hf_target = load_target
sys.argv = ["evaluate.py", *sys.argv[2:]]
evaluate.main()
"""


@pytest.mark.parametrize(
    ("signum", "said"),
    [(signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGINT, "interrupted (Ctrl-C)")],
)
def test_a_stopped_evaluation_says_so_and_its_run_is_killed(
    tmp_path: Path, signum: int, said: str
) -> None:
    import mlflow

    draft = export_sglang(tiny_draft(), tmp_path / "step_00000001")
    run_dir = tmp_path / "eval"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(int(signum)), "+model=tiny", f"eval.draft={draft}",
         f"output_root={tmp_path}", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 128 + signum, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"{said}: the evaluation stopped before its end; its MLflow run is marked KILLED, and "
        f"what it finished is in {run_dir}/eval; run the same command again to evaluate from "
        "the start."
    )
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    run_ = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert run_.info.status == "KILLED"
    assert run_.data.tags["stopped_by"] == signal.Signals(signum).name


def tiny_target_draft(tmp_path: Path) -> Eagle3Draft:
    """An untrained draft for +model=tiny (the random Llama, built once into the cache)."""
    config = to_typed(compose_config(["+model=tiny", f"output_dir={tmp_path}"]))
    model_dir = resolve_model_dir(config.model, config.resolved_cache_dir())
    target = HFTarget.from_pretrained(model_dir, TargetConfig(), torch.float32, torch.device("cpu"))
    return random_draft(target, 2048, 0.02, seed=0)


# evaluate's main, with Ctrl-C arriving while MLflow writes the run's end (FINISHED)
LAST_WRITE = """
import os, signal, sys, time
from mlflow import MlflowClient
from eagleforge import evaluate

signal.signal(signal.SIGINT, signal.default_int_handler)
written = MlflowClient.set_terminated
sent = []

def set_terminated(self, *args, **kwargs):
    if not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the main thread takes it while this write goes on
    return written(self, *args, **kwargs)

MlflowClient.set_terminated = set_terminated
sys.argv = ["evaluate.py", *sys.argv[1:]]
evaluate.main()
"""


def test_ctrl_c_during_the_last_mlflow_write_is_not_lost(tmp_path: Path) -> None:
    """The evaluation has decoded everything; Ctrl-C while its run's end is written still
    stops it in one line with 130, its run KILLED, nothing of MLflow's on the console (it was
    an "Exception ignored" traceback, then exit 0 with the run FINISHED). Its output went to
    pipes: no progress bar was redrawn into them."""
    import mlflow

    draft = export_sglang(tiny_target_draft(tmp_path), tmp_path / "step_00000001")
    run_dir = tmp_path / "eval"
    done = subprocess.run(
        [sys.executable, "-c", LAST_WRITE, "+model=tiny", f"eval.draft={draft}",
         "eval.max_prompts=1", "eval.max_new_tokens=8", f"output_root={tmp_path}",
         f"hydra.run.dir={run_dir}"],
        capture_output=True, timeout=600,
    )  # fmt: skip
    # bytes: text mode would turn a bar's carriage returns into newlines
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert (run_dir / "eval" / "step_00000001" / "summary.json").is_file()  # it had finished
    console = stdout + stderr
    assert "Traceback" not in console and "Exception ignored" not in console
    assert "\r" not in console
    assert stderr.splitlines()[-1] == (
        "interrupted (Ctrl-C): the evaluation stopped before its end; its MLflow run is marked "
        f"KILLED, and what it finished is in {run_dir}/eval; run the same command again to "
        "evaluate from the start."
    )
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    run_ = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert run_.info.status == "KILLED"
    assert run_.data.tags["stopped_by"] == "SIGINT"
    assert "eval/tau" in run_.data.metrics
