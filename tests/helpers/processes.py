"""Processes for the tests that kill them: a pid that has exited (what a killed writer's
temporary names), the live processes below a pid (to SIGKILL a whole launcher tree), and
whether a pid is gone (an engine stopped with the command)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def dead_pid() -> int:
    """The pid of a process that has exited (what a killed writer's temporary names)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is gone for our purpose)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    """Whether ``pid`` is gone within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False
