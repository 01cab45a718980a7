"""The sweep report: a multirun's jobs as one table labelled by what they swept, their
learning curves, and jobs without a summary named as such."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from eagleforge.locking import RUN_DIR_LOCK
from eagleforge.sweep_report import main, read_jobs, rows

pytestmark = pytest.mark.unit


def _job(root: Path, name: str, overrides: list[str], summary: dict | None) -> None:  # type: ignore[type-arg]
    (root / name / ".hydra").mkdir(parents=True)
    (root / name / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (root / name / "summary.json").write_text(json.dumps(summary))


def _summary(tau_sims: list[float], real: float | None) -> dict:  # type: ignore[type-arg]
    history = {str(20 * i): {"eval/tau_sim": t, "eval/loss": 9.0} for i, t in enumerate(tau_sims)}
    final = {"eval/tau_sim": tau_sims[-1], "eval/loss": 9.0, "eval/acc_0": 0.5, "eval/acc_1": 0.25}
    return {
        "step": 20 * (len(tau_sims) - 1),
        "final_eval": final,
        "eval_by_step": history,
        "tau_by_step": {} if real is None else {"40": real},
    }


def test_jobs_are_labelled_by_what_differs_and_unfinished_ones_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["+model=smollm2", "trainer.max_num_steps=40"]
    _job(tmp_path, "0", [*common, "loss=kl"], _summary([1.0, 1.3, 1.5], 1.4))
    _job(tmp_path, "1", [*common, "loss=tv"], _summary([1.0, 1.35, 1.6], None))
    _job(tmp_path, "10", [*common, "loss=jsd"], None)
    jobs = read_jobs(tmp_path)
    assert [j.path.name for j in jobs] == ["0", "1", "10"]  # job order, not string order
    assert [j.label for j in jobs] == ["loss=kl", "loss=tv", "loss=jsd"]
    table = rows(jobs)
    assert table[0]["eval_tau_sim_by_step"] == [(0, 1.0), (20, 1.3), (40, 1.5)]
    assert table[0]["real_tau_best"] == 1.4 and table[1]["real_tau_last"] is None
    assert table[2]["done"] is False
    plot = tmp_path / "curves.png"
    assert main([str(tmp_path), "--plot", str(plot), "--json"]) == 0
    out = capsys.readouterr().out
    assert (
        "| loss=kl | done | 40 | 9.000 | 0.500 / 0.250 | 1.00, 1.30, 1.50 | 1.500 | 1.400 / 1.400 |"
        in out
    )
    assert "| loss=jsd | failed or killed (no checkpoint; see its train.log) | |" in out
    assert plot.stat().st_size > 0


def test_a_directory_without_jobs_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no job directories"):
        main([str(tmp_path)])


def _multirun_yaml(root: Path, task: list[str]) -> None:
    """What Hydra's basic sweeper writes into the sweep directory as it starts."""
    sweeper = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
    lines = ["hydra:", "  sweeper:", f"    _target_: {sweeper}", "    params: null"]
    lines += ["  overrides:", "    task:", *(f"    - {o}" for o in task)]
    (root / "multirun.yaml").write_text("\n".join(lines) + "\n")


def test_a_stopped_sweep_lists_every_job_by_its_overrides_with_its_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Job 0 stopped by SIGTERM at step 8 of 351 and the sweep ended there: job 1 never ran."""
    common = ["+model=smollm2", "trainer.max_num_steps=351"]
    _multirun_yaml(tmp_path, [*common, "optimizer.lr=1e-3,3e-3"])
    stopped = {**_summary([1.0], None), "step": 8, "max_num_steps": 351, "stopped_by": "SIGTERM"}
    _job(tmp_path, "0", [*common, "optimizer.lr=0.001"], stopped)
    table = rows(read_jobs(tmp_path))
    assert [(r["settings"], r["state"]) for r in table] == [
        ({"optimizer.lr": "0.001"}, "stopped by SIGTERM at step 8 of 351"),
        ({"optimizer.lr": "0.003"}, "not run"),
    ]
    assert table[1]["overrides"] == [*common, "optimizer.lr=0.003"] and not table[0]["done"]
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| optimizer.lr=0.001 | stopped by SIGTERM at step 8 of 351 | 8 |" in out
    assert "| optimizer.lr=0.003 | not run | |" in out


def test_running_killed_and_older_stopped_jobs_are_told_apart(tmp_path: Path) -> None:
    common = ["trainer.max_num_steps=100"]
    config = "trainer:\n  max_num_steps: 100\n"
    _job(tmp_path, "0", [*common, "seed=0"], {**_summary([1.0], None), "step": 30})  # no stopped_by
    _job(tmp_path, "1", [*common, "seed=1"], None)
    (tmp_path / "1" / "checkpoints" / "step_00000040").mkdir(parents=True)
    _job(tmp_path, "2", [*common, "seed=2"], None)
    for name in ("0", "1", "2"):
        (tmp_path / name / ".hydra" / "config.yaml").write_text(config)
    lock = os.open(tmp_path / "2" / RUN_DIR_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # job 2's trainer holds its run directory
    try:
        states = [row["state"] for row in rows(read_jobs(tmp_path))]
    finally:
        os.close(lock)
    assert states == [
        "stopped at step 30 of 100",
        "failed or killed (last checkpoint at step 40 of 100; see its train.log)",
        "running",
    ]
