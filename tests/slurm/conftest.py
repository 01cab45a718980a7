"""The slurm tier: real jobs on a one-node SLURM cluster on this machine
(``scripts/slurm_cluster.sh``, what ``make slurm`` starts).

The cluster is started once per test session, only where it is not running already, and
stopped at the end only where this session started it. Where SLURM cannot be had (not Linux;
not installed, and not root with apt-get to install it) the tier is skipped, except where the
Makefile says it must run (EAGLEFORGE_REQUIRE_SLURM=1: ``make test`` on a machine that can
start the cluster), where that fails instead.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
DAEMONS = ("munged", "slurmctld", "slurmd")


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


def _unavailable(reason: str) -> None:
    if os.environ.get("EAGLEFORGE_REQUIRE_SLURM") == "1":
        pytest.fail(f"the slurm tier must run here (EAGLEFORGE_REQUIRE_SLURM=1): {reason}")
    pytest.skip(reason)


def _cluster(command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CLUSTER), command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def running_daemons() -> set[str]:
    """The cluster's daemons that run now, as its pid files say."""
    status = _cluster("status", 60).stdout
    return {d for d in DAEMONS if f"{d}: running" in status}


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Path]:
    """The cluster's slurm.conf, exported as SLURM_CONF for this session and its children."""
    reason = why_no_slurm()
    if reason:
        _unavailable(reason)
    before = running_daemons()
    started = _cluster("start", 600)  # installs slurm-wlm and munge first where missing
    if started.returncode != 0:
        said = (started.stderr or started.stdout).strip().splitlines()
        _unavailable(f"scripts/slurm_cluster.sh start failed: {said[-1] if said else '?'}")
    slurm_dir = (REPO / os.environ.get("SLURM_DIR", ".slurm")).resolve()  # as the script
    conf = slurm_dir / "slurm.conf"
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        yield conf
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if not before:  # this session started the cluster: it stops it
            _cluster("stop", 120)
