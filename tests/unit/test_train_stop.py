"""What a training run stopped by a signal prints: the command that goes on from its checkpoint.
Every command makes a new run (or sweep) directory by default, so that command names the
stopped one: hydra.run.dir, or for a sweep hydra.sweep.dir. Its summary.json says it stopped."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from eagleforge import train
from eagleforge.config import conf_dir, register_configs
from eagleforge.trainer import TrainResult

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_hydra_config_left() -> Iterator[None]:
    yield
    HydraConfig.instance().cfg = None  # type: ignore[assignment]


def hydra_job(tmp_path: Path, mode: RunMode, *overrides: str) -> DictConfig:
    """The config of a Hydra job (set as the current one), as ``_hydra_main`` receives it."""
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["+model=tiny", f"output_root={tmp_path}", *overrides],
            return_hydra_config=True,
        )
    with open_dict(cfg):
        cfg.hydra.mode = mode
        cfg.hydra.job.num = 0
        cfg.hydra.runtime.output_dir = str(tmp_path / "runs" / "t0")
    HydraConfig.instance().set_config(cfg)
    return cfg


def stopped_output(
    cfg: DictConfig,
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """``_hydra_main``'s last line when its run stopped on SIGTERM after step 8."""

    def stopped(_: Any) -> TrainResult:
        return TrainResult(step=8, preempted_by=signal.SIGTERM)

    monkeypatch.setattr(train, "run", stopped)
    monkeypatch.setattr(train, "record_stop", lambda *_, **__: None)
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as stop:
        train._hydra_main(cfg)
    assert stop.value.code == 128 + signal.SIGTERM
    return capsys.readouterr().err.splitlines()[-1]


def test_a_stopped_sweep_prints_the_command_that_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = hydra_job(tmp_path, RunMode.MULTIRUN)
    sweep_dir = Path(cfg.hydra.sweep.dir).resolve()
    argv = ["/x/eagleforge/train.py", "-m", "+model=tiny", "optimizer.lr=1e-3,3e-3"]
    assert stopped_output(cfg, argv, monkeypatch, capsys) == (
        "stopped by SIGTERM after step 8 in job 0 of the sweep, checkpoint saved; to go on "
        "(this job from its checkpoint, the jobs not run yet from the start, finished ones "
        "skipped), run: python -m eagleforge.train -m +model=tiny optimizer.lr=1e-3,3e-3 "
        f"hydra.sweep.dir={sweep_dir}"
    )


def test_a_stopped_run_prints_its_run_directory_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = hydra_job(tmp_path, RunMode.RUN)
    run_dir = tmp_path / "runs" / "t0"
    argv = ["/x/eagleforge/train.py", "+model=tiny", f"hydra.run.dir={run_dir}"]
    assert stopped_output(cfg, argv, monkeypatch, capsys) == (
        "stopped by SIGTERM after step 8, checkpoint saved; to go on from it, run: "
        f"python -m eagleforge.train +model=tiny hydra.run.dir={run_dir}"
    )
    # under submitit or torchrun this process is not the command typed: what to add to it
    argv = ["/x/submitit/core/_submit.py", "/x/.submitit/123"]
    assert stopped_output(cfg, argv, monkeypatch, capsys).endswith(
        f"run: the same command with hydra.run.dir={run_dir}"
    )


def test_a_directory_hydra_cannot_read_plain_is_quoted() -> None:
    assert train.hydra_override("hydra.run.dir", "/o/runs/t0") == "hydra.run.dir=/o/runs/t0"
    assert train.hydra_override("hydra.run.dir", "/o/a,b") == 'hydra.run.dir="/o/a,b"'
    assert train.hydra_override("hydra.run.dir", "/o/é") == 'hydra.run.dir="/o/é"'


def test_the_summary_of_a_stopped_run_says_where_it_stopped(tmp_path: Path) -> None:
    result = TrainResult(step=8, preempted_by=signal.SIGTERM)
    summary = json.loads(train.write_summary(result, tmp_path / "summary.json", 351).read_text())
    assert (summary["step"], summary["max_num_steps"], summary["stopped_by"]) == (8, 351, "SIGTERM")
    done = json.loads(
        train.write_summary(TrainResult(step=351), tmp_path / "s.json", 351).read_text()
    )
    assert done["stopped_by"] is None


def test_a_sweep_job_ended_by_a_user_error_is_named_in_one_line_at_the_sweeps_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job returns (raised, Hydra would end the sweep with its traceback) and says nothing
    yet; its record in the sweep directory -- all a submitit job shares with the sweep's
    process -- becomes one line at the end, and status 1. The next command of the sweep starts
    with no record of this one's failures."""
    from eagleforge.errors import ConfigError

    cfg = hydra_job(tmp_path, RunMode.MULTIRUN, "optimizer.lr=-1")

    def refused(_: Any) -> TrainResult:
        raise ConfigError("optimizer.lr must be > 0, got -1.0.")

    monkeypatch.setattr(train, "run", refused)
    monkeypatch.setattr(train, "record_failure", lambda *_, **__: None)
    callback = train.SweepFailures()
    callback.on_multirun_start(cfg)
    train._hydra_main(cfg)
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as end:
        callback.on_multirun_end(cfg)
    assert end.value.code == 1
    assert capsys.readouterr().err == (
        f"error: job 0 (+model=tiny output_root={tmp_path} optimizer.lr=-1): optimizer.lr must "
        "be > 0, got -1.0.\n"
    )
    callback.on_multirun_start(cfg)
    callback.on_multirun_end(cfg)  # nothing failed in this command: no line, no exit


def test_a_failed_job_is_named_by_what_the_sweep_varies() -> None:
    planned = [["+model=tiny", "optimizer.lr=-1", "seed=0"], ["+model=tiny", "optimizer.lr=1e-3"]]
    record = {"job": 0, "overrides": planned[0], "error": "optimizer.lr must be > 0."}
    assert train.job_failure_line(record, planned) == (
        "job 0 (optimizer.lr=-1 seed=0): optimizer.lr must be > 0."
    )
    assert train.job_failure_line(record, None) == (
        "job 0 (+model=tiny optimizer.lr=-1 seed=0): optimizer.lr must be > 0."
    )
