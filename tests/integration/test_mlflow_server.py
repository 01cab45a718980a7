"""Shared tracking: `make mlflow-server` serves MLflow over HTTP, a run logs to it through
MLFLOW_TRACKING_URI, and its metrics read back through the server's REST API."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "dist"))  # the shared test helpers
from ranks import free_port  # noqa: E402

from eagleforge.config import compose_config
from eagleforge.train import run

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def live_processes_in_group(pgid: int) -> list[str]:
    """Processes of a process group that are still running (zombies awaiting a reaper are not)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended while we looked
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        state, _ppid, group = text.rsplit(")", 1)[1].split()[:3]
        if int(group) == pgid and state != "Z":
            alive.append(f"{stat.parent.name} ({name})")
    return alive


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`make mlflow-server` on a free port with its store in tmp_path/server; yields the
    tracking URI it prints and the store directory. Stops exactly the processes it started:
    the server is started in a new session, and its process group is ended after the test."""
    store = tmp_path / "server"
    venv = Path(sys.prefix)
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [
                "make",
                "--no-print-directory",
                "mlflow-server",
                f"MLFLOW_PORT={free_port()}",
                f"MLFLOW_DIR={store}",
                f"VENV={venv}",
                "-o",  # the venv is there: never reinstall it from a test
                f"{venv}/.installed",
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        uri = None
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            if uri is None:
                found = re.search(r"MLFLOW_TRACKING_URI=(\S+)", log_path.read_text())
                uri = found.group(1) if found else None
            if uri is not None:
                try:
                    with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
            time.sleep(0.5)
        yield uri, store
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        deadline = time.monotonic() + 30
        while live_processes_in_group(server.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = live_processes_in_group(server.pid)
        if left:
            os.killpg(server.pid, signal.SIGKILL)
        assert not left, f"server processes still running after SIGTERM: {left}"


def test_a_run_logs_to_a_shared_server(
    mlflow_server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, store = mlflow_server
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    output_root = tmp_path / "out"
    result = run(
        compose_config(
            [
                "+model=tiny",
                "data=chitchat",
                "data.max_num_samples=40",
                "data.num_eval_samples=4",
                "data.max_length=64",
                "draft.ttt_length=2",
                "trainer.max_num_steps=3",
                "trainer.log_every_n_steps=1",
                "trainer.progress_bar=false",
                "tracker.experiment=shared",
                f"output_root={output_root}",
                f"output_dir={output_root / 'run'}",
            ]
        )
    )
    assert result.step == 3

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)  # over HTTP, not the store's file
    experiment = client.get_experiment_by_name("shared")
    assert experiment is not None
    (logged,) = client.search_runs([experiment.experiment_id])
    assert logged.info.status == "FINISHED"
    assert logged.data.params["model.name"] == "tiny"
    history = client.get_metric_history(logged.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == pytest.approx(result.train_losses)
    artifacts = {a.path for a in client.list_artifacts(logged.info.run_id)}
    assert {"config.yaml", "summary.json"} <= artifacts
    # the server keeps the runs and artifacts in its own store; nothing went to the local default
    assert (store / "mlflow.db").is_file()
    assert list((store / "mlartifacts").rglob("summary.json"))
    assert not (output_root / "mlflow.db").exists()
