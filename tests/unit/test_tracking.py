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


def test_params_are_the_values_a_user_types(tmp_path: Path) -> None:
    """Enum fields are logged as their values (``random``, not ``ModelSource.random``), so
    that runs can be filtered by what was typed on the command line."""
    import mlflow
    from omegaconf import OmegaConf

    from eagleforge.config import compose_config
    from eagleforge.tracking import flatten

    cfg = compose_config(["+model=tiny", "data=chitchat", f"output_dir={tmp_path / 'job'}"])
    container = OmegaConf.to_container(cfg, resolve=True)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(uri, "params", "run", tmp_path / "artifacts")
    tracker.log_config(flatten(container), OmegaConf.to_yaml(container))  # type: ignore[arg-type]
    tracker.close()
    params = mlflow.MlflowClient(uri).get_run(tracker.run_id).data.params
    assert params["model.source"] == "random"
    assert params["tracker.kind"] == "mlflow"
    assert not [v for v in params.values() if v.startswith(("ModelSource.", "OptimizerKind."))]


def test_both_trackers_write_the_same_console_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Hydra sends the logging module to the console and to <run dir>/train.log: the MLflow
    tracker writes there the same lines as the console tracker."""
    from eagleforge.tracking import ConsoleTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(uri, "lines", "run", tmp_path / "artifacts")
    with caplog.at_level("INFO", logger="eagleforge.metrics"):
        tracker.log_metrics({"train/loss": 2.5, "train/acc_0": 0.125}, step=3)
        ConsoleTracker().log_metrics({"train/loss": 2.5, "train/acc_0": 0.125}, step=3)
    tracker.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "eagleforge.metrics"]
    assert lines == ["step 3 train: loss 2.5  acc_0 0.125"] * 2, lines
