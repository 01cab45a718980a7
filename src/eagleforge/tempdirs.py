"""Temporary directories of atomic cache writes, named by their writer, and the removal of
those that a killed writer left behind.

A cache entry (preprocessed data, a converted model) is written into
``.<name>.<pid>@<host>.<random>`` beside its final path and renamed when complete
(``writer_temp_dir``). A writer killed midway leaves that directory; the next write or lookup
in the same directory removes it (``remove_stale_temps``) once it is certainly abandoned:

- written on this host by a process that no longer runs; "this host" is the host name and
  the pid namespace, so containers that share a host name do not judge each other's pids;
- written elsewhere (another host on a shared filesystem, or before writers were named):
  a pid there cannot be checked, so when nothing in it changed for ``STALE_AFTER_S``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

# A temporary directory of another host is abandoned when nothing in it changed for this long:
# far beyond any pause of a live writer (writes stream into it; nothing waits for a day).
STALE_AFTER_S = 24 * 3600

# mkdtemp's random suffix: 8 characters of [a-z0-9_]
_NAMED = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9.~-]+)\.[a-z0-9_]{8}$")
_UNNAMED = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}$")  # written before writers were named


def this_host() -> str:
    """The host name (filename-safe), with the pid namespace where Linux names it."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "host"
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return host
    return f"{host}~{re.sub(r'[^0-9]', '', namespace)}"


def writer_temp_dir(final: Path) -> Path:
    """A new empty directory beside ``final`` to write it in, named by this process; the
    abandoned temporary directories beside it are removed first."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent)
    prefix = f".{final.name}.{os.getpid()}@{this_host()}."
    return Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))


def remove_stale_temps(parent: Path) -> list[Path]:
    """Remove the abandoned temporary directories in ``parent`` (see the module docstring);
    returns them. A missing ``parent`` holds none."""
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return []
    host, removed = this_host(), []
    for entry in entries:
        if not entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            abandoned = _abandoned(path, host)
        except FileNotFoundError:  # removed meanwhile (renamed by its writer, or cleaned)
            continue
        if abandoned:
            shutil.rmtree(path, ignore_errors=True)  # another cleaner may race us: both fine
            log.info("removed %s, left by an interrupted cache write", path)
            removed.append(path)
    return removed


def _abandoned(path: Path, host: str) -> bool:
    named = _NAMED.match(path.name)
    if named is not None and named["host"] == host:
        return not _running(int(named["pid"]))
    if named is None and _UNNAMED.match(path.name) is None:
        return False  # not a temporary directory of ours
    return time.time() - _last_change(path) > STALE_AFTER_S


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _last_change(path: Path) -> float:
    """The newest modification time of ``path`` and everything in it."""
    newest = path.lstat().st_mtime
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except FileNotFoundError:
                continue
    return newest
