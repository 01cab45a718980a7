"""Throughput and memory of one draft training step on offline-style inputs.

    python benchmarks/ttt_step.py --hidden-size 256 --intermediate-size 896 --heads 4 \\
        --kv-heads 1 --vocab 32000 --draft-vocab 8000 --seq-len 512 --ttt-length 7 \\
        --steps 5 --dtype float32 --attention eager --json

Inputs are random but shaped like offline training: aux states [1, T, 3H], the target's final
hidden state and lm_head for the teacher, and the first ``--prompt-frac`` of each row
unsupervised (a prompt). A step is teacher + TTT forward + backward + AdamW. Prints a table;
with ``--json`` also one JSON line with median_step_s, tokens_per_s, peak_rss_mib, shape, the
step's matmul FLOPs per token and the achieved fraction of this machine's measured fp32
matmul rate.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from eagleforge.draft.model import AttentionBackend, DraftArchitecture, Eagle3Draft
from eagleforge.draft.ttt import (
    TTTBatch,
    count_positions,
    loss_scales,
    shift_left,
    step_weights,
    ttt_forward,
)
from eagleforge.target.teacher import compute_teacher


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=896)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--draft-vocab", type=int, default=8000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--attention", choices=[b.value for b in AttentionBackend], default="eager")
    p.add_argument("--prompt-frac", type=float, default=0.25, help="unsupervised share of each row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--recompute-mlp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draft.recompute_mlp: recompute each step's MLP in backward (the default)",
    )
    p.add_argument(
        "--packing",
        action="store_true",
        help="pack conversations of mixed lengths (log-normal, median ~T/6) into the row",
    )
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    return p.parse_args()


def matmul_gflops(dtype: torch.dtype, size: int = 1024, repeats: int = 8) -> float:
    """This machine's sustained rate for a square matmul, GFLOP/s."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def step_flops_per_token(args: argparse.Namespace, counted_frac: float) -> float:
    """Useful matmul FLOPs of one step per input token: forward x3 for backward, the teacher
    forward only; ``counted_frac`` is the share of positions where the lm_head and loss run.
    Work recomputed in backward (``--recompute-mlp``) is not counted as useful."""
    h, i, t, k = args.hidden_size, args.intermediate_size, args.seq_len, args.ttt_length
    d = h // args.heads
    q_width, kv_width = args.heads * d, args.kv_heads * d
    fc = 2 * 3 * h * h
    layer = 2 * 2 * h * (q_width + 2 * kv_width) + 2 * q_width * h + 2 * 3 * h * i
    # useful attention work: causal step-0 keys (t/2 on average) plus i diagonal keys
    attention = sum(4 * q_width * (t / 2 + step) for step in range(k))
    lm_head = 2 * h * args.draft_vocab * counted_frac
    draft_forward = fc + k * (layer + lm_head) + attention
    teacher = 2 * h * args.vocab * (1 - args.prompt_frac)
    return 3 * draft_forward + teacher


def pack_lengths(total: int, seed: int = 0) -> list[int]:
    """Conversation lengths of a realistic mix (log-normal, median total/6) filling ``total``."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(torch.exp(torch.randn((), generator=generator) * 0.8).item() * total / 6)
        lengths.append(min(max(16, n), total - sum(lengths)))
    return lengths


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    h, t = args.hidden_size, args.seq_len
    arch = DraftArchitecture(
        hidden_size=h, intermediate_size=args.intermediate_size, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=h // args.heads, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=4 * t, vocab_size=args.vocab,
        draft_vocab_size=args.draft_vocab, target_hidden_size=h, aux_layer_ids=[1, 2, 3],
    )  # fmt: skip
    draft = Eagle3Draft(arch, recompute_mlp=args.recompute_mlp)
    draft.init_weights(0.02)
    draft_ids = torch.sort(torch.randperm(args.vocab)[: args.draft_vocab]).values
    t2d = torch.zeros(args.vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    draft.set_vocab_map(draft_ids - torch.arange(args.draft_vocab), t2d)
    draft.to(dtype)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)

    input_ids = draft_ids[torch.randint(0, args.draft_vocab, (1, t))]
    document_ids = position_ids = None
    loss_mask = torch.ones(1, t, dtype=torch.bool)
    if args.packing:
        lengths = pack_lengths(t)
        document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
        position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        loss_mask = position_ids >= (
            args.prompt_frac * torch.tensor(lengths).repeat_interleave(torch.tensor(lengths))
        )
    else:
        loss_mask[:, : int(args.prompt_frac * t)] = False
    valid = torch.ones(1, t, dtype=torch.bool)
    aux = torch.randn(1, t, 3 * h, dtype=dtype)
    final_hidden = torch.randn(1, t, h, dtype=dtype)
    lm_head = torch.randn(args.vocab, h, dtype=dtype) * 0.05
    # As with a real vocab map, the target's argmax is nearly always a draft-vocab token.
    lm_head[draft_ids] *= 4
    weights = step_weights(args.ttt_length, 0.8)

    def make_batch() -> TTTBatch:
        """The teacher (through the target lm_head, where a next token is supervised) + inputs."""
        needed = shift_left(loss_mask, 1)
        teacher = compute_teacher(final_hidden, lm_head, draft_ids, t2d, needed_BT=needed)
        return TTTBatch(input_ids, valid, loss_mask, aux, teacher, document_ids, position_ids)

    def step() -> float:
        start = time.perf_counter()
        batch = make_batch()
        optimizer.zero_grad(set_to_none=True)
        scale_k = loss_scales(count_positions(batch, args.ttt_length), weights)
        stats = ttt_forward(
            draft, batch, args.ttt_length, scale_k, attention=AttentionBackend(args.attention)
        )
        stats.loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    step()  # warm-up
    seconds = statistics.median(step() for _ in range(args.steps))
    batch = make_batch()
    counts = count_positions(batch, args.ttt_length)
    counted_frac = float(counts.float().mean()) / t
    flops = step_flops_per_token(args, counted_frac)
    rate = matmul_gflops(dtype)
    result = {
        "bench": "ttt_step",
        "shape": f"h{h}-v{args.vocab}-dv{args.draft_vocab}-t{t}"
        + ("-packed" if args.packing else ""),
        "attention": args.attention,
        "recompute_mlp": args.recompute_mlp,
        "dtype": args.dtype,
        "threads": args.threads,
        "median_step_s": round(seconds, 4),
        "tokens_per_s": round(t / seconds, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "mflops_per_token": round(flops / 1e6, 1),
        "matmul_gflops": round(rate, 1),
        "fraction_of_matmul_rate": round(flops * t / seconds / (rate * 1e9), 3),
    }
    print(
        f"{'shape':<26} {'attention':<9} {'s/step':>8} {'tok/s':>8} {'RSS MiB':>8} {'MFLOP/tok':>10} {'of peak':>8}"
    )
    print(
        f"{result['shape']:<26} {args.attention:<9} {result['median_step_s']:>8} {result['tokens_per_s']:>8} "
        f"{result['peak_rss_mib']:>8} {result['mflops_per_token']:>10} {result['fraction_of_matmul_rate']:>8.1%}"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
