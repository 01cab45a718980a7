"""The slurm tier: real jobs on a SLURM cluster on this machine (``scripts/slurm_cluster.sh``,
what ``make slurm`` starts), with two more nodes in network namespaces for a 2-node job.

The cluster is started once per test session, only where it is not running already, and
stopped at the end only where this session started it. Where SLURM cannot be had (not Linux;
not installed, and not root with apt-get to install it) the tier is skipped, except where the
Makefile says it must run (EAGLEFORGE_REQUIRE_SLURM=1: ``make test`` on a machine that can
start the cluster), where that fails instead. The 2-node test runs where the session can start
the cluster with its netns nodes (root, iproute2) or finds them running, and skips otherwise.

On a real cluster instead, the tests not marked ``local`` (those that need no partition of
this machine's cluster) run there: name a partition of two nodes or more, and give pytest a
directory every node sees (the runs write there and the nodes run this checkout's Python);
sbatch's own variables (SBATCH_ACCOUNT, SBATCH_QOS, ...) pass the rest::

    EAGLEFORGE_SLURM_PARTITION=cpu pytest -m "slurm and not local" tests/slurm \\
        --basetemp=/shared/scratch/eagleforge-tests
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.slurm import Cluster

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
NETNS_NODES = 2  # nodes of the local cluster's partition `multi`
PARTITION_ENV = "EAGLEFORGE_SLURM_PARTITION"  # a real cluster's multi-node partition


def why_no_slurm() -> str | None:
    """Why this machine cannot run the cluster; None where it can."""
    if platform.system() != "Linux":
        return "the SLURM tier needs Linux (scripts/slurm_cluster.sh runs SLURM's daemons here)"
    installed = all(shutil.which(p) for p in ("munged", "slurmctld", "slurmd", "sbatch"))
    if not installed and (os.geteuid() != 0 or not shutil.which("apt-get")):
        return (
            "SLURM and munge are not installed and this user cannot install them (root with "
            "apt-get can): apt-get install slurm-wlm munge, or run make slurm as root"
        )
    return None


def why_no_netns_nodes() -> str | None:
    """Why the local cluster cannot have its netns nodes; None where it can try."""
    if os.geteuid() != 0:
        return "the 2-node cluster needs root (it makes network namespaces and a bridge)"
    missing = [p for p in ("ip", "unshare", "nsenter") if not shutil.which(p)]
    if missing:
        return f"the 2-node cluster needs {', '.join(missing)} (iproute2, util-linux)"
    return None


def _unavailable(reason: str) -> None:
    if os.environ.get("EAGLEFORGE_REQUIRE_SLURM") == "1":
        pytest.fail(f"the slurm tier must run here (EAGLEFORGE_REQUIRE_SLURM=1): {reason}")
    pytest.skip(reason)


def _cluster(*command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CLUSTER), *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    said = (done.stderr or done.stdout).strip().splitlines()
    return said[-1] if said else "?"


def running_daemons() -> set[str]:
    """The cluster's daemons that run now, as its pid files say (slurmd-<node> per node)."""
    status = _cluster("status", timeout=60).stdout
    return set(re.findall(r"^(\S+): running", status, flags=re.MULTILINE))


def partition_nodes(partition: str) -> int:
    """How many nodes of a partition are up (0 where there is no such partition)."""
    done = subprocess.run(
        ["sinfo", "-h", "-p", partition, "-t", "idle,mixed,allocated,completing", "-o", "%D"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return sum(int(n) for n in done.stdout.split() if n.isdigit())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a real cluster, the tests of this machine's cluster are skipped."""
    if not os.environ.get(PARTITION_ENV):
        return
    skip = pytest.mark.skip(
        reason=f"needs this machine's cluster (scripts/slurm_cluster.sh), and {PARTITION_ENV} "
        "sends the tier to another"
    )
    for item in items:
        if item.get_closest_marker("local"):
            item.add_marker(skip)


def _real_cluster(partition: str) -> Cluster:
    if not shutil.which("sbatch"):
        pytest.fail(f"{PARTITION_ENV}={partition}, but SLURM's sbatch is not on PATH here")
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    nodes = partition_nodes(partition)
    if nodes < 2:
        pytest.fail(f"{PARTITION_ENV}={partition}: sinfo finds {nodes} node(s) up there, not 2+")
    return Cluster(conf, local=False, multi_node_partition=partition)


def _start_local() -> tuple[bool, str | None, str]:
    """Starts the local cluster where needed: (this session started it, its multi-node
    partition or None, why none)."""
    before = running_daemons()
    if before:  # a cluster runs here: its nodes as they are
        started = _cluster("start", timeout=600)
        if started.returncode != 0:
            _unavailable(f"scripts/slurm_cluster.sh start failed: {_last_line(started)}")
        if partition_nodes("multi") >= NETNS_NODES:
            return False, "multi", ""
        return (
            False,
            None,
            (
                "the cluster running here has no netns nodes: make slurm-stop, and the tier starts "
                f"them (or: make slurm NETNS_NODES={NETNS_NODES})"
            ),
        )
    why_not = why_no_netns_nodes()
    if why_not is None:
        # installs slurm-wlm and munge first where missing
        started = _cluster("start", "--netns-nodes", str(NETNS_NODES), timeout=600)
        if started.returncode == 0:
            return True, "multi", ""
        why_not = f"scripts/slurm_cluster.sh start --netns-nodes 2 failed: {_last_line(started)}"
    # one node: the start undoes what a failed start with netns nodes left
    started = _cluster("start", "--netns-nodes", "0", timeout=600)
    if started.returncode != 0:
        _cluster("stop", timeout=120)
        _unavailable(f"scripts/slurm_cluster.sh start failed: {_last_line(started)}")
    return True, None, why_not


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    """The cluster, its slurm.conf exported as SLURM_CONF for this session and its children."""
    partition = os.environ.get(PARTITION_ENV)
    if partition:
        yield _real_cluster(partition)
        return
    reason = why_no_slurm()
    if reason:
        _unavailable(reason)
    slurm_dir = (REPO / os.environ.get("SLURM_DIR", ".slurm")).resolve()  # as the script
    conf = slurm_dir / "slurm.conf"
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)  # sinfo, in _start_local too
    started = False
    try:
        started, multi, why_not = _start_local()
        yield Cluster(conf, local=True, multi_node_partition=multi, why_not_multi_node=why_not)
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if started:  # this session started the cluster: it stops it
            _cluster("stop", timeout=120)
