"""Feature store: bytes per token, write speed and random-sample read speed, against one
``torch.save`` file per sample (the layout of the peer's offline mode).

    python benchmarks/feature_store.py --samples 2000 --hidden-size 1024 --json

Samples are random hidden states of realistic lengths (log-normal, median 400 tokens) in
bf16, as a GPU capture would store them. Reads pick samples in a random order and touch every
value of the sample (a sum), as a training step would. Each store is written to a fresh
directory under --dir; the page cache is not dropped (no root), so reads are warm for both.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eagleforge.data.features import (
    Compression,
    FeatureDataset,
    Manifest,
    write_shard,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--samples-per-shard", type=int, default=256)
    p.add_argument("--reads", type=int, default=500)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def make_samples(
    n: int, hidden: int
) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for index in range(n):
        length = int(
            min(2048, max(16, torch.exp(torch.randn((), generator=generator) * 0.7).item() * 400))
        )
        samples.append(
            (
                index,
                torch.randint(0, 32000, (length,), generator=generator),
                torch.ones(length, dtype=torch.uint8),
                torch.randn(length, 3 * hidden, generator=generator).to(torch.bfloat16),
                torch.randn(length, hidden, generator=generator).to(torch.bfloat16),
            )
        )
    return samples


def write_ours(root: Path, samples: list, per_shard: int, compress: Compression) -> float:  # type: ignore[type-arg]
    root.mkdir(parents=True)
    start = time.perf_counter()
    shards = -(-len(samples) // per_shard)
    Manifest(
        target="bench", weight_hash="-", vocab_size=32000, hidden_size=samples[0][4].shape[1],
        aux_layer_ids=[1, 2, 3], template="auto", max_length=2048, data_key="bench",
        dtype="bfloat16", samples_per_shard=per_shard, num_samples=len(samples),
        num_shards=shards, compress=compress.value,
    ).write(root)  # fmt: skip
    for shard in range(shards):
        write_shard(root, shard, samples[shard * per_shard : (shard + 1) * per_shard], [], compress)
    return time.perf_counter() - start


def write_baseline(root: Path, samples: list) -> float:  # type: ignore[type-arg]
    root.mkdir(parents=True)
    start = time.perf_counter()
    for index, ids, mask, aux, final in samples:
        torch.save(
            {"input_ids": ids, "loss_mask": mask, "aux_hidden_states": aux, "hidden_states": final},
            root / f"data_{index}.ckpt",
        )
    return time.perf_counter() - start


def read_ours(root: Path, order: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    dataset = FeatureDataset(root)
    tokens = 0
    for index in order:
        _, _, aux, final = dataset[index]
        tokens += len(aux)
        float(aux.float().sum()) + float(final.float().sum())
    return time.perf_counter() - start, tokens


def read_baseline(root: Path, order: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = 0
    for index in order:
        data = torch.load(root / f"data_{index}.ckpt", weights_only=True)
        tokens += len(data["aux_hidden_states"])
        float(data["aux_hidden_states"].float().sum()) + float(data["hidden_states"].float().sum())
    return time.perf_counter() - start, tokens


def size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file())


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    base = Path(args.dir or tempfile.mkdtemp(prefix="feature-bench-"))
    samples = make_samples(args.samples, args.hidden_size)
    tokens = sum(len(s[1]) for s in samples)
    order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(1))[
        : args.reads
    ].tolist()
    rows = []
    try:
        for name, write, read in (
            ("torch.save per sample", lambda r: write_baseline(r, samples), read_baseline),
            (
                "eagleforge",
                lambda r: write_ours(r, samples, args.samples_per_shard, Compression.none),
                read_ours,
            ),
            (
                "eagleforge fp8",
                lambda r: write_ours(r, samples, args.samples_per_shard, Compression.fp8),
                read_ours,
            ),
        ):
            root = base / name.replace(" ", "_").replace(".", "_")
            write_s = write(root)
            read_s, read_tokens = read(root, order)
            rows.append(
                {
                    "store": name,
                    "bytes_per_token": round(size(root) / tokens, 1),
                    "write_tokens_per_s": round(tokens / write_s),
                    "random_read_tokens_per_s": round(read_tokens / read_s),
                }
            )
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{args.samples} samples, {tokens:,} tokens, hidden {args.hidden_size}, bf16 capture")
    print(f"{'store':<24} {'bytes/token':>12} {'write tok/s':>12} {'random read tok/s':>18}")
    for row in rows:
        print(
            f"{row['store']:<24} {row['bytes_per_token']:>12} {row['write_tokens_per_s']:>12,} {row['random_read_tokens_per_s']:>18,}"
        )
    if args.json:
        print(json.dumps({"bench": "feature_store", "samples": args.samples, "tokens": tokens,
                          "hidden_size": args.hidden_size, "stores": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
