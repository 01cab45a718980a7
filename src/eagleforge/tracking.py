"""Experiment tracking: one small interface, with an MLflow and a console implementation.

Metric names are slash-scoped (``train/loss``, ``train/acc_3``, ``eval/tau_sim``). The default
MLflow store is ``sqlite:///<output_root>/mlflow.db`` with artifacts beside it, so no server is
needed; ``tracker.tracking_uri`` or ``MLFLOW_TRACKING_URI`` points at a shared server instead
(``make mlflow-server``). Only rank 0 builds a real tracker. Inside a Hydra job the run is
tagged with the job's command-line overrides (``override/<key>``), and in a sweep with the
sweep directory and job number, so the runs of one sweep can be filtered and compared.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

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
    # Run name; null = <model>-<data>-<time of the run dir> (in a sweep, also the job number).
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


@contextmanager
def _store_setup_lock(tracking_uri: str) -> Iterator[None]:
    """Held while a sqlite store is created or migrated and the experiment looked up or made:
    the jobs of a sweep start at the same time (submitit, job arrays) and would otherwise
    race to create the same tables and experiment. A server serialises that itself."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    db = Path(tracking_uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class MLflowTracker:
    """An MLflow run: params, slash-scoped metrics with steps, artifacts."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        artifact_root: Path,
        tags: Mapping[str, str] | None = None,
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
        with _store_setup_lock(tracking_uri):
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
        self.run = mlflow.start_run(
            experiment_id=experiment_id, run_name=run_name, tags=dict(tags or {})
        )
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


class NullTracker:
    """What ranks other than 0 get: nothing is written or logged."""

    def log_config(self, params: Mapping[str, Any], config_yaml: str) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def close(self) -> None:
        pass


def default_tracking_uri(output_root: str | Path) -> str:
    return f"sqlite:///{Path(output_root).resolve() / 'mlflow.db'}"


def hydra_job_tags() -> dict[str, str]:
    """Tags that say which Hydra job a run is: ``overrides`` (the job's command-line overrides,
    as typed), ``override/<key>`` for each of them and, in a sweep (-m), ``sweep/dir`` and
    ``sweep/job_num``. Empty outside a Hydra job (tests, notebooks)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return {}
    hydra_cfg = HydraConfig.get()
    overrides = [str(o) for o in hydra_cfg.overrides.task]
    tags = {"overrides": " ".join(overrides)[:MAX_TAG_CHARS]}
    for override in overrides:
        key, _, value = override.partition("=")
        tags[f"override/{key.lstrip('+~')}"] = value[:MAX_TAG_CHARS]
    if hydra_cfg.mode == RunMode.MULTIRUN:
        tags["sweep/dir"] = str(Path(hydra_cfg.sweep.dir).resolve())
        tags["sweep/job_num"] = str(hydra_cfg.job.num)
    return tags


# MLflow's limit on a tag value (and a param value) is 8000 / 6000 characters.
MAX_TAG_CHARS = 5000


def default_run_name(model: str, data: str, output_dir: Path) -> str:
    """<model>-<data>-<run dir time>, or in a sweep <model>-<data>-<sweep time>-<job number>."""
    # a sweep job's dir is <sweep dir>/<job number> (hydra.sweep.subdir)
    parts = output_dir.parts[-2:] if output_dir.name.isdigit() else output_dir.parts[-1:]
    return "-".join([model, data, *parts])


def build_tracker(
    cfg: TrackerConfig,
    output_root: str | Path,
    run_name: str,
    *,
    is_main: bool = True,
    tags: Mapping[str, str] | None = None,
) -> Tracker:
    """The tracker of this process: a NullTracker on every process but the main one
    (``world.is_main``), so that one run is logged however many processes train. ``tags`` go
    on the MLflow run; null = ``hydra_job_tags()``."""
    if not is_main:
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
        uri,
        cfg.experiment,
        cfg.run_name or run_name,
        Path(output_root) / "mlartifacts",
        hydra_job_tags() if tags is None else tags,
    )


def record_failure(error: BaseException, cfg: DictConfig, *, is_main: bool = True) -> None:
    """After ``error`` stopped a run: end the MLflow run it left open as FAILED (KILLED for
    Ctrl-C) with the error as the ``error`` tag. A job that failed before it had a run (a bad
    config value, an unreadable data file) gets a FAILED run of its own, so that every job of
    a sweep shows in MLflow. ``cfg`` is the run's composed root config; never raises."""
    if not is_main:
        return
    status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
    message = f"{type(error).__name__}: {error}"[:MAX_TAG_CHARS]
    try:
        if "mlflow" in sys.modules:
            import mlflow

            if mlflow.active_run() is not None:
                mlflow.set_tag("error", message)
                mlflow.end_run(status=status)
                return
        tracker_cfg = OmegaConf.to_object(cfg.tracker)
        if not isinstance(tracker_cfg, TrackerConfig) or tracker_cfg.kind != TrackerKind.mlflow:
            return
        output_dir = Path(str(OmegaConf.select(cfg, "output_dir", default="run")))
        model, data = (
            str(OmegaConf.select(cfg, key, default="unknown"))
            for key in ("model.name", "data.name")
        )
        tracker = build_tracker(
            tracker_cfg,
            str(OmegaConf.select(cfg, "output_root", default="outputs")),
            default_run_name(model, data, output_dir),
        )
        assert isinstance(tracker, MLflowTracker)
        tracker.mlflow.set_tag("error", message)
        tracker.mlflow.end_run(status=status)
    except Exception as e:  # the failure being reported matters more than this record of it
        log.warning("could not record the failure in MLflow (%s: %s)", type(e).__name__, e)


def record_stop(signum: int, cfg: DictConfig, *, is_main: bool = True) -> None:
    """After a signal stopped a run that then saved and closed its MLflow run: mark that run
    KILLED with the signal as the ``stopped_by`` tag. A requeued job logs a new run with the
    same name and tags, so each segment of a preempted job stays visible. ``cfg`` is the
    run's composed root config; never raises."""
    if not is_main or "mlflow" not in sys.modules:
        return
    if OmegaConf.select(cfg, "tracker.kind") != TrackerKind.mlflow:
        return
    try:
        import mlflow

        run = mlflow.last_active_run()  # the run this job's tracker started and closed
        if run is None:
            return
        client = mlflow.MlflowClient()
        client.set_tag(run.info.run_id, "stopped_by", signal.Signals(signum).name)
        client.set_terminated(run.info.run_id, "KILLED")
    except Exception as e:  # the checkpoint is saved; the MLflow status is a courtesy
        log.warning("could not mark the MLflow run stopped (%s: %s)", type(e).__name__, e)
