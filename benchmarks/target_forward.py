"""Target backends: load time, forward throughput and peak memory of target=hf against
target=custom on the bundled SmolLM2-135M, for padded and packed batches.

    python benchmarks/target_forward.py --batch 4 --seq-len 512 --json

A forward here is what a training step asks of the target: aux states of three layers and the
final hidden state, no lm_head. Packed rows hold 4 documents each (a block-diagonal mask).
Load time is a second, warm load (imports done, files in the page cache).
Runs on CUDA when present (bf16), else on CPU (fp32, torch's thread count).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eagleforge.targets.config import TargetConfig
from eagleforge.targets.custom import CustomTarget
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.source import bundled_smollm2_dir


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "eagleforge"))
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def batches(batch: int, seq: int, device: torch.device) -> dict[str, tuple]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40000, (batch, seq), generator=generator).to(device)
    lengths = torch.linspace(seq, seq // 2, batch).long()
    padded = (torch.arange(seq) < lengths.unsqueeze(1)).to(device)
    documents = (torch.arange(seq) * 4 // seq).expand(batch, seq).to(device)
    positions = (torch.arange(seq) % (seq // 4)).expand(batch, seq).to(device)
    full = torch.ones_like(padded)
    return {
        "padded": (ids, padded, None, None),
        "packed": (ids, full, documents, positions),
    }


def measure(target, batch: tuple, repeats: int, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    target.forward(*batch)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        target.forward(*batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model_dir = bundled_smollm2_dir(args.cache_dir)
    loaders = {
        "hf": lambda: HFTarget.from_pretrained(model_dir, TargetConfig(), dtype, device),
        "custom": lambda: CustomTarget.from_pretrained(model_dir, dtype, device),
    }
    rows = []
    for backend, load in loaders.items():
        load()  # the first load pays for imports and a cold page cache; time the second
        start = time.perf_counter()
        target = load()
        load_s = time.perf_counter() - start
        for layout, batch in batches(args.batch, args.seq_len, device).items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            seconds = measure(target, batch, args.repeats, device)
            peak = round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None
            tokens = int(batch[1].sum())
            rows.append(
                {
                    "backend": backend,
                    "layout": layout,
                    "load_s": round(load_s, 2),
                    "ms": round(seconds * 1e3, 1),
                    "tokens_per_s": round(tokens / seconds),
                    "peak_mib": peak,
                }  # fmt: skip
            )
        del target
    print(f"SmolLM2-135M on {device} ({str(dtype).removeprefix('torch.')}), "
          f"batch {args.batch} x {args.seq_len}")  # fmt: skip
    print(f"{'backend':<8} {'layout':<7} {'load s':>7} {'ms/fwd':>8} {'tok/s':>9} {'peak MiB':>9}")
    for r in rows:
        print(f"{r['backend']:<8} {r['layout']:<7} {r['load_s']:>7} {r['ms']:>8} "
              f"{r['tokens_per_s']:>9} {r['peak_mib'] or '-':>9}")  # fmt: skip
    if args.json:
        print(json.dumps({"bench": "target_forward", "device": device.type, "batch": args.batch,
                          "seq_len": args.seq_len, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
