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
