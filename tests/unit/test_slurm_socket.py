"""munged accepts its socket only where every user can pass through each directory above it:
``make slurm`` keeps it in SLURM_DIR where that holds and moves it to a directory of the
cluster's own under /tmp where it does not (a checkout in a 0700 home, as root's is)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm_cluster.sh"


def _socket(slurm_dir: Path) -> str:
    done = subprocess.run(
        ["bash", str(SCRIPT), "status"], env={**os.environ, "SLURM_DIR": str(slurm_dir)},
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("munge socket: ")]
    return line.removeprefix("munge socket: ")


def test_the_socket_stays_in_a_reachable_slurm_dir() -> None:
    # pytest's own tmp_path is under a 0700 directory: a checkout every user can reach
    with tempfile.TemporaryDirectory(dir="/tmp") as name:
        checkout = Path(name)
        checkout.chmod(0o755)
        socket = _socket(checkout / ".slurm")
    assert socket == str(checkout / ".slurm" / "munge" / "munge.socket.2")


def test_a_checkout_in_a_closed_home_gets_its_socket_under_tmp(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    home.chmod(0o700)
    socket = _socket(home / "checkout" / ".slurm")
    assert socket.startswith(f"/tmp/eagleforge-munge-{os.getuid()}-")
    assert socket.endswith("/munge.socket.2")
    assert _socket(home / "other" / ".slurm") != socket  # one directory per cluster
