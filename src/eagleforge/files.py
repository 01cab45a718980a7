"""Files written the way the rest of a run's files are: safetensors files that follow the
umask, and streamed sha256 digests (``checksums.json``, checked before weights are used); and
whether a place can be written at all (``unwritable_reason``, asked before any work).

Every safetensors writer of eagleforge (checkpoints, exported drafts, feature shards, the
vocab-map cache) goes through ``save_safetensors``: safetensors >= 0.8 writes through a
temporary file that the ``tempfile`` crate creates with mode 0600 and renames into place, so
``save_file`` alone leaves the weights unreadable to the teammates who can read everything
else in the directory (safetensors/safetensors#782).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file


def resolve_cache_dir(cache_dir: str | None) -> Path:
    """``cache_dir``, else $EAGLEFORGE_CACHE_DIR, else ~/.cache/eagleforge."""
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get("EAGLEFORGE_CACHE_DIR") or Path.home() / ".cache" / "eagleforge")


def current_umask() -> int:
    """The process umask, read without changing it where Linux says it (``/proc``, 4.7+)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and put back (a thread may see 022 meanwhile)
    os.umask(mask)
    return mask


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file``, with the mode a file created by ``open()`` gets."""
    save_file(dict(tensors), str(path), metadata=metadata)
    follow_umask(path)


def follow_umask(path: str | Path) -> None:
    """Give a file the mode ``open()`` would have created it with (0666 less the umask): for
    safetensors files written by other libraries (``save_pretrained``) as well."""
    os.chmod(path, 0o666 & ~current_umask())


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# A directory's manifest of sha256 digests (checkpoints write one; drafts copied from them
# keep it), so that a flipped byte is found before the weights are used.
CHECKSUMS = "checksums.json"


def record_checksums(directory: Path) -> None:
    """Write ``checksums.json``: the sha256 of every other file in ``directory``."""
    digests = {
        file.name: sha256_file(file)
        for file in sorted(directory.iterdir())
        if file.is_file() and file.name != CHECKSUMS
    }
    (directory / CHECKSUMS).write_text(json.dumps({"sha256": digests}, indent=2) + "\n")


def checksum_problem(directory: str | Path) -> str | None:
    """What is wrong with a directory's files by its ``checksums.json``; None when nothing is,
    or when it has none (saved by an older eagleforge, or by another tool: unverified)."""
    path = Path(directory)
    try:
        digests = json.loads((path / CHECKSUMS).read_text())["sha256"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{CHECKSUMS} is unreadable ({type(e).__name__}: {e})"
    for name, digest in digests.items():
        if not (path / name).is_file():
            return f"{name} is missing (listed in {CHECKSUMS})"
        if sha256_file(path / name) != digest:
            return f"{name} does not match its checksum in {CHECKSUMS}"
    return None


def unwritable_reason(path: str | Path) -> str | None:
    """Why this process cannot write at ``path`` -- the file or directory itself where it
    exists, else the nearest directory above it, in which it would be made -- in a few words;
    None when it can. Only looks: creates nothing. (As root, only a read-only file system or
    a file in the way stops a write, and only those are found.)"""
    place = Path(os.path.abspath(path))
    while not place.exists() and place != place.parent:
        place = place.parent
    if place != Path(os.path.abspath(path)) and not place.is_dir():
        return f"{place} is a file, not a directory"
    mode = os.W_OK | (os.X_OK if place.is_dir() else 0)
    if os.access(place, mode):
        return None
    try:
        read_only = bool(os.statvfs(place).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return f"{place} is on a read-only file system"
    return f"{place} is read-only to this user"


def unreadable_reason(error: BaseException) -> str:
    """Why torch or safetensors could not read a file, in one short line. Never torch's advice
    to load it with ``weights_only=False``: that would run whatever code the file holds."""
    text = str(error).strip()
    if isinstance(error, pickle.UnpicklingError) or "weights_only" in text:
        return (
            "it holds objects other than tensors and plain containers, which eagleforge never "
            "unpickles"
        )
    if "_use_new_zipfile_serialization" in text or "PytorchStreamReader" in text:
        return "not a torch.save archive"
    if "header too large" in text or "Error while deserializing header" in text:
        return "not a safetensors file: its header is damaged"
    first = text.splitlines()[0] if text else type(error).__name__
    return first if len(first) <= 160 else first[:159] + "…"
