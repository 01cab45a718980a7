"""Throughput and memory of one draft training step on offline-style inputs.

    python benchmarks/ttt_step.py --hidden-size 256 --intermediate-size 896 --heads 4 \\
        --kv-heads 1 --vocab 32000 --draft-vocab 8000 --seq-len 512 --ttt-length 7 \\
        --steps 5 --dtype float32 --attention eager --json

Inputs are random but shaped like offline training: aux states [1, T, 3H], the target's final
hidden state and lm_head for the teacher, and the first ``--prompt-frac`` of each row
unsupervised (a prompt). A step is teacher + TTT forward + backward + AdamW. Prints a table;
with ``--json`` also one JSON line with median_step_s, tokens_per_s, peak_rss_mib, shape, the
step's matmul FLOPs per token and the achieved fraction of this machine's measured matmul rate
(in ``--dtype``).

The first step is timed apart (``first_step_s``: compilation with ``--compile`` or flex, and
warm-up), never averaged into the median. ``--loss-kernel triton`` runs the fused loss
kernels (CUDA), ``--master-dtype float32`` keeps fp32 weights under autocast as the trainer.

``--device cuda`` runs it on the GPU (the GPU check's 8B-shaped draft, scripts/gpu_check.py):

    python benchmarks/ttt_step.py --device cuda --dtype bfloat16 --hidden-size 4096 \\
        --intermediate-size 14336 --heads 32 --kv-heads 8 --vocab 128256 --draft-vocab 32000 \\
        --seq-len 2048 --attention sdpa --steps 10 --json

and adds peak_cuda_mib (torch.cuda.max_memory_allocated) and, where the device's dense peak is
known (``--peak-tflops`` or PEAK_TFLOPS by device name), mfu: the counted FLOPs per second over
that peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from eagleforge.batch import TTTBatch, shift_left
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.loss import LossConfig, LossKernel
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.draft.ttt import count_positions, loss_scales, step_weights, ttt_forward
from eagleforge.targets.teacher import compute_teacher


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=896)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--draft-vocab", type=int, default=8000)
    p.add_argument(
        "--seq-len", type=int_list, default=[512], help="T; a comma list runs each (8192,16384)"
    )
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after the warm-up steps)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed steps first (the first one compiles)"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--master-dtype",
        choices=["same", "float32"],
        default="same",
        help="float32: fp32 weights and optimizer state, compute autocast to --dtype (the "
        "trainer's optimizer.fp32_master); same: the weights in --dtype, no autocast",
    )
    p.add_argument(
        "--loss-kernel",
        type=lambda text: [LossKernel(k) for k in text.split(",")],
        default=[LossKernel.auto],
        help="loss.kernel: torch (chunked), triton (fused kernels, CUDA), auto; a comma list "
        "runs each",
    )
    p.add_argument(
        "--compile", action="store_true", help="draft.compile: the layer's regions compiled"
    )
    p.add_argument("--attention", choices=[b.value for b in AttentionBackend], default="eager")
    p.add_argument("--prompt-frac", type=float, default=0.25, help="unsupervised share of each row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense peak in --dtype for mfu (default: PEAK_TFLOPS by device name)",
    )
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


# Dense (no sparsity) bf16 tensor-core peaks from the vendor data sheets, TFLOP/s, by the first
# key that torch.cuda.get_device_name() contains (SXM unless named). MFU is only reported where
# the peak is known; --peak-tflops gives it for other devices.
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.4, "H100": 989.4, "A100": 312.0}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(
    dtype: torch.dtype, device: torch.device, size: int = 1024, repeats: int = 8
) -> float:
    """This machine's sustained rate for a square matmul, GFLOP/s."""
    if device.type == "cuda":
        size, repeats = 8192, 20  # big enough to fill the GPU
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def peak_tflops(args: argparse.Namespace, device: torch.device) -> float | None:
    """The device's dense peak for mfu: --peak-tflops, else PEAK_TFLOPS for a bf16 GPU run."""
    if args.peak_tflops is not None:
        return float(args.peak_tflops)
    if device.type != "cuda" or args.dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def step_flops_per_token(args: argparse.Namespace, t: int, counted_frac: float) -> float:
    """Useful matmul FLOPs of one step per input token: forward x3 for backward, the teacher
    forward only; ``counted_frac`` is the share of positions where the lm_head and loss run.
    Work recomputed in backward (``--recompute-mlp``) is not counted as useful."""
    h, i, k = args.hidden_size, args.intermediate_size, args.ttt_length
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
    for t in args.seq_len:  # each measured apart; one that runs out of memory is said so
        for kernel in args.loss_kernel:
            try:
                measure(args, t, kernel)
            except torch.OutOfMemoryError as error:
                print(json.dumps({"bench": "ttt_step", "seq_len": t, "out_of_memory": str(error)}))
                raise SystemExit(1) from None


def measure(args: argparse.Namespace, t: int, kernel: LossKernel) -> None:
    """One shape and loss kernel: build, warm up, time; print the table line and JSON."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    h = args.hidden_size
    arch = DraftArchitecture(
        hidden_size=h, intermediate_size=args.intermediate_size, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=h // args.heads, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=4 * t, vocab_size=args.vocab,
        draft_vocab_size=args.draft_vocab, target_hidden_size=h, aux_layer_ids=[1, 2, 3],
    )  # fmt: skip
    with device:  # built and initialised where it runs: an 8B-shaped draft is 1.8 GB
        draft = Eagle3Draft(arch, recompute_mlp=args.recompute_mlp)
        draft.init_weights(0.02)
    draft_ids = torch.sort(torch.randperm(args.vocab)[: args.draft_vocab]).values
    t2d = torch.zeros(args.vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    draft.set_vocab_map(draft_ids - torch.arange(args.draft_vocab), t2d)
    autocast = args.master_dtype == "float32" and dtype != torch.float32
    draft.to(device=device, dtype=torch.float32 if autocast else dtype)
    loss = LossConfig(kernel=kernel)
    loss_kernel = loss.kernel_for(device)
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
    input_ids, loss_mask, valid, aux, final_hidden, lm_head, draft_ids, t2d = (
        x.to(device)
        for x in (input_ids, loss_mask, valid, aux, final_hidden, lm_head, draft_ids, t2d)
    )
    if document_ids is not None and position_ids is not None:
        document_ids, position_ids = document_ids.to(device), position_ids.to(device)
    weights = step_weights(args.ttt_length, 0.8, device)

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
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            stats = ttt_forward(
                draft, batch, args.ttt_length, scale_k, attention=AttentionBackend(args.attention),
                compile=args.compile, loss=loss,
            )  # fmt: skip
        stats.loss.backward()
        optimizer.step()
        synchronize(device)
        return time.perf_counter() - start

    # the first step apart: compilation (flex, --compile) and autotuning happen in it
    warmup_s = [step() for _ in range(max(1, args.warmup))]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = statistics.median(step() for _ in range(args.steps))
    batch = make_batch()
    counts = count_positions(batch, args.ttt_length)
    counted_frac = float(counts.float().mean()) / t
    flops = step_flops_per_token(args, t, counted_frac)
    peak_cuda_mib = None
    if device.type == "cuda":
        peak_cuda_mib = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    rate = matmul_gflops(dtype, device)
    peak = peak_tflops(args, device)
    result = {
        "bench": "ttt_step",
        "seq_len": t,
        "shape": f"h{h}-v{args.vocab}-dv{args.draft_vocab}-t{t}"
        + ("-packed" if args.packing else ""),
        "attention": args.attention,
        "loss_kernel": loss_kernel.value,
        "compile": args.compile,
        "recompute_mlp": args.recompute_mlp,
        "dtype": args.dtype,
        "master_dtype": "float32" if autocast else args.dtype,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": args.threads,
        "first_step_s": round(warmup_s[0], 3),
        "median_step_s": round(seconds, 4),
        "tokens_per_s": round(t / seconds, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "mflops_per_token": round(flops / 1e6, 1),
        "matmul_gflops": round(rate, 1),
        "fraction_of_matmul_rate": round(flops * t / seconds / (rate * 1e9), 3),
    }
    if peak_cuda_mib is not None:
        result["peak_cuda_mib"] = peak_cuda_mib
    if peak is not None:
        result["peak_tflops"] = peak
        result["achieved_tflops"] = round(flops * t / seconds / 1e12, 1)
        result["mfu"] = round(flops * t / seconds / (peak * 1e12), 3)
    print(
        f"{'shape':<26} {'attention':<9} {'s/step':>8} {'tok/s':>8} {'RSS MiB':>8} {'MFLOP/tok':>10} {'of peak':>8}"
    )
    print(
        f"{result['shape']:<26} {args.attention:<9} {result['median_step_s']:>8} {result['tokens_per_s']:>8} "
        f"{result['peak_rss_mib']:>8} {result['mflops_per_token']:>10} {result['fraction_of_matmul_rate']:>8.1%}"
    )
    print(f"first step {result['first_step_s']} s (compilation and warm-up included)")
    if peak_cuda_mib is not None:
        mfu = f", MFU {result['mfu']:.1%} of {peak:g} TFLOP/s" if peak is not None else ""
        print(f"peak CUDA memory {peak_cuda_mib} MiB{mfu}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
