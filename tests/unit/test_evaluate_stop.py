"""An evaluation stopped by SIGTERM (SLURM's preemption, scancel) or Ctrl-C: one line saying
what to run to go on, its MLflow run marked KILLED with the signal, status 128 + the signal.

The command runs in its own process (a SIGTERM that is not handled would end the test run
itself); the signal arrives from within, once the MLflow run exists, as the target loads."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eagleforge.formats.eagle3 import export_sglang
from helpers.drafts import tiny_draft

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
