"""eagleforge/parallel/slurm.py and squeue.py: a SLURM request the cluster cannot hold stops
the command before sbatch, in one line naming the hydra.launcher field; on a cluster without
accounting, submitit follows its jobs through squeue. The cluster is a stand-in here
(`make slurm` starts a real one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from eagleforge.config import conf_dir, register_configs
from eagleforge.parallel import slurm
from eagleforge.parallel.slurm import Cluster, Node, SlurmPreflight, parse_sinfo, request_problem

pytestmark = pytest.mark.unit

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

# sinfo --noheader --Node --format=%P|%N|%c|%m|%G on make slurm's cluster
MAKE_SLURM = "debug*|vm|2|24105|(null)\nurgent|vm|2|24105|(null)\n"


@pytest.fixture(autouse=True)
def _no_hydra_config_left() -> Iterator[None]:
    yield
    HydraConfig.instance().cfg = None  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def _submitit_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """The preflight replaces submitit's watcher and wraps SlurmJob.results in this process:
    both restored after each test."""
    from submitit.slurm.slurm import SlurmJob

    monkeypatch.setattr(SlurmJob, "watcher", SlurmJob.watcher)
    monkeypatch.setattr(SlurmJob, "results", SlurmJob.results)


def sweep_config(launcher: str, *overrides: str) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["+model=tiny", "data=chitchat", f"hydra/launcher={launcher}", *overrides],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    return cfg


def cpu_cluster(accounting: bool = False) -> Cluster:
    partitions, default = parse_sinfo(MAKE_SLURM)
    return Cluster(partitions, default, accounting)


def test_sinfo_is_read_per_partition_with_its_default_and_gpus() -> None:
    partitions, default = parse_sinfo(MAKE_SLURM + "gpu|g1|64|512000|gpu:h100:8(S:0-1)\n")
    assert default == "debug"
    assert partitions["debug"] == [Node("vm", 2, 24105, 0)]
    assert partitions["gpu"] == [Node("g1", 64, 512000, 8)]
    assert slurm.count_gpus("gpu:4,nic:1") == 4 and slurm.count_gpus("(null)") == 0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ((), "hydra.launcher.gpus_per_node=8 asks for 8 GPUs per node"),
        (("hydra.launcher.gres=gpu:2", "hydra.launcher.gpus_per_node=0"), "hydra.launcher.gres="),
        (("hydra.launcher.gpus_per_node=0",), "hydra.launcher.tasks_per_node=0 starts no"),
        (
            ("hydra.launcher.gpus_per_node=0", "hydra.launcher.tasks_per_node=1"),
            "hydra.launcher.tasks_per_node=1 x hydra.launcher.cpus_per_task=8 asks for 8 CPUs",
        ),
        (("hydra.launcher.partition=gpu",), "hydra.launcher.partition=gpu: this cluster has no"),
    ],
)
def test_the_gpu_shape_on_a_cpu_cluster_names_the_field(
    overrides: tuple[str, ...], field: str
) -> None:
    launcher = sweep_config("slurm", *overrides).hydra.launcher
    problem = request_problem(launcher, cpu_cluster())
    assert problem is not None and problem.startswith(field), problem
    assert "\n" not in problem


def test_the_cpu_shape_fits_and_too_much_of_it_does_not() -> None:
    assert request_problem(sweep_config("slurm_cpu").hydra.launcher, cpu_cluster()) is None
    urgent = sweep_config("slurm_cpu", "hydra.launcher.partition=urgent").hydra.launcher
    assert request_problem(urgent, cpu_cluster()) is None
    for override, start in (
        ("hydra.launcher.mem_gb=64", "hydra.launcher.mem_gb=64 asks for 64 GB per node"),
        ("hydra.launcher.cpus_per_task=4", "hydra.launcher.tasks_per_node=1 x "),
        ("hydra.launcher.nodes=2", "hydra.launcher.nodes=2 asks for 2 nodes"),
    ):
        launcher = sweep_config("slurm_cpu", override).hydra.launcher
        problem = request_problem(launcher, cpu_cluster())
        assert problem is not None and problem.startswith(start), problem


def test_preflight_stops_the_sweep_before_sbatch_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(slurm, "read_cluster", cpu_cluster)
    with pytest.raises(SystemExit) as stopped:
        SlurmPreflight().on_multirun_start(sweep_config("slurm"))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hydra.launcher.gpus_per_node=8 ") and err.count("\n") == 1


def test_preflight_leaves_other_launchers_and_unreachable_clusters_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[Any] = []
    monkeypatch.setattr(slurm, "read_cluster", lambda: asked.append(1))
    SlurmPreflight().on_multirun_start(sweep_config("local"))
    assert asked == []
    SlurmPreflight().on_multirun_start(sweep_config("slurm"))  # read_cluster: None
    assert asked == [1]


def test_without_accounting_submitit_follows_jobs_through_squeue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from submitit.slurm.slurm import SlurmJob

    from eagleforge.parallel.squeue import SqueueWatcher

    monkeypatch.setattr(slurm, "read_cluster", lambda: cpu_cluster(accounting=True))
    SlurmPreflight().on_multirun_start(sweep_config("slurm_cpu"))
    assert not isinstance(SlurmJob.watcher, SqueueWatcher)
    monkeypatch.setattr(slurm, "read_cluster", lambda: cpu_cluster(accounting=False))
    SlurmPreflight().on_multirun_start(sweep_config("slurm_cpu"))
    watcher = SlurmJob.watcher
    assert isinstance(watcher, SqueueWatcher)

    watcher.register_job("12")
    watcher.register_job("13_0")
    command = watcher._make_command()
    # all of the user's jobs: `squeue --jobs=` fails when none of its ids exists any more
    assert command is not None and command[0] == "squeue" and "--states=all" in command
    info = watcher.read_info(b"12|CONFIGURING|vm\n13_0|CANCELLED|vm\n13_[1-2]|PENDING|\n")
    assert info["12"]["State"] == "RUNNING"  # not over, though submitit does not know the name
    assert info["13_0"]["State"] == "CANCELLED"
    assert info["13_2"]["State"] == "PENDING"


def test_a_job_squeue_has_forgotten_has_ended(tmp_path: Path) -> None:
    """squeue lists a job until MinJobAge after its end: a job this process waits for that it
    no longer lists has ended, where submitit would keep the last state it read forever."""
    from eagleforge.parallel.squeue import VANISHED, SqueueWatcher

    watcher = SqueueWatcher()
    for job in ("12", "13_0", "13_1"):
        watcher.register_job(job)
    watcher._make_command()
    info = watcher.read_info("13_1|RUNNING|vm\n99|RUNNING|vm\n")
    assert info["12"]["State"] == info["13_0"]["State"] == VANISHED
    assert info["13_1"]["State"] == "RUNNING"
    watcher._info_dict.update(info)
    assert watcher.is_done("12", mode="cache") and not watcher.is_done("13_1", mode="cache")


def test_a_job_without_result_ends_the_command_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job killed by SIGKILL writes no result: submitit raises UncompletedJobError with the
    log's tail, which Hydra would print with a traceback; the command ends in one line."""
    from submitit.core.utils import UncompletedJobError
    from submitit.slurm.slurm import SlurmJob

    from eagleforge.parallel.squeue import SqueueWatcher, report_jobs_without_result

    def no_result(self: SlurmJob) -> list[Any]:
        raise UncompletedJobError("Job 17 (task: 0) has not produced any output\n" + "log\n" * 40)

    watcher = SqueueWatcher()
    monkeypatch.setattr(SlurmJob, "watcher", watcher)
    monkeypatch.setattr(SlurmJob, "results", no_result)
    report_jobs_without_result()
    report_jobs_without_result()  # once is enough: not wrapped twice
    job: SlurmJob = SlurmJob(folder=tmp_path / "%j", job_id="17")
    watcher._info_dict["17"] = {"State": "FAILED"}
    with pytest.raises(SystemExit) as ended:
        job.results()
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: SLURM job 17 ended without a result (state FAILED): ")
    assert err.rstrip().endswith(f"its log: {tmp_path / '17' / '17_0_log.out'}")
