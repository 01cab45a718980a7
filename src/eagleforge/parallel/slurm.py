"""Before a sweep goes to SLURM (``-m hydra/launcher=slurm`` or ``slurm_cpu``): whether the
cluster can run what it asks for, and how the command that waits for the jobs follows them.

    python -m eagleforge.train -m hydra/launcher=slurm_cpu +model=tiny data=chitchat

``SlurmPreflight`` is the Hydra callback (``hydra.callbacks.slurm_preflight`` in
``conf/config.yaml``) that runs before hydra-submitit-launcher writes any sbatch script:

- It compares the request (``hydra.launcher.partition``, ``nodes``, ``gpus_per_node`` or
  ``gres``, ``tasks_per_node`` x ``cpus_per_task``, ``mem_gb``) with the partition's nodes as
  ``sinfo`` reports them. A request no node can hold ends the command in one line naming the
  field, where sbatch would answer ``Invalid generic resource (gres) specification`` or
  ``Requested node configuration is not available``. Where ``sinfo`` does not answer (no
  cluster reachable from here) nothing is checked and sbatch has the last word.
- On a cluster that keeps no accounting (``AccountingStorageType=accounting_storage/none``,
  as ``make slurm``'s), every ``sacct`` call submitit makes to follow its jobs fails and
  prints "Slurm accounting storage is disabled"; job states are read from ``squeue`` there
  instead (``eagleforge.parallel.squeue``), which also sees a job that squeue has forgotten.
- A job that ends without a result (killed, cancelled, out of memory) ends the command in one
  line naming the job and its log, instead of submitit's error and a traceback.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hydra.experimental.callback import Callback

# hydra.launcher._target_ of hydra/launcher=slurm and of the files built on it
SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"

# The GPUs in a gres string: gpu:8, gpu:h100:4(S:0-1), nic:1,gpu:2
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


@dataclass(frozen=True)
class Node:
    """One node of a partition, as sinfo reports it."""

    name: str
    cpus: int
    memory_mb: int
    gpus: int


@dataclass(frozen=True)
class Cluster:
    """What a request is checked against: each partition's nodes, the default partition (None
    where there is none) and whether sacct has anything to read."""

    partitions: Mapping[str, list[Node]]
    default_partition: str | None
    accounting: bool


def count_gpus(gres: str) -> int:
    """GPUs in sinfo's gres column (``(null)`` on nodes without any)."""
    return sum(int(n) for n in _GPU_GRES.findall(gres))


def _slurm_output(*command: str) -> str | None:
    """What a SLURM client command prints; None where it is missing or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def parse_sinfo(text: str) -> tuple[dict[str, list[Node]], str | None]:
    """``sinfo --noheader --Node --format=%P|%N|%c|%m|%G`` (one line per node and partition;
    the default partition's name ends in ``*``) as partitions and the default one."""
    partitions: dict[str, list[Node]] = {}
    default = None
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        partition, name, cpus, memory, gres = fields
        if partition.endswith("*"):
            partition = default = partition[:-1]
        partitions.setdefault(partition, []).append(
            Node(name, int(cpus.rstrip("+")), int(memory.rstrip("+")), count_gpus(gres))
        )
    return partitions, default


def read_cluster() -> Cluster | None:
    """The cluster SLURM's commands reach from here (SLURM_CONF, or /etc/slurm); None where
    none answers."""
    text = _slurm_output("sinfo", "--noheader", "--Node", "--format=%P|%N|%c|%m|%G")
    if text is None:
        return None
    partitions, default = parse_sinfo(text)
    if not partitions:
        return None
    config = _slurm_output("scontrol", "show", "config") or ""
    storage = re.search(r"^AccountingStorageType\s*=\s*(\S+)", config, re.MULTILINE)
    accounting = storage is None or storage.group(1) != "accounting_storage/none"
    return Cluster(partitions, default, accounting)


def request_problem(launcher: Any, cluster: Cluster) -> str | None:
    """Why no node of the partition can run one task set of ``launcher`` (the
    ``hydra.launcher`` section), as one sentence naming the field; None where one can."""
    partition = launcher.get("partition") or cluster.default_partition
    if partition is None:
        return None  # no default partition: sbatch says so
    if partition not in cluster.partitions:
        names = ", ".join(sorted(cluster.partitions))
        return (
            f"hydra.launcher.partition={partition}: this cluster has no such partition; "
            f"set it to one of {names}."
        )
    nodes = cluster.partitions[partition]
    where = f"the nodes of partition {partition}"
    gres = launcher.get("gres")
    gpus_field = "hydra.launcher.gres" if gres else "hydra.launcher.gpus_per_node"
    gpus = count_gpus(str(gres)) if gres else int(launcher.get("gpus_per_node") or 0)
    tasks = launcher.get("tasks_per_node")
    tasks = 1 if tasks is None else int(tasks)
    cpus_per_task = int(launcher.get("cpus_per_task") or 1)
    cpus = tasks * cpus_per_task
    mem_gb = launcher.get("mem_gb")
    memory_mb = int(mem_gb) * 1024 if mem_gb else 0  # submitit asks for --mem=<mem_gb>GB
    most_gpus = max(n.gpus for n in nodes)
    most_cpus = max(n.cpus for n in nodes)
    most_memory_mb = max(n.memory_mb for n in nodes)
    if gpus > most_gpus:
        value = gres if gres else gpus
        return (
            f"{gpus_field}={value} asks for {gpus} GPUs per node, but {where} have "
            f"{most_gpus or 'none'}: lower it, pick a GPU partition (hydra.launcher.partition), "
            "or run on CPUs with hydra/launcher=slurm_cpu."
        )
    if tasks < 1:
        return (
            f"hydra.launcher.tasks_per_node={tasks} starts no process (under "
            "hydra/launcher=slurm it follows gpus_per_node): set it to 1 or more, or use "
            "hydra/launcher=slurm_cpu."
        )
    if cpus > most_cpus:
        return (
            f"hydra.launcher.tasks_per_node={tasks} x hydra.launcher.cpus_per_task="
            f"{cpus_per_task} asks for {cpus} CPUs per node, but {where} have at most "
            f"{most_cpus}: lower them."
        )
    if memory_mb > most_memory_mb:
        return (
            f"hydra.launcher.mem_gb={mem_gb} asks for {mem_gb} GB per node, but {where} have "
            f"at most {most_memory_mb // 1024} GB ({most_memory_mb} MB): lower it."
        )
    fitting = [n for n in nodes if n.gpus >= gpus and n.cpus >= cpus and n.memory_mb >= memory_mb]
    asked = int(launcher.get("nodes") or 1)
    if asked > len(fitting):
        return (
            f"hydra.launcher.nodes={asked} asks for {asked} nodes, but partition {partition} "
            f"has {len(fitting)} that fit the request: lower it."
        )
    return None


class SlurmPreflight(Callback):
    """Hydra callback: a sweep for SLURM is checked against the cluster before sbatch,
    followed through squeue where the cluster keeps no accounting, and a job of it without a
    result is reported in one line. Other launchers, and single runs, are left alone."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        launcher = config.hydra.launcher
        if launcher.get("_target_") != SLURM_LAUNCHER:
            return
        from eagleforge.parallel.squeue import report_jobs_without_result

        report_jobs_without_result()
        cluster = read_cluster()
        if cluster is None:
            return  # no cluster answers here: sbatch will say what is wrong
        problem = request_problem(launcher, cluster)
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            sys.exit(2)
        if not cluster.accounting:
            from eagleforge.parallel.squeue import follow_jobs_with_squeue

            follow_jobs_with_squeue()
