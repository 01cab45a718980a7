"""The target's weights fingerprint: what the first hash of a target costs (cache miss: every
byte read) and what every later one costs (cache hit: a stat per file), on the bundled
SmolLM2-135M (a copy of its converted directory, in the scratch directory) and, with
--synthetic-gb, on synthetic weights of that size; and the candidate hashes' speed on bytes
already in memory.

    python benchmarks/fingerprint.py --json
    python benchmarks/fingerprint.py --synthetic-gb 16 --json   # writes 16 GB, then deletes it
    python benchmarks/fingerprint.py --synthetic-gb 16 --synthetic-files 4 --skip-smollm2 --json

Each subject is hashed three ways, each with its own fresh digest cache:

- cold miss: the file's pages are first dropped from the page cache (posix_fadvise DONTNEED
  after an fsync: no root needed), so the bytes come from the disk;
- warm miss: hashed again at once, reading from the page cache what still is in it;
- hit: the digests are cached (median of 5).

``resident`` is the share of the file's pages in the page cache just before a read (mincore),
so each figure says where its bytes came from. The synthetic weights are random-ish bytes
(``write_synthetic``), in one file or, with --synthetic-files, in shards read at once.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from eagleforge import fingerprint
from eagleforge.files import resolve_cache_dir
from eagleforge.targets.source import bundled_smollm2_dir

BLOCK = 64 << 20
POOL = 256 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--synthetic-gb", type=float, default=0.0, help="also hash a synthetic file this big"
    )
    p.add_argument("--synthetic-files", type=int, default=1, help="in this many shards")
    p.add_argument("--dir", default=None, help="where to write it (default: the temp dir)")
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]  # fmt: skip
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident(paths: list[Path]) -> float:
    """The share of the files' pages in the page cache (mincore over a read-only mapping)."""
    page, in_cache, total = mmap.PAGESIZE, 0, 0
    for path in paths:
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                pages = (size + page - 1) // page
                vector = (ctypes.c_ubyte * pages)()
                if _LIBC.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                in_cache += int((np.frombuffer(vector, dtype=np.uint8) & 1).sum())
                total += pages
            finally:
                _LIBC.munmap(address, size)
        finally:
            os.close(fd)
    return in_cache / max(total, 1)


def drop_from_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = call()
    return time.perf_counter() - start, value


def measure(name: str, model_dir: Path, scratch: Path) -> dict[str, Any]:
    """Cold miss, warm miss and hit of ``model_dir``'s fingerprint."""
    _, files = fingerprint.weight_files(model_dir)
    size = sum(p.stat().st_size for p in files)
    rows: dict[str, Any] = {"subject": name, "files": len(files), "gb": round(size / 1e9, 3)}
    for kind in ("cold_miss", "warm_miss"):
        cache = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=scratch))
        if kind == "cold_miss":
            drop_from_page_cache(files)
        before = resident(files)
        seconds, value = timed(
            lambda cache=cache: fingerprint.weights_fingerprint(model_dir, cache)
        )
        rows[kind] = {
            "s": round(seconds, 3),
            "gb_per_s": round(size / 1e9 / seconds, 2),
            "resident": round(before, 3),
        }
    hits = [timed(lambda: fingerprint.weights_fingerprint(model_dir, cache))[0] for _ in range(5)]
    rows["hit"] = {"ms": round(statistics.median(hits) * 1e3, 2)}
    rows["fingerprint"] = value
    return rows


def write_synthetic(model_dir: Path, gigabytes: float, num_files: int) -> None:
    """``gigabytes`` of random-ish bytes in ``num_files`` shards (with an index mapping a
    tensor to each, as a sharded checkpoint has), written and fsynced: 64 MiB blocks cut from
    a 256 MiB pool of random bytes, each block starting with its own number, so that no two
    blocks are equal and nothing compresses."""
    pool = np.random.default_rng(0).bytes(POOL)
    model_dir.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]
    block_number = 0
    for name in names:
        left = int(gigabytes * 1e9 / num_files)
        with open(model_dir / name, "wb", buffering=0) as f:
            while left > 0:
                start = block_number * BLOCK % POOL
                block = bytearray(pool[start : start + min(BLOCK, left)])
                block[:8] = block_number.to_bytes(8, "little")
                f.write(block)
                left -= len(block)
                block_number += 1
            os.fsync(f.fileno())
    if num_files > 1:
        index = {"weight_map": {f"tensor_{i}": name for i, name in enumerate(names)}}
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def in_memory_speeds() -> dict[str, float]:
    """GB/s of each candidate hash over 256 MiB already in memory (best of 3)."""
    data = memoryview(np.random.default_rng(1).bytes(256 << 20))
    candidates: dict[str, Callable[[], Any]] = {
        "sha256": hashlib.sha256,
        "blake2b": hashlib.blake2b,
        "xxh3_128": xxhash.xxh3_128,
        "xxh64": xxhash.xxh64,
    }
    try:  # optional: pip install blake3
        import blake3

        candidates["blake3"] = blake3.blake3
        candidates["blake3_threads"] = lambda: blake3.blake3(max_threads=blake3.blake3.AUTO)
    except ImportError:
        pass
    speeds = {}
    for name, make in candidates.items():
        best = float("inf")
        for _ in range(3):
            digest = make()
            start = time.perf_counter()
            for offset in range(0, len(data), 16 << 20):
                digest.update(data[offset : offset + (16 << 20)])
            digest.digest()
            best = min(best, time.perf_counter() - start)
        speeds[name] = round(len(data) / 1e9 / best, 2)
    return speeds


def main() -> None:
    args = parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="fingerprint-bench-", dir=args.dir))
    subjects = []
    try:
        speeds = in_memory_speeds()
        if not args.skip_smollm2:
            # a copy: pages another process maps (a test loading the model) cannot be dropped
            copy = scratch / "smollm2"
            shutil.copytree(bundled_smollm2_dir(resolve_cache_dir(None)), copy)
            time.sleep(fingerprint.SETTLE_S)  # old enough to be cached
            subjects.append(measure("SmolLM2-135M (bundled, fp32)", copy, scratch))
        if args.synthetic_gb:
            synthetic, files = scratch / "synthetic", args.synthetic_files
            write_seconds, _ = timed(lambda: write_synthetic(synthetic, args.synthetic_gb, files))
            time.sleep(fingerprint.SETTLE_S)  # old enough to be cached
            name = f"synthetic {args.synthetic_gb:g} GB, {files} file{'s' * (files > 1)}"
            row = measure(name, synthetic, scratch)
            row["write_gb_per_s"] = round(args.synthetic_gb / write_seconds, 2)
            subjects.append(row)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cores, load = os.cpu_count(), os.getloadavg()[0]
    print(f"hash speed in memory (GB/s, one thread; {cores} cores, load {load:.1f}):")
    print("  " + "  ".join(f"{name} {speed}" for name, speed in speeds.items()))
    header = f"{'subject':<30} {'GB':>7} {'cold miss':>18} {'warm miss':>18} {'hit ms':>8}"
    print(header)
    for row in subjects:
        cold, warm = row["cold_miss"], row["warm_miss"]
        print(
            f"{row['subject']:<30} {row['gb']:>7} "
            f"{cold['s']:>7.2f} s {cold['gb_per_s']:>5.2f} GB/s "
            f"{warm['s']:>7.2f} s {warm['gb_per_s']:>5.2f} GB/s {row['hit']['ms']:>8}"
        )
        print(f"{'':<30} resident before: cold {cold['resident']:.0%}, warm {warm['resident']:.0%}")
    if args.json:
        print(json.dumps({"bench": "fingerprint", "cores": cores, "load": round(load, 1),
                          "in_memory_gb_per_s": speeds, "subjects": subjects}))  # fmt: skip


if __name__ == "__main__":
    main()
