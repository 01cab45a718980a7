"""Hydra sweeps from the command line (``python -m eagleforge.train -m ...``).

Each job gets its own directory and MLflow run, tagged with its overrides; a failed job is
recorded as FAILED and the sweep goes on, ending with status 1. Through hydra-submitit-launcher
(``hydra/launcher=local``) every job runs in its own process, and a job that receives
submitit's SIGUSR2 finishes its step, saves, is requeued by submitit and resumes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def sweep(tmp_path: Path, *overrides: str) -> list[str]:
    """A multirun of the tiny model on a few chitchat conversations into tmp_path/sweep."""
    return [
        sys.executable,
        "-m",
        "eagleforge.train",
        "-m",
        "+model=tiny",
        "data=chitchat",
        "data.max_num_samples=40",
        "data.num_eval_samples=4",
        "data.max_length=64",
        "draft.ttt_length=2",
        "trainer.progress_bar=false",
        "parallel.num_threads=1",  # jobs run side by side under submitit
        f"output_root={tmp_path}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *overrides,
    ]


def runs_by_job(tmp_path: Path) -> dict[str, list]:  # type: ignore[type-arg]
    """The MLflow runs of the sweep, by the job number they are tagged with."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("eagleforge")
    assert experiment is not None
    by_job: dict[str, list] = {}  # type: ignore[type-arg]
    for run in client.search_runs([experiment.experiment_id]):
        by_job.setdefault(run.data.tags["sweep/job_num"], []).append(run)
    return by_job


def _errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The sweep's console lines that name an error; no traceback anywhere on it."""
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def test_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    """A job whose config is refused: the other job trains, and the sweep ends with one line
    naming the failed job and its error (the traceback in the job's train.log) and status 1.
    Run again with a setting that defines the trained job's run, that job's resume is refused
    too, and leaves its .hydra/ and MLflow run as they were."""
    done = subprocess.run(
        sweep(tmp_path, "trainer.max_num_steps=2", "optimizer.lr=-1,1e-3"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert _errors(done) == ["error: job 0 (optimizer.lr=-1): optimizer.lr must be > 0, got -1.0."]
    log = (tmp_path / "sweep" / "0" / "train.log").read_text()
    assert "Traceback" in log and "ConfigError: optimizer.lr must be > 0, got -1.0." in log
    summary = json.loads((tmp_path / "sweep" / "1" / "summary.json").read_text())
    assert summary["step"] == 2
    assert (tmp_path / "sweep" / "0" / ".hydra" / "overrides.yaml").is_file()

    runs = runs_by_job(tmp_path)
    assert sorted(runs) == ["0", "1"] and all(len(r) == 1 for r in runs.values())
    (failed,), (finished,) = runs["0"], runs["1"]
    assert failed.info.status == "FAILED"
    assert failed.data.tags["error"] == "ConfigError: optimizer.lr must be > 0, got -1.0."
    assert failed.data.tags["override/optimizer.lr"] == "-1"
    assert finished.info.status == "FINISHED"
    assert finished.data.tags["override/optimizer.lr"] == "0.001"
    assert finished.data.tags["override/model"] == "tiny"
    assert finished.data.tags["sweep/dir"] == str((tmp_path / "sweep").resolve())
    assert "optimizer.lr=0.001" in finished.data.tags["overrides"]
    assert finished.data.params["optimizer.lr"] == "0.001"
    assert "train/loss" in finished.data.metrics

    trained = tmp_path / "sweep" / "1" / ".hydra"
    record = {p.name: p.read_bytes() for p in trained.iterdir()}
    again = subprocess.run(
        sweep(tmp_path, "trainer.max_num_steps=4", "draft.ttt_length=3", "optimizer.lr=-1,1e-3"),
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 1, again.stderr[-3000:]
    first, second = _errors(again)
    assert first == "error: job 0 (optimizer.lr=-1): optimizer.lr must be > 0, got -1.0."
    assert second.startswith("error: job 1 (optimizer.lr=0.001): ") and (
        "trained with other settings (draft.ttt_length: 2 -> 3)" in second
    )
    assert {p.name: p.read_bytes() for p in trained.iterdir()} == record
    (run,) = runs_by_job(tmp_path)["1"]
    assert (run.info.run_id, run.info.status) == (finished.info.run_id, "FINISHED")


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _submitit_tasks(root: int) -> list[int]:
    """Processes below ``root`` that run a submitted job (not submitit's local controllers)."""
    tasks, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in _children(pid):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"submitit.core._submit" in cmdline:
                tasks.append(child)
            todo.append(child)
    return tasks


# Slow (two jobs train side by side): its parts run by default elsewhere -- the SIGUSR2 handler
# chained to submitit's requeue (tests/unit/test_launch.py), the KILLED run with its signal
# (tests/unit/test_tracking_runs.py), save-exit-resume on a signal (test_resume.py), submitit
# tasks that train (tests/dist/test_submitit_world.py) and a sweep's MLflow runs (above).
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the job processes in /proc")
def test_submitit_local_sweep_saves_requeues_and_resumes_on_sigusr2(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    num_steps = 40
    driver = subprocess.Popen(
        sweep(
            tmp_path,
            "hydra/launcher=local",
            f"trainer.max_num_steps={num_steps}",
            "trainer.save_every_n_steps=1",
            "trainer.keep_last_n=2",
            "optimizer.lr=1e-3,3e-3",
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the driver, submitit's controllers and the jobs: one group
    )
    try:
        jobs = [tmp_path / "sweep" / str(n) for n in (0, 1)]
        deadline = time.monotonic() + 240
        while not all(list((job / "checkpoints").glob("step_*")) for job in jobs):
            assert driver.poll() is None, driver.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the jobs did not start training"
            time.sleep(0.2)
        tasks = _submitit_tasks(driver.pid)
        assert len(tasks) == 2, tasks
        for pid in tasks:  # what SLURM sends signal_delay_s before the time limit
            os.kill(pid, signal.SIGUSR2)
        output, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert driver.returncode == 0, output[-3000:]

    submitit_logs = "".join(
        p.read_text() for p in (tmp_path / "sweep" / ".submitit").rglob("*_log.*")
    )
    requeued = set(re.findall(r"Requeued job (\d+)", submitit_logs))
    assert len(requeued) == 2, submitit_logs[-3000:]
    assert [p for p in tmp_path.rglob("*") if "%" in p.name] == []  # no literal %j folder
    runs = runs_by_job(tmp_path)
    for n, job in enumerate(jobs):
        log = (job / "train.log").read_text()
        assert "stopped by SIGUSR2" in log and "resumed from" in log, log[-2000:]
        summary = json.loads((job / "summary.json").read_text())
        assert summary["step"] == num_steps
        assert Path(summary["checkpoint"]).name == f"step_{num_steps:08d}"
        # one MLflow run per job: marked KILLED by the signal, then continued by the requeued
        # job (RUNNING again) to the end; the stop stays on record
        (run,) = runs[str(n)]
        assert (run.info.status, run.data.tags["stopped_by"]) == ("FINISHED", "SIGUSR2")
        assert run.data.tags["override/optimizer.lr"] == ("0.001", "0.003")[n]


# Slow (a sweep stopped, then both jobs trained): its parts run by default in
# tests/unit/test_train_stop.py (the command printed) and tests/unit/test_sweep_report.py.
@pytest.mark.slow
def test_a_stopped_sweep_goes_on_with_the_command_it_prints(tmp_path: Path) -> None:
    """SIGTERM stops job 0 after a step and the sweep with it (job 1 never runs); the command
    the stop prints resumes job 0 and runs job 1 in the same sweep directory."""
    from eagleforge.sweep_report import read_jobs, rows

    args = sweep(tmp_path, "trainer.max_num_steps=8", "trainer.save_every_n_steps=1",
                 "trainer.eval_every_n_steps=0", "optimizer.lr=1e-3,3e-3")  # fmt: skip
    args.remove(f"hydra.sweep.dir={tmp_path / 'sweep'}")  # the default: a new dir per command
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        driver = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while not list(tmp_path.glob("multirun/*/0/checkpoints/step_*")):
                assert driver.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "job 0 did not start training"
                time.sleep(0.2)
            driver.send_signal(signal.SIGTERM)
            driver.wait(timeout=300)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    output = log.read_text()
    assert driver.returncode == 128 + signal.SIGTERM, output[-3000:]
    (said,) = [line for line in output.splitlines() if line.startswith("stopped by SIGTERM")]
    command = said.split("run: python -m eagleforge.train ", 1)[1]
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    assert command.endswith(f"hydra.sweep.dir={sweep_dir.resolve()}")
    states = [row["state"] for row in rows(read_jobs(sweep_dir))]
    assert states[0].startswith("stopped by SIGTERM at step ") and states[1] == "not run"

    resumed = subprocess.run(
        [sys.executable, "-m", "eagleforge.train", *shlex.split(command)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list((tmp_path / "multirun").iterdir()) == [sweep_dir]  # no new sweep directory
    assert "resumed from" in (sweep_dir / "0" / "train.log").read_text()
    table = rows(read_jobs(sweep_dir))
    assert [(r["settings"], r["state"], r["step"]) for r in table] == [
        ({"optimizer.lr": "0.001"}, "done", 8),
        ({"optimizer.lr": "0.003"}, "done", 8),
    ]
