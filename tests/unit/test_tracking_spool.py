"""MLflow down or hung while a run trains: logging never stalls a step, what cannot be sent is
spooled in the run directory, and ``python -m eagleforge.tracking sync`` sends it later.

The run is created on a sqlite store; then the tracker's client is pointed at a dead or a hung
HTTP server, as if the server had gone away after the run started (the integration test
``test_mlflow_server.py`` does the same with a real server that is stopped and restarted)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagleforge.tracking import MLflowTracker, Spool, sync
from helpers.ranks import free_port

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _quick_http_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


@pytest.fixture
def hung_server() -> Iterator[str]:
    """An HTTP address that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    listener.close()


def tracker_cut_off(tmp_path: Path, server: str, **kwargs: float) -> MLflowTracker:
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(
        store,
        "outage",
        "run",
        tmp_path / "mlartifacts",
        spool_root=tmp_path / "run" / "mlflow_spool",
        **kwargs,  # type: ignore[arg-type]
    )
    tracker.client = MlflowClient(server)  # the server goes away after the run started
    return tracker


def test_a_dead_server_spools_everything_and_sync_sends_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow import MlflowClient

    tracker = tracker_cut_off(tmp_path, f"http://127.0.0.1:{free_port()}", close_timeout_s=5)
    summary = tmp_path / "run" / "summary.json"
    summary.parent.mkdir()
    summary.write_text('{"step": 20}\n')
    with caplog.at_level("WARNING", logger="eagleforge.tracking"):
        tracker.log_config({"optimizer.lr": 0.001}, "optimizer:\n  lr: 0.001\n")
        for step in range(1, 21):
            start = time.monotonic()
            tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
            assert time.monotonic() - start < 1.0
        tracker.log_artifact(summary)
        tracker.close()
    warnings = [r.getMessage() for r in caplog.records]
    spool = tmp_path / "run" / "mlflow_spool" / tracker.run_id
    assert any(
        "20 metric batches and 2 artifacts" in w
        and f"python -m eagleforge.tracking sync {spool}" in w
        for w in warnings
    ), warnings
    assert Spool.open(spool).counts()["metrics"] == 20

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert sync(tmp_path / "run", tracking_uri=store) == 0  # the server is back
    client = MlflowClient(store)
    run_ = client.get_run(tracker.run_id)
    assert run_.info.status == "FINISHED"
    assert run_.data.params == {"optimizer.lr": "0.001"}
    history = client.get_metric_history(tracker.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 21))
    assert {a.path for a in client.list_artifacts(tracker.run_id)} == {
        "config.yaml",
        "summary.json",
    }
    assert not (tmp_path / "run" / "mlflow_spool").exists()


def test_a_hung_server_never_stalls_a_step(tmp_path: Path, hung_server: str) -> None:
    """Each call returns at once whatever the server does; a full queue spills to the spool,
    and close waits close_timeout_s, then spools what is left (the request in flight too)."""
    tracker = tracker_cut_off(tmp_path, hung_server, close_timeout_s=0.5, queue_size=2)
    for step in range(1, 11):
        start = time.monotonic()
        tracker.log_metrics({"train/loss": float(step)}, step=step)
        assert time.monotonic() - start < 1.0
    start = time.monotonic()
    tracker.close()
    assert time.monotonic() - start < 5.0
    spooled = Spool.open(tmp_path / "run" / "mlflow_spool" / tracker.run_id).entries()
    assert sorted(e["step"] for e in spooled if e["kind"] == "metrics") == list(range(1, 11))
    assert [e["status"] for e in spooled if e["kind"] == "end"] == ["FINISHED"]


def test_metrics_logged_during_an_outage_are_sent_when_it_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the server back before the run closes, nothing is left to sync, and the outage
    gave one warning."""
    from mlflow import MlflowClient

    tracker = tracker_cut_off(tmp_path, f"http://127.0.0.1:{free_port()}")
    with caplog.at_level("WARNING", logger="eagleforge.tracking"):
        tracker.log_metrics({"train/loss": 3.0}, step=1)
        tracker.log_metrics({"train/loss": 2.0}, step=2)
        spool = Spool(tmp_path / "run" / "mlflow_spool" / tracker.run_id, {})
        deadline = time.monotonic() + 60
        while spool.counts()["metrics"] < 2:  # the server is found down: both spooled
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tracker.client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # back
        tracker.log_metrics({"train/loss": 1.0}, step=3)
        tracker.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable" in w for w in warnings) == 1, warnings
    assert any("reachable again" in w for w in warnings), warnings
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(tracker.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert not (tmp_path / "run" / "mlflow_spool").exists()


def test_the_next_run_in_the_same_run_directory_sends_an_earlier_spool(tmp_path: Path) -> None:
    """A resumed job whose server answers sends what the earlier process of the job could
    not, and that run gets its end status."""
    from mlflow import MlflowClient

    earlier = tracker_cut_off(tmp_path, f"http://127.0.0.1:{free_port()}", close_timeout_s=5)
    earlier.log_metrics({"train/loss": 2.0}, step=7)
    earlier.close()
    assert (tmp_path / "run" / "mlflow_spool" / earlier.run_id).is_dir()

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    resumed = MLflowTracker(
        store,
        "outage",
        "run",
        tmp_path / "mlartifacts",
        spool_root=tmp_path / "run" / "mlflow_spool",
    )
    resumed.close()
    client = MlflowClient(store)
    assert [m.step for m in client.get_metric_history(earlier.run_id, "train/loss")] == [7]
    assert client.get_run(earlier.run_id).info.status == "FINISHED"
    assert not (tmp_path / "run" / "mlflow_spool").exists()
