"""Throughput and memory of one DFlash training step, by anchors per sequence.

    python benchmarks/dflash_step.py --hidden-size 576 --heads 9 --kv-heads 3 --head-dim 64 \\
        --intermediate-size 1536 --vocab 49152 --layers 2 --block-size 8 --seq-len 256 \\
        --batch 8 --anchors 8,32,64 --steps 3 --json

Inputs are random but shaped like offline training: the taps [B, T, 3H], every position
supervised, the target's lm_head [V, H] frozen in ``--dtype``. A step is the blocks' forward
(context keys and values, the block attention, the chunked full-vocabulary cross-entropy),
backward and AdamW, in fp32 weights under ``--dtype`` autocast. Prints a table; with ``--json``
one JSON line per anchor count with median_step_s, supervised slots per second, tokens per
second and peak_rss_mib. The cross-entropy rows grow with anchors x (block size - 1): at
SmolLM2's shape they are most of the step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from eagleforge.batch import BlockBatch
from eagleforge.draft.dflash import (
    DFlashArchitecture,
    DFlashDraft,
    block_forward,
    block_loss_scales,
    block_weights,
    count_block_positions,
    select_anchors,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--anchors", default="8,32,64", help="anchors per sequence, comma-separated")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    arch = DFlashArchitecture(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, vocab_size=args.vocab,
        target_hidden_size=args.hidden_size, num_target_layers=30, aux_layer_ids=[1, 14, 26],
        block_size=args.block_size, mask_token_id=16,
    )  # fmt: skip
    dtype = getattr(torch, args.dtype)
    draft = DFlashDraft(arch)
    draft.init_weights(0.02)
    embed = (torch.randn(args.vocab, args.hidden_size) * 0.02).to(dtype)
    draft.set_target_weights(embed, embed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    batch = BlockBatch(
        input_ids_BT=ids,
        valid_BT=torch.ones_like(ids, dtype=torch.bool),
        loss_mask_BT=torch.ones_like(ids, dtype=torch.bool),
        aux_BTA=torch.randn(args.batch, args.seq_len, 3 * args.hidden_size).to(dtype),
    )
    weights = block_weights(args.block_size, 4.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    rows = []
    candidates = torch.ones_like(ids, dtype=torch.bool)
    candidates[:, -1] = False
    for anchors in (int(a) for a in args.anchors.split(",")):
        batch.anchors_BN = select_anchors(candidates, anchors, torch.Generator().manual_seed(0))
        scales = block_loss_scales(count_block_positions(batch, args.block_size), weights)
        times = []
        for _ in range(args.steps + 1):  # the first is warm-up
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                stats = block_forward(draft, batch, scales)
            stats.loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times[1:])
        slots = int(stats.num_counted_k.sum())
        row = {
            "benchmark": "dflash_step",
            "anchors": anchors,
            "block_size": args.block_size,
            "layers": args.layers,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "dtype": args.dtype,
            "median_step_s": round(step_s, 4),
            "slots_per_s": round(slots / step_s, 1),
            "tokens_per_s": round(args.batch * args.seq_len / step_s, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
        rows.append(row)
    print(f"DFlash step, {args.layers} layers, block {args.block_size}, batch {args.batch} x "
          f"{args.seq_len}, vocab {args.vocab}, {args.dtype}")  # fmt: skip
    print(f"{'anchors':>8} {'step s':>8} {'slots/s':>9} {'tokens/s':>9} {'peak RSS MiB':>13}")
    for row in rows:
        print(
            f"{row['anchors']:>8} {row['median_step_s']:>8.3f} {row['slots_per_s']:>9.0f} "
            f"{row['tokens_per_s']:>9.0f} {row['peak_rss_mib']:>13.0f}"
        )
    if args.json:
        for row in rows:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
