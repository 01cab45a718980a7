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
        self._pending: list[tuple[dict[str, float], int]] = []
        self._pending_artifacts: list[Path] = []
        self._warned = False
        if tracking_uri.startswith("http"):
            # fail fast instead of mlflow's default of minutes of retries per call
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
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

    # Once the run exists, an unreachable tracking server must not stop training: what cannot
    # be sent is kept and sent with the next call that gets through (or at close).

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._pending.append(({k: float(v) for k, v in metrics.items()}, step))
        self._flush()

    def log_artifact(self, path: str | Path) -> None:
        self._pending_artifacts.append(Path(path))
        self._flush()

    def _flush(self) -> None:
        try:
            while self._pending:
                metrics, step = self._pending[0]
                self.mlflow.log_metrics(metrics, step=step)
                self._pending.pop(0)
            while self._pending_artifacts:
                path = self._pending_artifacts[0]
                if path.is_dir():
                    self.mlflow.log_artifacts(str(path), artifact_path=path.name)
                else:
                    self.mlflow.log_artifact(str(path))
                self._pending_artifacts.pop(0)
        except Exception as e:  # mlflow raises many types when its server is down
            if not self._warned:
                log.warning(
                    "MLflow at %s is unreachable (%s: %s); training goes on, and the %d "
                    "pending metric batches are sent when it is back.",
                    self.tracking_uri,
                    type(e).__name__,
                    e,
                    len(self._pending),
                )
                self._warned = True
            return
        if self._warned:
            log.warning("MLflow at %s is reachable again; pending metrics sent.", self.tracking_uri)
            self._warned = False

    def close(self) -> None:
        self._flush()
        if self._pending or self._pending_artifacts:
            log.warning(
                "MLflow at %s is still unreachable: %d metric batches and %d artifacts were not "
                "logged (the run directory holds summary.json and the checkpoints).",
                self.tracking_uri,
                len(self._pending),
                len(self._pending_artifacts),
            )
        if self.owns_run:
            try:
                self.mlflow.end_run()
            except Exception as e:  # the server may still be down
                log.warning("could not end the MLflow run (%s)", e)


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
