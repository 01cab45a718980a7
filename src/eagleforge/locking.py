"""One writer per output: a run directory, a feature store or a regenerated file is written by
one process at a time.

``exclusive(lock_file, ...)`` takes an advisory lock (``flock``) on ``lock_file`` for as long
as the ``with`` block runs, and writes who holds it (pid, host, start time, command) into the
file. A second process asking for the same lock gets a ``RunLocked`` error naming the
holder instead of writing over its files. The kernel drops the lock when its holder exits,
however it exits (kill -9 included), so a lock file left by a dead process is stale by
construction: the next writer simply takes it. The file stays, unless its holder asks
(``remove=True``, for an output that should leave nothing beside it): it unlinks the file
before it drops the lock, and a writer that locked a file no longer at the path locks the one
there now, so two writers never hold two different files.

``LockRunDir`` is the Hydra callback (``hydra.callbacks.run_dir_lock`` in ``conf/config.yaml``)
that takes the run directory's lock before Hydra writes anything into it -- its ``.hydra/``
copy of the config and its log file -- and holds it for the whole run or sweep. A run
directory that cannot be written (read-only, under a file) ends the command there in one line
naming the setting to change, where Hydra would fail configuring its log file.

Locks are advisory and local to what the filesystem's ``flock`` covers: every local
filesystem and NFS (emulated with POSIX locks); Lustre only where mounted with ``-o flock``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from eagleforge.atomic import this_host
from eagleforge.errors import EagleForgeError
from eagleforge.files import unwritable_reason

log = logging.getLogger(__name__)

RUN_DIR_LOCK = ".eagleforge.lock"

# The locks this process holds, by real path: a lock taken twice by one process would refuse
# itself (flock locks belong to an open file, not to a process).
_HELD: dict[str, int] = {}


class RunLocked(EagleForgeError):
    """Another live process writes the same output."""


def beside(path: Path) -> Path:
    """The lock file of an output that is a file or a store: ``.<name>.lock`` beside it, so
    that nothing new appears inside it."""
    return path.with_name(f".{path.name}.lock")


@contextmanager
def exclusive(lock_file: Path, *, output: Path, field: str, remove: bool = False) -> Iterator[None]:
    """Hold ``lock_file`` while the block writes ``output``; raises ``RunLocked`` naming the
    process that holds it, and ``field``, the setting that chooses another output. With
    ``remove`` the lock file goes when the lock does."""
    key = os.path.realpath(lock_file)
    if key in _HELD:  # this process holds it already (the run directory's, by the callback)
        yield
        return
    _HELD[key] = acquire(lock_file, output=output, field=field)
    try:
        yield
    finally:
        if remove:  # while still held: see acquire
            lock_file.unlink(missing_ok=True)
        release(_HELD.pop(key))


def acquire(lock_file: Path, *, output: Path, field: str) -> int:
    """Take the lock (see ``exclusive``); returns the open descriptor that holds it."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise RunLocked(
                f"{output} is being written by another eagleforge process ({holder}); wait for "
                f"it to end or stop it, or choose another {field}."
            ) from None
        except OSError as e:  # a filesystem without flock: run unguarded rather than not at all
            log.warning(
                "cannot lock %s (%s): nothing stops a second writer of %s", lock_file, e, output
            )
            return fd
        if _is_at(fd, lock_file):
            break
        os.close(fd)  # its holder removed it (exclusive's remove) after we opened it
    os.ftruncate(fd, 0)
    record = {
        "pid": os.getpid(),
        "host": this_host(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
    }
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


def release(fd: int) -> None:
    """Drop the lock ``acquire`` took (the holder's record stays, read as stale from now on)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is still the file at ``path``."""
    try:
        at = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}  # the holder is between truncating and writing its record


def _describe(holder: dict[str, Any]) -> str:
    if "pid" not in holder:
        return "its record is still being written"
    text = f"pid {holder['pid']} on {holder.get('host', '?').split('~')[0]}"
    if holder.get("started"):
        text += f", started {holder['started']}"
    if holder.get("command"):
        text += f": {holder['command']}"
    return text


class LockRunDir(Callback):
    """Hydra callback: the run directory (or a sweep's directory) is written by one process.

    Taken in ``on_run_start``/``on_multirun_start``, before Hydra writes the directory's
    ``.hydra/`` and log file, so a second run into the same directory changes nothing of the
    first's; it prints one line naming the holder and exits with status 2. Under torchrun only
    rank 0 takes it (the ranks of one run share the directory); commands without a run
    directory of their own (``hydra.output_subdir: null``) take none. It also keeps what
    ``.hydra/`` says before Hydra rewrites it -- the run's, or every job's of a sweep -- for
    ``restore_run_records``; the jobs of a submitit sweep get it with this callback, which
    travels to their processes.
    """

    def __init__(self) -> None:
        self._key = ""
        self._records: tuple[str, dict[str, dict[str, bytes]]] | None = None

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        if self._records is not None:  # in a submitit job's own process too
            _RECORDS[self._records[0]] = self._records[1]

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._take(config, config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._take(config, config.hydra.sweep.dir, "hydra.sweep.dir")

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        self._drop()

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._drop()

    def _take(self, config: Any, directory: str, field: str) -> None:
        if config.hydra.output_subdir is None:
            return
        problem = run_dir_problem(config, directory, field)
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            sys.exit(2)
        if int(os.environ.get("RANK", "0")) != 0:
            return
        output = Path(directory)
        self._key = os.path.realpath(output / RUN_DIR_LOCK)
        try:
            _HELD[self._key] = acquire(output / RUN_DIR_LOCK, output=output, field=field)
        except RunLocked as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        # what .hydra/ says of the run (each job of the sweep) so far, before Hydra rewrites it
        subdir = str(config.hydra.output_subdir)
        records = [output / subdir] if field == "hydra.run.dir" else output.rglob(subdir)
        root = os.path.abspath(output)
        self._records = (root, {os.path.abspath(r): _yaml_files(r) for r in records})
        _RECORDS[root] = self._records[1]

    def _drop(self) -> None:
        if self._key in _HELD:
            release(_HELD.pop(self._key))


# What LockRunDir found, by the run or sweep directory it took: each .hydra/ under it (by
# absolute path) with its YAML files. One absent was new to this command.
_RECORDS: dict[str, dict[str, dict[str, bytes]]] = {}


def _yaml_files(record: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in record.glob("*.yaml") if p.is_file()}


def restore_run_records() -> None:
    """Put back the ``.hydra/`` files Hydra rewrote for this run, or this job of a sweep, that
    then did not run (a refused resume): the directory records the config that ran, not one
    that was refused. A directory new to this command loses the files Hydra wrote. Nothing
    outside a Hydra run, or where ``LockRunDir`` took no directory."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.output_subdir is None:
        return
    record = os.path.abspath(Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir)
    for root, found in _RECORDS.items():
        if Path(record).is_relative_to(root):
            files = found.get(record, {})
            for path in Path(record).glob("*.yaml"):
                if path.name not in files:
                    path.unlink(missing_ok=True)
            for name, data in files.items():
                (Path(record) / name).write_bytes(data)
            return


def run_dir_problem(config: Any, directory: str, field: str) -> str | None:
    """Why the run (or sweep) directory ``directory`` cannot be written, naming the setting
    that chose it: ``field`` (hydra.run.dir, hydra.sweep.dir) where the command line gives
    it, else output_root, under which the default lies; None when it can be written."""
    reason = unwritable_reason(directory)
    if reason is None:
        return None
    given = [str(o).split("=", 1)[0].lstrip("+~") for o in config.hydra.overrides.hydra]
    root = str(config.output_root)
    if field in given or not Path(directory).is_relative_to(root):
        setting, fix = f"{field}={directory}", f"set {field} to a writable directory"
    else:
        cwd = "" if Path(root).is_absolute() else f" (in the working directory {Path.cwd()})"
        setting = f"output_root={root}{cwd}"
        fix = f"set output_root (or {field}) to a writable directory"
    what = "sweep directory" if field == "hydra.sweep.dir" else "run directory"
    return f"{setting}: cannot write the {what} {directory} ({reason}); {fix}."
