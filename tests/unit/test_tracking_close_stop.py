"""Ctrl-C or SIGTERM while a run's end is written to MLflow: the write completes, the run is
marked KILLED with the signal (not FINISHED), and the signal then does what it would have --
KeyboardInterrupt, ``Stopped`` -- so the command stops in one line with 128 + the signal.
Raised inside MLflow's SQLAlchemy instead, it was printed as "Exception ignored" and lost.

The signal is sent from inside the MLflow call that writes the end (the sender thread's
``set_terminated``), so it arrives while ``close`` waits for it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from eagleforge.errors import InterruptedAtTheEnd, Stopped, stop_on_signals
from eagleforge.tracking import MLflowTracker, record_failure

pytestmark = pytest.mark.unit


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Ctrl-C as at a terminal, also where the tests run in a background job (SIGINT is
    ignored there)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MLflow store for the module's runs (making a store's tables takes seconds)."""
    return tmp_path_factory.mktemp("mlflow")


def _uri(store: Path) -> str:
    return f"sqlite:///{store / 'mlflow.db'}"


def _tracker(store: Path, experiment: str, signum: int) -> MLflowTracker:
    """A tracker with a metric logged, whose end write gets ``signum`` once, mid-call."""
    tracker = MLflowTracker(_uri(store), experiment, "run", store / "artifacts")
    tracker.log_metrics({"eval/tau": 1.5}, step=1)
    written: Callable[..., Any] = tracker.client.set_terminated
    sent: list[int] = []

    def set_terminated(*args: Any, **kwargs: Any) -> Any:
        if not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)
            time.sleep(0.5)  # the main thread takes the signal while this write goes on
        return written(*args, **kwargs)

    tracker.client.set_terminated = set_terminated  # type: ignore[method-assign]
    return tracker


def _run(store: Path, tracker: MLflowTracker) -> Any:
    import mlflow

    return mlflow.MlflowClient(_uri(store)).get_run(tracker.run_id)


@pytest.mark.usefixtures("ctrl_c")
@pytest.mark.parametrize(
    ("signum", "raised"),
    [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Stopped)],
)
def test_a_stop_during_the_last_write_marks_the_run_killed_and_goes_on(
    store: Path, signum: int, raised: type[BaseException]
) -> None:
    tracker = _tracker(store, "stop", signum)
    with stop_on_signals(), pytest.raises(raised):  # SIGTERM raises Stopped, as in a command
        tracker.close()
    run = _run(store, tracker)
    assert run.info.status == "KILLED"
    assert run.data.tags["stopped_by"] == signal.Signals(signum).name
    assert run.data.metrics["eval/tau"] == 1.5  # what was logged before is all there
    assert tracker.stopped_by == signum


@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_there_says_the_finished_work_is_saved(store: Path) -> None:
    """The Ctrl-C raised after a FINISHED run's end is InterruptedAtTheEnd: train says its
    training is complete and saved, not "stopped without saving"."""
    tracker = _tracker(store, "end", signal.SIGINT)
    with pytest.raises(InterruptedAtTheEnd):
        tracker.close()
    failed = _tracker(store, "end", signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as stop:
        failed.close("FAILED")  # a run that did not finish stays a plain interruption
    assert not isinstance(stop.value, InterruptedAtTheEnd)


@pytest.mark.usefixtures("ctrl_c")
def test_a_job_stopped_there_gets_no_second_run(store: Path) -> None:
    """train's way out after Ctrl-C records the failure: the run is marked already, and no
    FAILED run of its own is made for the job."""
    import mlflow

    tracker = _tracker(store, "record", signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as stop:
        tracker.close()
    cfg = OmegaConf.create(
        {"tracker": {"kind": "mlflow", "tracking_uri": _uri(store), "experiment": "record"},
         "output_root": str(store), "output_dir": str(store / "run")}
    )  # fmt: skip
    record_failure(stop.value, cfg)
    client = mlflow.MlflowClient(_uri(store))
    experiment = client.get_experiment_by_name("record")
    assert experiment is not None
    (only,) = client.search_runs([experiment.experiment_id])
    assert only.info.status == "KILLED"


def test_a_handler_that_lets_the_command_go_on_leaves_it_finished(store: Path) -> None:
    """submitit's SIGTERM handler only logs: the command goes on to its end, and the run's end
    says FINISHED, as it does."""
    handled: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: handled.append(signum))
    try:
        tracker = _tracker(store, "stop", signal.SIGTERM)
        tracker.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert handled == [signal.SIGTERM]  # handed on once the end was written
    assert _run(store, tracker).info.status == "FINISHED"
    assert tracker.stopped_by is None
