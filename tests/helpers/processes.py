"""Processes for the tests that kill them: a pid that has exited (what a killed writer's
temporary names), and the live processes below a pid (to SIGKILL a whole launcher tree)."""

from __future__ import annotations

import subprocess
import sys
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
