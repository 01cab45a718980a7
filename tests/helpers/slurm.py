"""The cluster the slurm tier's jobs go to, as its session fixture (tests/slurm/conftest.py)
found or started it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Cluster:
    """A SLURM cluster's client view: where its config is and which partitions a test may use."""

    conf: Path  # its slurm.conf, as SLURM_CONF names it
    local: bool  # the cluster scripts/slurm_cluster.sh runs on this machine
    multi_node_partition: str | None  # a partition of 2+ nodes; None where there is none
    why_not_multi_node: str = ""  # why there is none
