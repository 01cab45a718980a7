"""Atomic writes: a directory or a file appears whole or not at all, whatever kills the
writer, and the temporaries killed writers left behind are removed.

Every directory eagleforge writes (a checkpoint, an exported draft, a preprocessed-data cache
entry, a converted model) is written through ``atomic_directory``: into
``.<name>.<pid>@<host>.<random>`` beside its final path (``writer_temp_dir``), renamed when
complete. Single files (a feature shard, a manifest, a cached vocab map, a data file) go
through ``atomic_file``: ``.tmp-<name>.<pid>@<host>`` and ``os.replace``.

A writer killed midway leaves its temporary directory; the next write or lookup in the same
directory removes it (``remove_stale_temps``) once it is certainly abandoned:

- written on this host by a process that no longer runs; "this host" is the host name and
  the pid namespace, so containers that share a host name do not judge each other's pids;
- written elsewhere (another host on a shared filesystem, or before writers were named):
  a pid there cannot be checked, so when nothing in it changed for ``STALE_AFTER_S``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagleforge.errors import EagleForgeError
from eagleforge.files import current_umask

log = logging.getLogger(__name__)

# A temporary directory of another host is abandoned when nothing in it changed for this long:
# far beyond any pause of a live writer (writes stream into it; nothing waits for a day).
STALE_AFTER_S = 24 * 3600

# mkdtemp's random suffix: 8 characters of [a-z0-9_]
_NAMED = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9.~-]+)\.[a-z0-9_]{8}$")
_NAMED_FILE = re.compile(r"^\.tmp-(?P<name>.+)\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9.~-]+)$")
_UNNAMED = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}$")  # written before writers were named


class DiskFull(EagleForgeError):
    """A write ran out of space (or quota); the message names what was being written."""


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a write that ran out of space or quota: an
    OSError with ENOSPC or EDQUOT, safetensors' error with the OS's text, or torch.save's
    short write (``unexpected pos``), which says nothing else."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, DiskFull):
            return True
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        if isinstance(seen, RuntimeError) and "unexpected pos" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextmanager
def naming_disk_full(final: Path) -> Iterator[None]:
    """Turn a write of ``final`` that ran out of space into one ``DiskFull`` line naming it
    and the space left; any other error goes on as it is."""
    try:
        yield
    except Exception as e:
        if isinstance(e, DiskFull) or not is_disk_full(e):
            raise
        raise DiskFull(
            f"{final}: no space left on device ({_free_text(final)}); nothing half-written is "
            "left and what was written before is intact: free space and run the same command "
            "again",
        ) from None


def _free_text(path: Path) -> str:
    for parent in (path, *path.parents):
        try:
            usage = shutil.disk_usage(parent)
        except OSError:
            continue
        return f"{usage.free / 2**20:,.0f} MiB free of {usage.total / 2**30:,.1f} GiB on it"
    return "free space unknown"


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


@contextmanager
def atomic_directory(
    final: Path, *, replace: bool = False, complete: str | None = None, durable: bool = False
) -> Iterator[Path]:
    """Write ``final`` all at once: the ``with`` block writes into the temporary directory it
    is given, which then becomes ``final`` in one rename. An exception in the block, or a kill,
    leaves ``final`` as it was.

    - ``replace``: an existing ``final`` is swapped out, whole until the swap;
    - ``complete``: the file every complete ``final`` holds. An existing ``final`` without it
      (half-written by something else) is replaced; when a concurrent writer of the same
      entry renamed its own first, that complete directory is kept;
    - ``durable``: every file is fsynced before the rename (checkpoints).
    """
    tmp = writer_temp_dir(final)
    try:
        with naming_disk_full(final):
            yield tmp
            if durable:
                for file in tmp.iterdir():
                    with open(file, "rb") as f:
                        os.fsync(f.fileno())
            # mkdtemp makes it private; share it like any directory
            tmp.chmod(0o777 & ~current_umask())
            torn = complete is not None and final.exists() and not (final / complete).exists()
            if (replace or torn) and final.exists():
                old = writer_temp_dir(final.with_name(f"{final.name}.old"))
                os.rename(final, old / final.name)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                try:
                    os.rename(tmp, final)
                except OSError:  # another writer finished first
                    if complete is None or not (final / complete).exists():
                        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Write ``path`` all at once: the ``with`` block writes the temporary file it is given,
    which is fsynced and then replaces ``path``. An exception leaves ``path`` as it was."""
    remove_stale_temps(path.parent)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}@{this_host()}")
    try:
        with naming_disk_full(path):
            yield tmp
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_temps(parent: Path) -> list[Path]:
    """Remove the abandoned temporary directories and files in ``parent`` (module docstring);
    returns them. A missing ``parent`` holds none."""
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return []
    host, removed = this_host(), []
    for entry in entries:
        if not entry.name.startswith("."):
            continue
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                abandoned = _abandoned(path, host)
            else:
                file = _NAMED_FILE.match(entry.name)
                abandoned = file is not None and _gone(file, host, path)
        except FileNotFoundError:  # removed meanwhile (renamed by its writer, or cleaned)
            continue
        if abandoned:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)  # another cleaner may race us: fine
            else:
                path.unlink(missing_ok=True)
            log.info("removed %s, left by an interrupted cache write", path)
            removed.append(path)
    return removed


def _abandoned(path: Path, host: str) -> bool:
    named = _NAMED.match(path.name)
    if named is None and _UNNAMED.match(path.name) is None:
        return False  # not a temporary directory of ours
    return _gone(named, host, path)


def _gone(named: re.Match[str] | None, host: str, path: Path) -> bool:
    """Whether the writer of a temporary named ``named`` (None: unnamed) is gone."""
    if named is not None and named["host"] == host:
        return not _running(int(named["pid"]))
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
