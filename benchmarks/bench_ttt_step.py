"""Throughput and memory of one TTT training step (forward + backward), offline-style inputs.

    .venv/bin/python benchmarks/bench_ttt_step.py [--steps 3] [--shapes small,medium]

Random aux states and teacher stand in for the target (its cost is not measured here); every
position is supervised. Prints a table and one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.draft.ttt import (
    Teacher,
    TTTBatch,
    count_positions,
    step_weights,
    ttt_forward,
    weighted_loss,
)

SHAPES = {
    # name: (hidden, vocab, draft vocab, seq)
    "small": (256, 32000, 8000, 512),
    "medium": (256, 32000, 8000, 2048),
    "large_vocab": (512, 128256, 32000, 1024),
}


def make_inputs(
    hidden: int, vocab: int, draft_vocab: int, seq: int
) -> tuple[Eagle3Draft, TTTBatch]:
    arch = DraftArchitecture(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4 * seq,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=hidden,
        aux_layer_ids=[1, 2, 3],
    )
    generator = torch.Generator().manual_seed(0)
    draft = Eagle3Draft(arch)
    draft.init_weights(0.02, generator)
    ids = torch.arange(draft_vocab) * (vocab // draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(draft_vocab), t2d)
    input_ids = ids[torch.randint(0, draft_vocab, (1, seq), generator=generator)]
    teacher = Teacher(
        probs_BTW=torch.softmax(torch.randn(1, seq, draft_vocab, generator=generator), dim=-1),
        target_ids_BT=input_ids.roll(-1, dims=1),
        in_draft_BT=torch.ones(1, seq, dtype=torch.bool),
    )
    batch = TTTBatch(
        input_ids_BT=input_ids,
        valid_BT=torch.ones(1, seq, dtype=torch.bool),
        loss_mask_BT=torch.ones(1, seq, dtype=torch.bool),
        aux_BTA=torch.randn(1, seq, 3 * hidden, generator=generator),
        teacher=teacher,
    )
    return draft, batch


def bench(name: str, steps: int, ttt_length: int) -> dict[str, float | str | int]:
    hidden, vocab, draft_vocab, seq = SHAPES[name]
    draft, batch = make_inputs(hidden, vocab, draft_vocab, seq)
    weights = step_weights(ttt_length, 0.8)
    counts = count_positions(batch, ttt_length)

    def step() -> None:
        draft.zero_grad(set_to_none=True)
        weighted_loss(ttt_forward(draft, batch, ttt_length), counts, weights).backward()

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - start) / steps
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {
        "bench": "ttt_step",
        "shape": name,
        "attention": "eager",
        "hidden": hidden,
        "vocab": vocab,
        "draft_vocab": draft_vocab,
        "seq": seq,
        "ttt_length": ttt_length,
        "threads": torch.get_num_threads(),
        "tokens_per_s": round(seq / seconds, 1),
        "seconds_per_step": round(seconds, 3),
        "peak_rss_gib": round(peak_rss_gib, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--shapes", default="small", help=f"comma-separated, from {sorted(SHAPES)}")
    args = parser.parse_args()
    rows = [bench(name, args.steps, args.ttt_length) for name in args.shapes.split(",")]
    print(
        f"{'shape':<12} {'seq':>6} {'vocab':>7} {'draft':>6} {'tok/s':>8} {'s/step':>7} {'RSS GiB':>8}"
    )
    for r in rows:
        print(
            f"{r['shape']:<12} {r['seq']:>6} {r['vocab']:>7} {r['draft_vocab']:>6} "
            f"{r['tokens_per_s']:>8} {r['seconds_per_step']:>7} {r['peak_rss_gib']:>8}"
        )
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
