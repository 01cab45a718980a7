"""Files written the way the rest of a run's files are: safetensors files that follow the
umask, and streamed sha256 digests.

Every safetensors writer of eagleforge (checkpoints, exported drafts, feature shards, the
vocab-map cache) goes through ``save_safetensors``: safetensors >= 0.8 writes through a
temporary file that the ``tempfile`` crate creates with mode 0600 and renames into place, so
``save_file`` alone leaves the weights unreadable to the teammates who can read everything
else in the directory (safetensors/safetensors#782).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file


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
