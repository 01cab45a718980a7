"""Experiment tracking: one small interface, with an MLflow and a console implementation.

Metric names are slash-scoped (``train/loss``, ``train/acc_3``, ``eval/tau_sim``). The default
MLflow store is ``sqlite:///<output_root>/mlflow.db`` with artifacts beside it, so no server is
needed; ``tracker.tracking_uri`` or ``MLFLOW_TRACKING_URI`` points at a shared server instead.
Only rank 0 builds a real tracker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class TrackerKind(str, Enum):
    mlflow = "mlflow"
    console = "console"


@dataclass
class TrackerConfig:
    """The `tracker` config section."""

    # Where metrics go (mlflow | console).
    kind: TrackerKind = TrackerKind.mlflow
    # MLflow tracking URI; null = $MLFLOW_TRACKING_URI, else sqlite:///<output_root>/mlflow.db.
    tracking_uri: str | None = None
    # MLflow experiment name.
    experiment: str = "eagleforge"
    # Run name; null = <model>-<data>-<timestamp of the output dir>.
    run_name: str | None = None


class Tracker(Protocol):
    def log_config(self, params: Mapping[str, Any], config_yaml: str) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_artifact(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are kept as their string form."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class ConsoleTracker:
    """Logs metrics through the ``logging`` module."""

    def log_config(self, params: Mapping[str, Any], config_yaml: str) -> None:
        log.debug("config:\n%s", config_yaml)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        text = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        log.info("step %d %s", step, text)

    def log_artifact(self, path: str | Path) -> None:
        log.info("artifact %s", path)

    def close(self) -> None:
        pass


class MLflowTracker:
    """An MLflow run: params, slash-scoped metrics with steps, artifacts."""

    def __init__(
        self, tracking_uri: str, experiment: str, run_name: str, artifact_root: Path
    ) -> None:
        import mlflow

        self.mlflow = mlflow
        active = mlflow.active_run()
        # Inside a run someone else started (a notebook, a sweep driver): log into it.
        self.owns_run = active is None
        if active is not None:
            self.tracking_uri = mlflow.get_tracking_uri()
            self.run, self.run_id = active, active.info.run_id
            return
        self.tracking_uri = tracking_uri
        previous = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(tracking_uri)
        # mlflow also exports the URI to the environment, where the next run built in this
        # process (a sweep, a notebook) would mistake it for the user's MLFLOW_TRACKING_URI.
        if previous is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous
        client = mlflow.MlflowClient()
        found = client.get_experiment_by_name(experiment)
        if found is None:
            # A sqlite store would otherwise put artifacts in ./mlruns of whatever the cwd is.
            location = (
                artifact_root.resolve().as_uri() if tracking_uri.startswith("sqlite") else None
            )
            experiment_id = client.create_experiment(experiment, artifact_location=location)
        else:
            experiment_id = found.experiment_id
        self.run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name)
        self.run_id = self.run.info.run_id

    def log_config(self, params: Mapping[str, Any], config_yaml: str) -> None:
        # MLflow caps param values at 6000 characters and a batch at 100 params.
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.mlflow.log_params(dict(items[start : start + 100]))
        self.mlflow.log_text(config_yaml, "config.yaml")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            self.mlflow.log_artifacts(str(path), artifact_path=path.name)
        else:
            self.mlflow.log_artifact(str(path))

    def close(self) -> None:
        if self.owns_run:
            self.mlflow.end_run()


class NullTracker(ConsoleTracker):
    """What ranks other than 0 get: nothing is written."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass


def default_tracking_uri(output_root: str | Path) -> str:
    return f"sqlite:///{Path(output_root).resolve() / 'mlflow.db'}"


def build_tracker(
    cfg: TrackerConfig, output_root: str | Path, run_name: str, rank: int = 0
) -> Tracker:
    if rank != 0:
        return NullTracker()
    if cfg.kind == TrackerKind.console:
        return ConsoleTracker()
    uri = (
        cfg.tracking_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or default_tracking_uri(output_root)
    )
    Path(output_root).mkdir(parents=True, exist_ok=True)
    return MLflowTracker(
        uri, cfg.experiment, cfg.run_name or run_name, Path(output_root) / "mlartifacts"
    )
