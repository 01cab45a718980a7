"""Shared tracking: `make mlflow-server` serves MLflow over HTTP, a run logs to it through
MLFLOW_TRACKING_URI, and its metrics read back through the server's REST API; a run that
loses the server spools what it logs, and `python -m eagleforge.tracking sync` sends it once
the server is back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from eagleforge.config import compose_config
from eagleforge.tracking import TrackerConfig, build_tracker
from eagleforge.train import run
from helpers.ranks import free_port
from helpers.runs import tiny_run_overrides

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


@contextmanager
def serve(store: Path, port: int, log_path: Path) -> Iterator[str]:
    """`make mlflow-server` on ``port`` with its store in ``store``; yields the tracking URI
    it prints. Stops exactly the processes it started: the server is started in a new
    session, and its process group is ended on exit."""
    venv = Path(sys.prefix)
    with open(log_path, "a") as log:
        server = subprocess.Popen(
            [
                "make",
                "--no-print-directory",
                "mlflow-server",
                f"MLFLOW_PORT={port}",
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
        uri = f"http://127.0.0.1:{port}"
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        assert f"MLFLOW_TRACKING_URI={uri}" in log_path.read_text()
        yield uri
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


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A server on a free port with its store in tmp_path/server: its URI and store."""
    store = tmp_path / "server"
    with serve(store, free_port(), tmp_path / "server.log") as uri:
        yield uri, store


def test_a_run_logs_to_a_shared_server(
    mlflow_server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, store = mlflow_server
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    output_root = tmp_path / "out"
    overrides = tiny_run_overrides(
        output_root,
        "data.max_num_samples=40",
        "data.num_eval_samples=4",
        "data.max_length=64",
        "draft.ttt_length=2",
        "trainer.max_num_steps=3",
        "trainer.log_every_n_steps=1",
        "tracker=mlflow",
        "tracker.experiment=shared",
    )
    result = run(compose_config(overrides))
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


def test_a_run_that_loses_the_server_spools_and_syncs(tmp_path: Path) -> None:
    """The server stops while the run trains: no call waits for it, the run's end spools
    what was not sent (one warning with the command), and `sync` sends it to the same run
    once the server is back, ending that run FINISHED."""
    import mlflow

    store, port, run_dir = tmp_path / "server", free_port(), tmp_path / "out" / "run"
    run_dir.mkdir(parents=True)
    with serve(store, port, tmp_path / "server.log") as uri:
        tracker = build_tracker(
            TrackerConfig(tracking_uri=uri, experiment="outage", close_timeout_s=2),
            tmp_path / "out",
            "outage",
            tags={},
            output_dir=run_dir,
        )
        tracker.log_config({"optimizer.lr": 0.001}, "optimizer:\n  lr: 0.001\n")
        tracker.log_metrics({"train/loss": 4.0}, step=1)
    for step in range(2, 6):  # the server is gone
        start = time.monotonic()
        tracker.log_metrics({"train/loss": 4.0 - step / 2}, step=step)
        assert time.monotonic() - start < 1.0
    (run_dir / "summary.json").write_text('{"step": 5}\n')
    tracker.log_artifact(run_dir / "summary.json")
    tracker.close()
    assert list((run_dir / "mlflow_spool").glob("*/entries.jsonl"))

    with serve(store, port, tmp_path / "server.log") as uri:
        synced = subprocess.run(
            [sys.executable, "-m", "eagleforge.tracking", "sync", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert synced.returncode == 0, synced.stdout + synced.stderr
        client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("outage")
        assert experiment is not None
        (logged,) = client.search_runs([experiment.experiment_id])
        assert logged.info.status == "FINISHED"
        history = client.get_metric_history(logged.info.run_id, "train/loss")
        assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]
        artifacts = {a.path for a in client.list_artifacts(logged.info.run_id)}
        assert {"config.yaml", "summary.json"} <= artifacts
    assert not (run_dir / "mlflow_spool").exists()
