"""Training jobs on a real SLURM cluster (this machine's, ``make slurm``): submitted through
hydra-submitit-launcher (``-m hydra/launcher=slurm_cpu``) and ``launchers/slurm.sbatch``,
requeued, time-limited, preempted and killed, each resumed run ending bitwise where an
uninterrupted run of the same config ends; and a 2-node job, one rank per node, ending bitwise
where ``torchrun --nproc-per-node 2`` ends (on this machine's netns nodes, or on a real cluster:
``-m "slurm and not local"``, see conftest.py).

The scenarios run side by side, as the cluster's two CPUs allow: the ``campaign`` fixture
starts every scenario the session selected at once (each in a thread that submits, triggers
the interruption at the right moment and waits) and each test checks its own. A requeued job
waits ``cred_expire`` (30 s) before it starts again; other jobs use the CPUs meanwhile. The
2-task FSDP jobs hold one CPU (``--overcommit``), so that a 1-task job runs beside them (with
``--ntasks-per-node=2`` they still start only on an idle node). Uninterrupted references are
shared, one per config, and run outside SLURM, where they take none of its two slots. The 2-node
job runs on the nodes of partition ``multi`` (slurmds in network namespaces; one CPU each),
beside the others.

    make slurm && make test          # or: pytest -m slurm tests/slurm
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from helpers.slurm import Cluster

pytestmark = pytest.mark.slurm
local = pytest.mark.local  # needs this machine's cluster: its partitions debug and urgent

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "launchers" / "slurm.sbatch"

# One process, a few seconds of training: the one-job run is the reference of the requeued
# and preempted ones.
SHAPE = (
    "+model=tiny", "data=chitchat", "data.max_num_samples=16", "data.num_eval_samples=2",
    "data.max_length=48", "draft.ttt_length=1", "trainer.progress_bar=false",
    "parallel.num_threads=1", "trainer.save_every_n_steps=1", "trainer.keep_last_n=2",
    "trainer.max_num_steps=60",
)  # fmt: skip
# The time limit's warning comes at slurmctld's next time-limit check (every 30 s, at a phase
# the test cannot see): this run must still train then, however fast the machine is that day.
# 700 steps lasted 27 s after step 10 on a quiet day and missed the check; 1,500 last ~60 s
# there, and the whole scenario (two starts, the requeue) took 150 s of its STEP_TIMEOUT_S.
LONG_SHAPE = (*SHAPE[:-3], "trainer.save_every_n_steps=100", "trainer.max_num_steps=1500")
# Two gloo ranks, the draft sharded by FSDP2.
FSDP_SHAPE = (
    *SHAPE[:-1], "trainer.max_num_steps=30", "parallel=fsdp", "parallel.device=cpu",
    "data.max_tokens_per_batch=128", "optimizer.lr=1e-3", "optimizer.eps=1e-4",
)  # fmt: skip
# slurm_cpu with a 10-minute limit whose SIGUSR2 comes 60 s before it (never, in these runs)
LAUNCHER = (
    "hydra/launcher=slurm_cpu", "hydra.launcher.timeout_min=10",
    "hydra.launcher.signal_delay_s=60",
)  # fmt: skip
# Two tasks of one job on one allocated CPU.
TWO_TASKS = ("hydra.launcher.tasks_per_node=2", "+hydra.launcher.additional_parameters.overcommit=true")  # fmt: skip
STEP_TIMEOUT_S = 420  # any wait of a scenario, from its start or its first job's
# How long a scenario's first job may queue for one of the cluster's slots: the scenarios'
# jobs outnumber them, and on a slow day (the other worker's engines on the same two cores)
# the last ones start minutes after the first.
QUEUE_TIMEOUT_S = 600


# ---------------------------------------------------------------- the cluster, asked


def slurm(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed: {done.stderr.strip()}")
    return done.stdout


def job_state(job: str) -> str:
    """squeue's state of a job (it lists ended ones for MinJobAge, 300 s)."""
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "-j", job, "-o", "%T"],
        capture_output=True, text=True, timeout=60, check=False,
    ).stdout.split()  # fmt: skip
    return out[0] if out else "GONE"


def running_jobs(partition: str) -> list[str]:
    return slurm("squeue", "-h", "-t", "RUNNING", "-p", partition, "-o", "%i").split()


def job_field(job: str, name: str) -> str:
    found = re.search(rf"\b{name}=(\S+)", slurm("scontrol", "show", "job", job))
    assert found, f"scontrol show job {job} has no {name}"
    return found[1]


# Every sbatch here sets --mem: without it a job asks for all of the node's memory
# (MinMemoryNode=0) and waits for an empty node.
def sbatch(*args: str) -> str:
    return slurm("sbatch", "--parsable", *args).strip().split(";")[0]


# ---------------------------------------------------------------- what a run left


def wait_for(what: str, ready: Callable[[], Any], deadline: float, every_s: float = 0.5) -> Any:
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(every_s)


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*"))


def submitit_jobs(sweep_dir: Path) -> list[str]:
    """The SLURM job ids of a submitit sweep: its .submitit folders (an array's jobs, without
    the folder of the array's submission)."""
    folder = sweep_dir / ".submitit"
    names = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    return [n for n in names if not any(m.startswith(f"{n}_") for m in names)]


def final_state(run_dir: Path) -> dict[str, Any]:
    """The last checkpoint's tensors: the draft's and the optimizer state's."""
    import torch
    from safetensors.torch import load_file

    summary = json.loads((run_dir / "summary.json").read_text())
    checkpoint = Path(summary["checkpoint"])
    state = torch.load(checkpoint / "training_state.pt", weights_only=True)
    tensors = {f"model/{k}": v for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    for param, moments in state["optimizer"]["state"].items():
        tensors |= {f"optimizer/{param}/{k}": v for k, v in moments.items()}
    return tensors


def assert_bitwise_equal(run_dir: Path, reference_dir: Path) -> None:
    import torch

    got, want = final_state(run_dir), final_state(reference_dir)
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert different == [], f"{run_dir} differs from {reference_dir} in {different[:5]}"


def mlflow_runs(output_root: Path) -> list[Any]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{output_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("eagleforge")
    assert experiment is not None, f"no MLflow experiment in {output_root}"
    return client.search_runs([experiment.experiment_id])


def sole_finished_run(output_root: Path) -> Any:
    runs = mlflow_runs(output_root)
    assert [r.info.status for r in runs] == ["FINISHED"], [r.info.status for r in runs]
    return runs[0]


# ---------------------------------------------------------------- the scenarios


@dataclass
class Scenario:
    """One scenario's directory, its processes and jobs, and what it found."""

    name: str
    root: Path
    cluster: Cluster
    jobs: list[str] = field(default_factory=list)
    drivers: list[subprocess.Popen[str]] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0
    deadline: float = 0.0

    def under_way(self) -> bool:
        """Its jobs are submitted (or it ended without)."""
        return bool(self.jobs) or self.done.is_set()

    def driver(self, *overrides: str) -> subprocess.Popen[str]:
        """``python -m eagleforge.train -m`` of this scenario, its output in driver.log."""
        args = [sys.executable, "-m", "eagleforge.train", "-m", *overrides,
                f"output_root={self.root}", f"hydra.sweep.dir={self.root / 'sweep'}"]  # fmt: skip
        log = open(self.root / "driver.log", "w")  # noqa: SIM115 (the process writes it)
        process = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)  # fmt: skip
        self.drivers.append(process)
        return process

    def submitted(self, count: int = 1) -> list[str]:
        """The job ids of this scenario's submitit sweep, once sbatch gave them."""
        jobs = wait_for(
            f"{self.name}'s job to be submitted",
            lambda: (
                len(submitit_jobs(self.root / "sweep")) >= count
                and submitit_jobs(self.root / "sweep")
            ),
            self.deadline,
        )
        self.jobs = jobs
        self.wait_start()
        return jobs

    def wait_start(self) -> None:
        """Waits for the first of its jobs to leave the queue; its waits count from then."""
        wait_for(
            f"{self.name}'s job to start",
            lambda: any(job_state(job) != "PENDING" for job in self.jobs),
            time.monotonic() + QUEUE_TIMEOUT_S,
            every_s=1,
        )
        self.deadline = time.monotonic() + STEP_TIMEOUT_S

    def finish(self, process: subprocess.Popen[str]) -> int:
        rc = process.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        self.facts["output"] = (self.root / "driver.log").read_text()
        return rc

    def wait_job(self, job: str) -> str:
        """Waits for a plain sbatch job to end; its final state."""
        return wait_for(
            f"job {job} of {self.name} to end",
            lambda: (
                (s := job_state(job)) not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED") and s
            ),
            self.deadline,
            every_s=2,
        )


def run_dir(s: Scenario) -> Path:
    return s.root / "sweep" / "0"


def one_job(s: Scenario) -> None:
    """A single run through submitit: one SLURM job, not an array."""
    process = s.driver(*LAUNCHER, *SHAPE)
    s.submitted()
    s.facts["rc"] = s.finish(process)


def sweep(s: Scenario) -> None:
    """Two learning rates: one job array of two jobs."""
    shape = (*SHAPE[:-1], "trainer.max_num_steps=4", "trainer.save_every_n_steps=0")
    process = s.driver(*LAUNCHER, *shape, "optimizer.lr=1e-3,3e-3")
    s.submitted(2)
    s.facts["rc"] = s.finish(process)


def requeued(s: Scenario) -> None:
    """``scontrol requeue`` while it trains: SIGTERM, save, requeue, resume."""
    process = s.driver(*LAUNCHER, *SHAPE)
    (job,) = s.submitted()
    wait_for("a checkpoint", lambda: checkpoint_steps(run_dir(s))[-1:] >= [3], s.deadline)
    slurm("scontrol", "requeue", job)
    s.facts["rc"] = s.finish(process)


def time_limit(s: Scenario) -> None:
    """The job's time limit brought near while it trains (scontrol update TimeLimit): SLURM
    sends its warning, SIGUSR2 (signal_delay_s before the limit, at its next time-limit check,
    every 30 s); the run saves and submitit requeues it. The limit is put back for the requeued
    job."""
    # timeout_min <= 10: submitit takes every SIGUSR2 for a timeout
    process = s.driver(*LAUNCHER, "hydra.launcher.signal_delay_s=90", *LONG_SHAPE)
    (job,) = s.submitted()
    log = run_dir(s) / "train.log"
    wait_for("training", lambda: log.is_file() and " step 10 train/" in log.read_text(), s.deadline)
    start = time.mktime(time.strptime(job_field(job, "StartTime"), "%Y-%m-%dT%H:%M:%S"))
    elapsed = time.time() - start
    # a limit 40 to 100 s away: inside the 90 s (+ up to 30 s) warning at the next check, and
    # not yet reached there
    minutes = math.ceil((elapsed + 40) / 60)
    slurm("scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")
    s.facts["limit_set_after_s"] = round(elapsed)
    wait_for("the warning", lambda: "stopped by SIGUSR2" in log.read_text(), s.deadline)
    slurm("scontrol", "update", f"JobId={job}", "TimeLimit=10")
    s.facts["rc"] = s.finish(process)


def local_run(s: Scenario, *command: str) -> None:
    """A reference run on this machine, outside SLURM: it takes none of the cluster's two
    slots, and runs the same code, ranks and threads as the jobs it is compared with."""
    args = [*command, f"output_root={s.root}", f"hydra.run.dir={s.root / 'run'}"]
    with open(s.root / "run.log", "w") as log:
        process = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)  # fmt: skip
        s.drivers.append(process)
        s.facts["rc"] = process.wait(timeout=STEP_TIMEOUT_S)


def time_limit_reference(s: Scenario) -> None:
    """The time-limited run's config, uninterrupted."""
    local_run(s, sys.executable, "-m", "eagleforge.train", *LONG_SHAPE)


def preempted(s: Scenario) -> None:
    """A job of partition urgent takes the CPU of this one (debug): SLURM sends its
    --signal, SIGUSR2, at once (GraceTime); the run saves and submitit requeues it. SLURM
    preempts the running debug job first listed, the oldest: this scenario submits first."""
    # timeout_min=15: a SIGUSR2 in the first 5 minutes is a preemption to submitit
    process = s.driver(*LAUNCHER, "hydra.launcher.timeout_min=15", *SHAPE)
    (job,) = s.submitted()
    wait_for("a checkpoint", lambda: checkpoint_steps(run_dir(s))[-1:] >= [3], s.deadline)
    # the node full: the urgent job cannot start without taking a debug job's CPU
    wait_for("a full node", lambda: len(running_jobs("debug")) >= 2, s.deadline, every_s=0.2)
    urgent = sbatch(
        "-p", "urgent", "-c", "1", "--mem=1G", f"--output={s.root / 'urgent.log'}", "--wrap=sleep 1"
    )
    s.facts["urgent"] = urgent
    s.facts["rc"] = s.finish(process)
    s.facts["urgent_state"] = s.wait_job(urgent)


def fsdp_submitit(s: Scenario) -> None:
    """Two tasks of one submitit job train one FSDP2 draft (gloo); requeued while training."""
    process = s.driver(*LAUNCHER, *TWO_TASKS, *FSDP_SHAPE)
    (job,) = s.submitted()
    wait_for("a checkpoint", lambda: checkpoint_steps(run_dir(s))[-1:] >= [3], s.deadline)
    slurm("scontrol", "requeue", job)
    s.facts["rc"] = s.finish(process)


def sbatch_script(s: Scenario, *placement: str) -> str:
    """launchers/slurm.sbatch training FSDP_SHAPE into s.root/run, its tasks placed by
    ``placement`` (sbatch's options)."""
    env = os.environ | {"RUN_DIR": str(s.root / "run"), "PYTHON": sys.executable}
    done = subprocess.run(
        ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", *placement,
         "--time=10", f"--output={s.root / 'job-%j.log'}", str(SBATCH_SCRIPT),
         *FSDP_SHAPE, f"output_root={s.root}"],
        cwd=s.root, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    job = done.stdout.strip().split(";")[0]
    s.jobs = [job]
    s.wait_start()
    return job


def fsdp_sbatch(s: Scenario) -> None:
    """launchers/slurm.sbatch, two tasks; SIGUSR1 (what its --signal sends before the time
    limit) while training: the tasks save and exit 138, the script requeues the job."""
    job = sbatch_script(s, "--ntasks-per-node=2", "--overcommit", "--mem=4G")
    wait_for("a checkpoint", lambda: checkpoint_steps(s.root / "run")[-1:] >= [3], s.deadline)
    slurm("scancel", "--signal=USR1", job)
    s.facts["state"] = s.wait_job(job)
    s.facts["restarts"] = int(job_field(job, "Restarts"))
    s.facts["log"] = (s.root / f"job-{job}.log").read_text()


def two_nodes(s: Scenario) -> None:
    """launchers/slurm.sbatch on two nodes, one task each, uninterrupted: rank 1 reaches rank 0
    (MASTER_ADDR, the first node's name) across the nodes' network, not on one machine."""
    partition = s.cluster.multi_node_partition
    job = sbatch_script(
        s, f"--partition={partition}", "--nodes=2", "--ntasks-per-node=1", "--mem=2G"
    )
    s.facts["state"] = s.wait_job(job)
    s.facts["job"] = slurm("scontrol", "show", "job", job)
    s.facts["log"] = (s.root / f"job-{job}.log").read_text()


def fsdp_reference(s: Scenario) -> None:
    """The FSDP config, uninterrupted: two gloo ranks under torchrun."""
    torchrun = Path(sys.executable).parent / "torchrun"
    local_run(s, str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "eagleforge.train",
              *FSDP_SHAPE)  # fmt: skip


def task_pids(job: str) -> list[int]:
    """The processes that run the job's submitit task (found through /proc)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            python = (environ.parent / "comm").read_text().startswith("python")  # not srun
            cmdline = (environ.parent / "cmdline").read_bytes()
            mine = f"SLURM_JOB_ID={job}\0".encode() in environ.read_bytes()
        except OSError:  # ended while we looked
            continue
        if python and mine and b"submitit.core._submit" in cmdline:
            found.append(int(environ.parent.name))
    return found


def sigkill(s: Scenario) -> None:
    """The job's process killed by SIGKILL (as the out-of-memory killer does): no result file.
    The command must not wait for ever: it ends with one line naming the job and its log."""
    process = s.driver(*LAUNCHER, *SHAPE)
    (job,) = s.submitted()
    pids = wait_for("the job's process", lambda: task_pids(job), s.deadline, every_s=0.2)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    s.facts["rc"] = s.finish(process)
    s.facts["ended_after_s"] = time.monotonic() - killed


# Submission order is priority order: the preempted scenario first (SLURM preempts the oldest
# running job), then the 2-task jobs (which start only on an idle node: early, while the 1-task
# jobs behind them may still be backfilled) and the longest. The references run outside SLURM.
SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "preempted": preempted,
    "time_limit_reference": time_limit_reference,
    "fsdp_reference": fsdp_reference,
    "fsdp_sbatch": fsdp_sbatch,
    "two_nodes": two_nodes,
    "fsdp_submitit": fsdp_submitit,
    "time_limit": time_limit,
    "requeued": requeued,
    "one_job": one_job,
    "sweep": sweep,
    "sigkill": sigkill,
}
# What each test needs.
NEEDS = {
    "test_one_job_trains_checkpoints_and_finishes_its_mlflow_run": ("one_job",),
    "test_a_sweep_is_one_job_array_reported_by_sweep_report": ("sweep",),
    "test_scontrol_requeue_saves_and_resumes_bitwise": ("requeued", "one_job"),
    "test_the_time_limit_warning_saves_requeues_and_resumes_bitwise": (
        "time_limit",
        "time_limit_reference",
    ),  # fmt: skip
    "test_preemption_by_the_urgent_partition_saves_requeues_and_resumes_bitwise": (
        "preempted",
        "one_job",
    ),  # fmt: skip
    "test_fsdp_job_of_two_tasks_requeued_resumes_bitwise": ("fsdp_submitit", "fsdp_reference"),
    "test_sbatch_script_requeues_itself_and_resumes_bitwise": ("fsdp_sbatch", "fsdp_reference"),
    "test_a_job_killed_without_result_ends_the_command_in_one_line": ("sigkill",),
    "test_two_nodes_one_rank_each_train_fsdp_bitwise_as_torchrun": ("two_nodes", "fsdp_reference"),
}


class Campaign:
    """The selected scenarios, started at once; ``outcome`` waits for one."""

    def __init__(self, root: Path, names: list[str], cluster: Cluster) -> None:
        self.started = time.monotonic()
        if cluster.multi_node_partition is None:  # its test skips
            names = [n for n in names if n != "two_nodes"]
        self.scenarios = {n: Scenario(n, root / n, cluster) for n in SCENARIOS if n in names}
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, scenario in self.scenarios.items():
            scenario.root.mkdir(parents=True)
            scenario.started_at = time.monotonic()
            scenario.deadline = scenario.started_at + STEP_TIMEOUT_S
            thread = threading.Thread(target=self._run, args=(scenario,), daemon=True)
            thread.start()
            self.threads.append(thread)
            if name == "preempted":  # its job first: the oldest, which urgent preempts
                with contextlib.suppress(TimeoutError):
                    wait_for("the first job", scenario.under_way, scenario.deadline)

    @staticmethod
    def _run(scenario: Scenario) -> None:
        try:
            SCENARIOS[scenario.name](scenario)
        except BaseException as e:  # handed to the test that asks
            scenario.error = e
        finally:
            scenario.facts["wall_s"] = round(time.monotonic() - scenario.started_at)
            scenario.done.set()

    def outcome(self, name: str) -> Scenario:
        scenario = self.scenarios[name]
        scenario.done.wait(timeout=QUEUE_TIMEOUT_S + 2 * STEP_TIMEOUT_S)
        if scenario.error is not None:
            output = scenario.root / "driver.log"
            said = output.read_text()[-3000:] if output.is_file() else ""
            raise AssertionError(f"scenario {name} failed: {scenario.error!r}\n{said}")
        assert scenario.done.is_set(), f"scenario {name} did not end"
        return scenario

    def stop(self) -> None:
        """Whatever is left: drivers killed, jobs cancelled."""
        for scenario in self.scenarios.values():
            for process in scenario.drivers:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            jobs = [j for j in scenario.jobs if job_state(j) in ("PENDING", "RUNNING")]
            if jobs:
                subprocess.run(["scancel", *jobs], timeout=60, check=False)
        walls = {n: s.facts.get("wall_s") for n, s in self.scenarios.items()}
        total = round(time.monotonic() - self.started)
        print(f"\nslurm tier: {total} s in all; per scenario (s): {walls}")


@pytest.fixture(scope="module")
def campaign(
    request: pytest.FixtureRequest,
    slurm_cluster: Cluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Campaign]:
    selected = {
        n
        for item in request.session.items
        if item.module is request.module and not item.get_closest_marker("skip")
        for n in NEEDS.get(getattr(item, "originalname", item.name), ())
    }
    campaign = Campaign(tmp_path_factory.mktemp("slurm"), sorted(selected), slurm_cluster)
    try:
        campaign.start()
        yield campaign
    finally:
        campaign.stop()


# ---------------------------------------------------------------- the tests


@local
def test_one_job_trains_checkpoints_and_finishes_its_mlflow_run(campaign: Campaign) -> None:
    s = campaign.outcome("one_job")
    assert s.facts["rc"] == 0, s.facts["output"][-3000:]
    (job,) = s.jobs
    assert "_" not in job  # one job, not an array
    summary = json.loads((run_dir(s) / "summary.json").read_text())
    assert (summary["step"], summary["stopped_by"]) == (60, None)
    assert checkpoint_steps(run_dir(s)) == [59, 60]
    run = sole_finished_run(s.root)
    assert "stopped_by" not in run.data.tags and "train/loss" in run.data.metrics


@local
def test_a_sweep_is_one_job_array_reported_by_sweep_report(campaign: Campaign) -> None:
    from eagleforge.sweep_report import read_jobs, rows

    s = campaign.outcome("sweep")
    assert s.facts["rc"] == 0, s.facts["output"][-3000:]
    array = {job.split("_")[0] for job in s.jobs}
    assert len(array) == 1 and sorted(j.split("_")[1] for j in s.jobs) == ["0", "1"], s.jobs
    table = rows(read_jobs(s.root / "sweep"))
    assert [(r["settings"], r["state"], r["step"]) for r in table] == [
        ({"optimizer.lr": "0.001"}, "done", 4),
        ({"optimizer.lr": "0.003"}, "done", 4),
    ]
    report = subprocess.run(
        [sys.executable, "-m", "eagleforge.sweep_report", str(s.root / "sweep")],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert report.count("| done") == 2, report
    runs = mlflow_runs(s.root)
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]


def assert_stopped_and_resumed(s: Scenario, signal_name: str, directory: Path) -> None:
    log = (directory / "train.log").read_text()
    assert log.count("resumed from") == 1, log[-3000:]
    assert f"stopped by {signal_name}" in log and "resumed from" in log, log[-3000:]
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["step"] == summary["max_num_steps"] and summary["stopped_by"] is None
    # one MLflow run per training run: stopped (KILLED), continued by the requeued job
    run = sole_finished_run(s.root)
    assert run.data.tags["stopped_by"] == signal_name


def submitit_log(s: Scenario) -> str:
    return "".join(p.read_text() for p in (s.root / "sweep" / ".submitit").rglob("*_log.out"))


@local
def test_scontrol_requeue_saves_and_resumes_bitwise(campaign: Campaign) -> None:
    s, reference = campaign.outcome("requeued"), campaign.outcome("one_job")
    assert s.facts["rc"] == 0, s.facts["output"][-3000:]
    assert_stopped_and_resumed(s, "SIGTERM", run_dir(s))
    assert_bitwise_equal(run_dir(s), run_dir(reference))


@local
def test_the_time_limit_warning_saves_requeues_and_resumes_bitwise(campaign: Campaign) -> None:
    s, reference = campaign.outcome("time_limit"), campaign.outcome("time_limit_reference")
    assert s.facts["rc"] == 0, s.facts["output"][-3000:]
    assert reference.facts["rc"] == 0, (reference.root / "run.log").read_text()[-3000:]
    assert_stopped_and_resumed(s, "SIGUSR2", run_dir(s))
    assert "timed-out" in submitit_log(s) and "Requeued job" in submitit_log(s)
    assert_bitwise_equal(run_dir(s), reference.root / "run")


@local
def test_preemption_by_the_urgent_partition_saves_requeues_and_resumes_bitwise(
    campaign: Campaign,
) -> None:
    s, reference = campaign.outcome("preempted"), campaign.outcome("one_job")
    assert s.facts["rc"] == 0, s.facts["output"][-3000:]
    assert s.facts["urgent_state"] == "COMPLETED"
    assert_stopped_and_resumed(s, "SIGUSR2", run_dir(s))
    assert "this job is preempted" in submitit_log(s), submitit_log(s)[-3000:]
    assert_bitwise_equal(run_dir(s), run_dir(reference))


@local
def test_fsdp_job_of_two_tasks_requeued_resumes_bitwise(campaign: Campaign) -> None:
    s, reference = campaign.outcome("fsdp_submitit"), campaign.outcome("fsdp_reference")
    assert s.facts["rc"] == 0, s.facts["output"][-3000:]
    assert reference.facts["rc"] == 0, (reference.root / "run.log").read_text()[-3000:]
    assert_stopped_and_resumed(s, "SIGTERM", run_dir(s))
    assert_bitwise_equal(run_dir(s), reference.root / "run")


@local
def test_sbatch_script_requeues_itself_and_resumes_bitwise(campaign: Campaign) -> None:
    s, reference = campaign.outcome("fsdp_sbatch"), campaign.outcome("fsdp_reference")
    assert s.facts["state"] == "COMPLETED", s.facts["log"][-3000:]
    assert s.facts["restarts"] == 1
    # the script's run writes its Hydra log elsewhere: the job's log has the same lines
    log = s.facts["log"]
    assert "stopped by SIGUSR1" in log and "resumed from" in log, log[-3000:]
    assert json.loads((s.root / "run" / "summary.json").read_text())["step"] == 30
    assert sole_finished_run(s.root).data.tags["stopped_by"] == "SIGUSR1"
    assert_bitwise_equal(s.root / "run", reference.root / "run")


@local
def test_a_job_killed_without_result_ends_the_command_in_one_line(campaign: Campaign) -> None:
    s = campaign.outcome("sigkill")
    (job,) = s.jobs
    assert s.facts["rc"] == 1, s.facts["output"][-3000:]
    last = s.facts["output"].rstrip().splitlines()[-1]
    log = s.root / "sweep" / ".submitit" / job / f"{job}_0_log.out"
    assert last.startswith(f"error: SLURM job {job} ended without a result ("), last
    assert last.endswith(f"its log: {log}") and log.is_file(), last
    assert s.facts["ended_after_s"] < 120  # squeue's answer within a minute, then 15 s


def test_two_nodes_one_rank_each_train_fsdp_bitwise_as_torchrun(
    campaign: Campaign, slurm_cluster: Cluster
) -> None:
    if slurm_cluster.multi_node_partition is None:
        pytest.skip(slurm_cluster.why_not_multi_node)
    s, reference = campaign.outcome("two_nodes"), campaign.outcome("fsdp_reference")
    assert s.facts["state"] == "COMPLETED", s.facts["log"][-3000:]
    assert reference.facts["rc"] == 0, (reference.root / "run.log").read_text()[-3000:]
    job = s.facts["job"]
    assert re.search(r"\bNumNodes=2 NumCPUs=\d+ NumTasks=2\b", job), job
    assert json.loads((s.root / "run" / "summary.json").read_text())["step"] == 30
    assert_bitwise_equal(s.root / "run", reference.root / "run")
