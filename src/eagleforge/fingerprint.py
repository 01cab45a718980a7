"""The target's weights fingerprint: a hash of every byte of every weight file, read once and
cached by file identity.

``weights_fingerprint(model, cache_dir)`` is ``xxh3-128:<32 hex>``: xxh3-128 over each weight
file's name (relative to the model directory), size and digest, where a file's digest is
xxh3-128 of all its bytes. The weight files are the ones transformers loads: those a
``model.safetensors.index.json`` maps tensors to, with the index itself; else
``model.safetensors``; else every ``*.safetensors``; and the same for ``pytorch_model.bin``.
A hub id is fingerprinted by those files in the Hugging Face cache (fetched if missing), so a
downloaded copy and its hub id have the same fingerprint. Feature stores (``weight_hash``) and
checkpoints (``target_weights`` in ``run.json``) record it; docs/training.md#resuming.

Reading a 16 GB checkpoint takes seconds to minutes, so each file's digest is cached under
``<cache_dir>/fingerprints/``, one JSON entry per file, keyed by its identity: real path,
size, mtime, ctime, inode and device. A run over unchanged files then costs a stat per file.
An edit in place changes mtime and ctime (ctime cannot be set back, so even an edit that
restores mtime, as ``cp -p`` or ``rsync --inplace`` do, is seen); a new file or copy has
another inode. An entry that is damaged, of another algorithm or of another identity is
ignored and the file read again. Entries are written whole (``atomic_file``) and each holds
the sha256 of its fields, so concurrent writers never tear one and a damaged one is never
trusted. A file changed in the last ``SETTLE_S`` seconds is hashed but not cached: a second
write within the same timestamp tick would leave its identity as it was.

Fingerprints of eagleforge before this one were sampled (sha256 over each file's header and 16
blocks of 64 KiB: 32 hex digits, no prefix); ``is_sampled_fingerprint`` recognises them, and
the records that hold one are refused rather than compared.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from eagleforge.atomic import DiskFull, atomic_file
from eagleforge.errors import ConfigError

log = logging.getLogger(__name__)

ALGORITHM = "xxh3-128"
# Bytes per read: small enough to stay in the CPU's cache between the read and the hash (from
# the page cache, 1 MiB blocks hashed at 2.8 GB/s where 16 MiB ones managed 1.4), large enough
# that the syscalls cost nothing.
BLOCK_BYTES = 1 << 20
# A file changed this recently is not cached (see the module docstring).
SETTLE_S = 2.0
# Above this many bytes to read, one INFO line says beforehand why the run waits.
ANNOUNCE_BYTES = 1 << 30
# At most this many files are read at once (xxhash and file reads release the GIL).
MAX_READERS = 8
CACHE_SUBDIR = "fingerprints"
ENTRY_VERSION = 1

# (index, the single file transformers loads without one, the pattern of any others)
_LAYOUTS = (
    ("model.safetensors.index.json", "model.safetensors", "*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", "*.bin"),
)
_SAMPLED = re.compile(r"[0-9a-f]{32}")

# What a refusal of a sampled fingerprint says, after the record's name.
SAMPLED_TEXT = (
    "by the sampled fingerprint of an older eagleforge (a header and 16 blocks of 64 KiB per "
    "file), which cannot show the weights are this run's"
)


def is_sampled_fingerprint(value: object) -> bool:
    """Whether ``value`` is the sampled fingerprint of an older eagleforge."""
    return isinstance(value, str) and _SAMPLED.fullmatch(value) is not None


def weights_fingerprint(
    model: str | Path, cache_dir: str | Path, revision: str | None = None
) -> str:
    """The fingerprint of the target's weights in the directory ``model``, or of the hub id
    ``model`` at ``revision``; ``cache_dir`` keeps the files' digests (module docstring)."""
    root, files = weight_files(model, revision)
    digests = file_digests(files, Path(cache_dir))
    combined = xxhash.xxh3_128()
    for path in files:
        digest, size = digests[path]
        combined.update(f"{path.relative_to(root).as_posix()}\t{size}\t{digest}\n".encode())
    return f"{ALGORITHM}:{combined.hexdigest()}"


def weight_files(model: str | Path, revision: str | None = None) -> tuple[Path, list[Path]]:
    """The directory of the target's weights and the files the fingerprint covers there."""
    root = Path(model).expanduser()
    if root.is_dir():
        return root, _local_weight_files(root)
    if root.exists():
        raise ConfigError(
            f"model.path={model}: a file, not a model directory; point it at the directory "
            "that holds config.json and the weights."
        )
    return _hub_weight_files(str(model), revision)


def _local_weight_files(root: Path) -> list[Path]:
    for index_name, single, pattern in _LAYOUTS:
        index = root / index_name
        if index.is_file():
            listed = [root / name for name in _indexed_names(index)]
            missing = [p.name for p in listed if not p.is_file()]
            if missing:
                raise ConfigError(
                    f"{index}: lists {', '.join(missing[:3])}, not in {root}; the checkpoint is "
                    "incomplete: download or copy it again."
                )
            return [index, *listed]
        if (root / single).is_file():
            return [root / single]
        found = sorted(root.glob(pattern))
        if found:
            return found
    raise ConfigError(
        f"{root}: no weight files (*.safetensors, *.bin) to fingerprint the target by; point "
        "model.path at the model's directory."
    )


def _indexed_names(index: Path) -> list[str]:
    """The files an index maps tensors to, each once, sorted."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"{index}: not a weights index ({type(e).__name__}: {e}); download or copy the "
            "checkpoint again."
        ) from None
    if not all(isinstance(n, str) and n and "/" not in n and n != ".." for n in names):
        raise ConfigError(f"{index}: its weight_map names files outside the directory.")
    return names


def _hub_weight_files(repo_id: str, revision: str | None) -> tuple[Path, list[Path]]:
    """The weight files of a hub model in the Hugging Face cache, fetched if missing (the ones
    the target loads, which it would fetch next anyway)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError

    def fetch(name: str) -> Path:
        return Path(hf_hub_download(repo_id, name, revision=revision))

    try:
        for index_name, single, _ in _LAYOUTS:
            try:
                index = fetch(index_name)
            except EntryNotFoundError:  # none on the hub, or (offline) none in the cache
                pass
            else:
                return index.parent, [index, *(fetch(n) for n in _indexed_names(index))]
            try:
                weights = fetch(single)
            except EntryNotFoundError:
                continue
            return weights.parent, [weights]
    except HFValidationError:
        raise ConfigError(
            f"model.path={repo_id}: no such directory (and not a hub id); check the path."
        ) from None
    except (OSError, ValueError) as e:  # offline and not cached, gated, no such repo/revision
        raise ConfigError(
            f"model.path={repo_id}: cannot get its weights to fingerprint them "
            f"({type(e).__name__}); download it and set model.path to the directory."
        ) from None
    where = (
        "in the Hugging Face cache (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "on the hub"
    )
    raise ConfigError(
        f"model.path={repo_id}: no model.safetensors or pytorch_model.bin (nor an index of "
        f"them) {where} at revision {revision or 'main'}; download it and set model.path to "
        "the directory."
    )


def file_digests(files: list[Path], cache_dir: Path) -> dict[Path, tuple[str, int]]:
    """Each file's xxh3-128 digest and size: from the cache where its identity is unchanged,
    otherwise read (several files at once) and cached."""
    digests: dict[Path, tuple[str, int]] = {}
    to_read: list[tuple[Path, os.stat_result]] = []
    for path in files:
        stat = _stat(path)
        cached = _cached_digest(cache_dir, path, stat)
        if cached is None:
            to_read.append((path, stat))
        else:
            digests[path] = cached, stat.st_size
    if not to_read:
        log.debug("target weights: %d files, every digest cached in %s", len(files), cache_dir)
        return digests
    total = sum(stat.st_size for _, stat in to_read)
    if total >= ANNOUNCE_BYTES:
        log.info(
            "hashing %.1f GB of target weights in %d files, once: later runs find their digests "
            "in %s",
            total / 1e9, len(to_read), cache_dir / CACHE_SUBDIR,
        )  # fmt: skip
    start = time.perf_counter()
    with ThreadPoolExecutor(min(len(to_read), os.cpu_count() or 1, MAX_READERS)) as pool:
        read = list(pool.map(lambda item: (item[0], _read_digest(*item)), to_read))
    seconds = time.perf_counter() - start
    unwritable = None
    for path, (digest, stat) in read:
        digests[path] = digest, stat.st_size
        if unwritable is None and time.time() - max(stat.st_mtime, stat.st_ctime) >= SETTLE_S:
            unwritable = _store_digest(cache_dir, path, stat, digest)
    if unwritable:
        log.warning(
            "cannot cache the target weights' digests in %s (%s): each run reads them again",
            cache_dir / CACHE_SUBDIR, unwritable,
        )  # fmt: skip
    log.info(
        "target weights: read %.2f GB from %d/%d files in %.1f s (%.2f GB/s) to fingerprint them",
        total / 1e9, len(to_read), len(files), seconds, total / 1e9 / max(seconds, 1e-9),
    )  # fmt: skip
    return digests


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the target's weights ({e.strerror}).") from None


def _identity(path: Path, stat: os.stat_result) -> dict[str, Any]:
    return {
        "path": os.path.realpath(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
        "ino": stat.st_ino,
        "dev": stat.st_dev,
    }


def _read_digest(path: Path, before: os.stat_result) -> tuple[str, os.stat_result]:
    """xxh3-128 of the file's bytes, and its stat; ConfigError if it changed while read."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(BLOCK_BYTES)
    view = memoryview(buffer)
    try:
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while count := f.readinto(buffer):
                digest.update(view[:count])
            after = os.fstat(f.fileno())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the target's weights ({e.strerror}).") from None
    if _identity(path, after) != _identity(path, before):
        raise ConfigError(
            f"{path} changed while its fingerprint was taken: something is writing the target's "
            "weights; run again once it is done."
        )
    return digest.hexdigest(), after


def _entry_path(cache_dir: Path, path: Path) -> Path:
    key = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32]
    return cache_dir / CACHE_SUBDIR / f"{key}.json"


def _entry_checksum(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _cached_digest(cache_dir: Path, path: Path, stat: os.stat_result) -> str | None:
    """The cached digest of ``path`` if its entry is whole and of this identity; else None
    (a damaged or stale entry is read over, never trusted)."""
    entry = _entry_path(cache_dir, path)
    try:
        record = json.loads(entry.read_bytes())
        fields = record["fields"]
        whole = record["sha256"] == _entry_checksum(fields)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.debug("ignoring the damaged fingerprint cache entry %s (%s)", entry, e)
        return None
    expected = {**_identity(path, stat), "algorithm": ALGORITHM, "version": ENTRY_VERSION}
    if not whole or {k: fields.get(k) for k in expected} != expected:
        log.debug("fingerprint cache entry %s is damaged or of another file state", entry)
        return None
    digest = fields.get("digest")
    return digest if isinstance(digest, str) and len(digest) == 32 else None


def _store_digest(cache_dir: Path, path: Path, stat: os.stat_result, digest: str) -> str | None:
    """Cache ``digest``; why it could not be (None when it was)."""
    fields = {**_identity(path, stat), "algorithm": ALGORITHM, "version": ENTRY_VERSION}
    fields["digest"] = digest
    entry = _entry_path(cache_dir, path)
    text = json.dumps({"fields": fields, "sha256": _entry_checksum(fields)}) + "\n"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(entry) as tmp:
            tmp.write_text(text)
    except (OSError, DiskFull) as e:
        return str(e)
    return None
