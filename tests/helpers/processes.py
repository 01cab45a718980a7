"""Processes for tests of what a killed writer leaves behind."""

from __future__ import annotations

import subprocess
import sys


def dead_pid() -> int:
    """The pid of a process that has exited (what a killed writer's temporary names)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
