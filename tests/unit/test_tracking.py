"""MLflowTracker: its own run by default, or the run a caller already started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagleforge.tracking import MLflowTracker

pytestmark = pytest.mark.unit


def test_logs_into_an_active_run_and_leaves_it_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment("outer", artifact_location=tmp_path.as_uri())
    with mlflow.start_run(experiment_id=experiment) as outer:
        tracker = MLflowTracker(uri, "ignored", "ignored", tmp_path / "artifacts")
        tracker.log_metrics({"eval/tau": 1.5}, step=3)
        tracker.close()
        assert tracker.run_id == outer.info.run_id
        assert mlflow.active_run() is not None  # still the caller's to end
    history = mlflow.MlflowClient().get_metric_history(outer.info.run_id, "eval/tau")
    assert [(m.step, m.value) for m in history] == [(3, 1.5)]


def test_starts_and_ends_its_own_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(uri, "own", "run-a", tmp_path / "artifacts")
    tracker.log_metrics({"train/loss": 2.0}, step=1)
    tracker.close()
    assert mlflow.active_run() is None
    run_ = mlflow.MlflowClient(uri).get_run(tracker.run_id)
    assert run_.data.metrics["train/loss"] == 2.0 and run_.info.run_name == "run-a"
    # the store of this run does not leak into the next one's default
    assert "MLFLOW_TRACKING_URI" not in os.environ


def test_an_unreachable_server_does_not_stop_logging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Metrics logged while the server is down are kept, with one warning, and sent once
    it answers again."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(uri, "outage", "run", tmp_path / "artifacts")
    real = tracker.mlflow.log_metrics
    down = {"on": True}

    def flaky(metrics: dict[str, float], step: int) -> None:
        if down["on"]:
            raise ConnectionError("server unreachable")
        real(metrics, step=step)

    monkeypatch.setattr(tracker.mlflow, "log_metrics", flaky)
    with caplog.at_level("WARNING", logger="eagleforge.tracking"):
        tracker.log_metrics({"train/loss": 3.0}, step=1)
        tracker.log_metrics({"train/loss": 2.0}, step=2)
        down["on"] = False
        tracker.log_metrics({"train/loss": 1.0}, step=3)
    tracker.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "eagleforge.tracking"]
    assert sum("is unreachable" in w for w in warnings) == 1, warnings
    assert any("reachable again" in w for w in warnings)
    history = mlflow.MlflowClient(uri).get_metric_history(tracker.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.0), (3, 1.0)]
