"""Which process logs, how a run is tagged with its Hydra job, and how failed and stopped runs
are marked in MLflow."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from eagleforge.config import compose_config, conf_dir, register_configs
from eagleforge.errors import ConfigError
from eagleforge.tracking import (
    MLflowTracker,
    NullTracker,
    TrackerConfig,
    build_tracker,
    hydra_job_tags,
    record_failure,
    record_stop,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_hydra_config_left() -> Iterator[None]:
    yield
    HydraConfig.instance().cfg = None  # type: ignore[assignment]


def root_config(tmp_path: Path, *overrides: str) -> DictConfig:
    return compose_config(
        [
            "+model=tiny",
            "data=chitchat",
            f"output_root={tmp_path}",
            f"output_dir={tmp_path / 'job'}",
            *overrides,
        ]
    )


def runs(tmp_path: Path) -> list:  # type: ignore[type-arg]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_only_the_main_process_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tracker = build_tracker(TrackerConfig(), tmp_path, "run", is_main=False)
    assert isinstance(tracker, NullTracker)
    with caplog.at_level("DEBUG"):
        tracker.log_config({"a": 1}, "a: 1")
        tracker.log_metrics({"train/loss": 1.0}, step=1)
        tracker.log_artifact(tmp_path)
        tracker.close()
    assert not caplog.records and not list(tmp_path.iterdir())


def test_a_hydra_job_is_tagged_with_its_overrides(tmp_path: Path) -> None:
    assert hydra_job_tags() == {}  # outside a Hydra job
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["+model=tiny", "data=chitchat", "optimizer.lr=3e-4"],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    tags = hydra_job_tags()
    assert tags == {
        "overrides": "+model=tiny data=chitchat optimizer.lr=3e-4",
        "override/model": "tiny",
        "override/data": "chitchat",
        "override/optimizer.lr": "3e-4",
    }
    tracker = build_tracker(TrackerConfig(), tmp_path, "tagged")
    tracker.close()
    (run_,) = runs(tmp_path)
    assert {k: v for k, v in run_.data.tags.items() if not k.startswith("mlflow.")} == tags


def test_a_failure_ends_the_open_run_as_failed(tmp_path: Path) -> None:
    import mlflow

    tracker = build_tracker(TrackerConfig(), tmp_path, "crashes")
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    record_failure(RuntimeError("out of memory"), root_config(tmp_path))
    assert mlflow.active_run() is None  # the next job of a sweep starts its own run
    (run_,) = runs(tmp_path)
    assert run_.info.status == "FAILED"
    assert run_.data.tags["error"] == "RuntimeError: out of memory"
    assert run_.data.metrics["train/loss"] == 1.0


def test_a_job_that_failed_before_its_run_gets_a_failed_run(tmp_path: Path) -> None:
    record_failure(ConfigError("optimizer.lr must be > 0, got -1.0."), root_config(tmp_path))
    record_failure(KeyboardInterrupt(), root_config(tmp_path, "tracker.experiment=other"))
    failed, killed = sorted(runs(tmp_path), key=lambda r: r.info.start_time)
    assert failed.info.status == "FAILED" and failed.info.run_name == "tiny-chitchat-job"
    assert failed.data.tags["error"] == "ConfigError: optimizer.lr must be > 0, got -1.0."
    assert killed.info.status == "KILLED"


def test_nothing_is_recorded_for_console_runs_or_other_ranks(tmp_path: Path) -> None:
    record_failure(RuntimeError("x"), root_config(tmp_path, "tracker=console"))
    record_failure(RuntimeError("x"), root_config(tmp_path), is_main=False)
    assert not (tmp_path / "mlflow.db").exists()


def test_a_stopped_run_is_marked_killed_with_its_signal(tmp_path: Path) -> None:
    tracker = build_tracker(TrackerConfig(), tmp_path, "preempted")
    assert isinstance(tracker, MLflowTracker)
    tracker.close()
    record_stop(signal.SIGUSR2, root_config(tmp_path))
    (run_,) = runs(tmp_path)
    assert run_.info.status == "KILLED" and run_.data.tags["stopped_by"] == "SIGUSR2"


def test_a_job_without_a_model_is_recorded_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`python -m eagleforge.train data=chitchat` (no +model) fails before it has a run: its
    FAILED run is named with what the config has, and recording it warns of nothing."""
    cfg = compose_config(
        ["data=chitchat", f"output_root={tmp_path}", f"output_dir={tmp_path / 'job'}"]
    )
    with caplog.at_level("WARNING"):
        record_failure(ConfigError("No target model chosen: add +model=NAME."), cfg)
    assert not [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    (run_,) = runs(tmp_path)
    assert run_.info.status == "FAILED" and run_.info.run_name == "unknown-chitchat-job"


def test_mlflow_internals_go_to_the_log_file_not_the_console(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A locked sqlite store makes MLflow's and SQLAlchemy's loggers print long tracebacks:
    they belong in the run's log file (Hydra's file handler on the root logger)."""
    log_file = tmp_path / "train.log"
    handler = logging.FileHandler(log_file)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        tracker = build_tracker(TrackerConfig(), tmp_path, "run", output_dir=tmp_path / "job")
        capfd.readouterr()
        try:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        except RuntimeError:
            logging.getLogger("mlflow.store.db.utils").exception("mlflow's own report")
            logging.getLogger("sqlalchemy.pool.impl.QueuePool").error("the pool's", exc_info=True)
        tracker.close()
    finally:
        root.removeHandler(handler)
        handler.close()
    console = "".join(capfd.readouterr())
    assert "database is locked" not in console and "Traceback" not in console
    logged = log_file.read_text()
    assert "mlflow's own report" in logged and "the pool's" in logged
    assert logged.count("RuntimeError: (sqlite3.OperationalError) database is locked") == 2
