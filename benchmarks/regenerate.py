"""Regeneration on the bundled SmolLM2-135M: how fast the target writes Magpie prompts and
answers them, batched against one at a time, in this process (hf backend) and through the vLLM
engine (vllm backend, ``--vllm``: the engine of ``make vllm``), side by side in one run.

    python benchmarks/regenerate.py --prompts 128 --batch-sizes 1,32,128 --vllm --json

Two parts, each timed once (after one short warm-up generation):
- **prompts**: Magpie's nucleus sampling from the user header (``sample_continuations``, the
  top 256 tokens a row) against transformers' ``generate(do_sample=True, top_p=...)``, which
  sorts the whole vocabulary of every row at every step; one batch of ``--prompts`` rows.
- **answers**: the hf backend answering the same prompts, ``--batch-sizes`` at a time (a
  batch of 1 answers only the first ``--single-prompts``, as it is slow).
- with ``--vllm``, both again through vLLM: ``--prompts`` Magpie requests in flight, then the
  answers with each batch size's number of requests in flight (continuous batching). The
  engine's start (compile warm-up) is reported apart, not in tokens/s.

Tokens are counted up to each row's end (what lands in the data), so padding and rows that
run on after their end cost time but count nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagleforge.engine.client import SERVED_NAME
from eagleforge.engine.config import VLLMConfig
from eagleforge.engine.server import VLLMServer
from eagleforge.regeneration.backends import HFBackend, VLLMBackend
from eagleforge.regeneration.config import Backend, MagpieConfig, RegenerateConfig
from eagleforge.regeneration.magpie import first_stop, sample_continuations, user_header
from eagleforge.regeneration.rows import RequestFailed
from eagleforge.targets.source import bundled_smollm2_dir


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=128, help="Magpie rows sampled together")
    p.add_argument("--prompt-tokens", type=int, default=64, help="magpie.max_new_tokens")
    p.add_argument("--batch-sizes", default="1,32,128", help="answer batch sizes to compare")
    p.add_argument("--answer-tokens", type=int, default=160, help="regenerate.max_new_tokens")
    p.add_argument("--single-prompts", type=int, default=4, help="prompts answered at batch 1")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "eagleforge"))
    p.add_argument("--vllm", action="store_true", help="also through the vLLM engine")
    p.add_argument("--vllm-eager", action="store_true", help="vllm.enforce_eager (starts faster)")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model_dir = bundled_smollm2_dir(args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    magpie = MagpieConfig(max_new_tokens=args.prompt_tokens)
    cfg = RegenerateConfig(backend=Backend.hf, max_new_tokens=args.answer_tokens)
    backend = HFBackend(cfg, model, tokenizer, torch.device("cpu"), "smollm2")
    header = tokenizer(user_header(tokenizer), return_tensors="pt", add_special_tokens=False)
    ids = header.input_ids.expand(args.prompts, -1)
    table: list[dict[str, object]] = []

    samplers = {
        "transformers generate, top_p": lambda: model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=magpie.max_new_tokens,
            do_sample=True,
            temperature=magpie.temperature,
            top_p=magpie.top_p,
            top_k=None,
            pad_token_id=tokenizer.pad_token_id,
        )[:, ids.shape[1] :],
        "magpie nucleus (top 256)": lambda: sample_continuations(
            model, ids, magpie, backend.stop_ids
        ),
    }
    prompts: list[str] = []
    with torch.no_grad():
        model.generate(
            ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=8
        )  # warm-up
        for name, sample in samplers.items():
            start = time.perf_counter()
            rows = sample().tolist()
            seconds = time.perf_counter() - start
            ends = [first_stop(row, backend.stop_ids) for row in rows]
            tokens = sum(e for e in ends if e is not None)
            table.append(
                {
                    "part": "prompts",
                    "how": name,
                    "batch": args.prompts,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "ended": sum(e is not None for e in ends) / len(ends),
                }
            )
            if not prompts:
                prompts = [
                    tokenizer.decode(r[:e]).strip() for r, e in zip(rows, ends, strict=True) if e
                ]

    histories = [[{"role": "user", "content": p}] for p in prompts]
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        cfg.batch_size = batch
        todo = histories[: args.single_prompts] if batch == 1 else histories
        start = time.perf_counter()
        replies = backend(todo)
        seconds = time.perf_counter() - start
        tokens = sum(len(tokenizer(r.content).input_ids) for r in replies)  # type: ignore[union-attr]
        table.append(
            {
                "part": "answers",
                "how": f"hf backend, batches of {batch}",
                "batch": batch,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "ended": None,
            }
        )

    if args.vllm:
        table += through_vllm(args, model_dir, tokenizer, backend.stop_ids, magpie, histories)

    # the ratio is against each part's first row: transformers' sampling, a batch of 1
    base: dict[object, object] = {}
    for row in table:
        base.setdefault(row["part"], row["tokens_per_s"])
    print(f"{'part':8} {'how':34} {'seconds':>8} {'tokens/s':>9} {'x':>6}")
    for row in table:
        ratio = float(row["tokens_per_s"]) / float(base[row["part"]])  # type: ignore[arg-type]
        row["ratio"] = ratio
        print(
            f"{row['part']:8} {row['how']:34} {row['seconds']:8.1f} "
            f"{row['tokens_per_s']:9.1f} {ratio:6.2f}"
        )
    if args.json:
        print(json.dumps({"benchmark": "regenerate", "dtype": args.dtype, "rows": table}))


def through_vllm(
    args: argparse.Namespace,
    model_dir: Path,
    tokenizer: object,
    stop_ids: set[int],
    magpie: MagpieConfig,
    histories: list[list[dict[str, str]]],
) -> list[dict[str, object]]:
    """The same two parts through the vLLM engine (one server for both)."""
    rows: list[dict[str, object]] = []
    engine = VLLMConfig(enforce_eager=args.vllm_eager)
    log = Path("outputs") / "bench" / "regenerate-vllm.log"
    start = time.perf_counter()
    with VLLMServer(engine, model_dir, log, args.dtype, name="vLLM (benchmark)") as server:
        started = time.perf_counter() - start
        print(f"vLLM started in {started:.0f} s (log {log})")
        cfg = RegenerateConfig(backend=Backend.vllm, max_new_tokens=args.answer_tokens,
                               concurrency=args.prompts)  # fmt: skip
        backend = VLLMBackend(cfg, server.client(), tokenizer, stop_ids, "smollm2", SERVED_NAME)
        header = list(tokenizer(user_header(tokenizer), add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        backend.sample_rows(header[:4], MagpieConfig(max_new_tokens=8))  # warm-up
        start = time.perf_counter()
        sampled = backend.sample_rows(header, magpie)
        seconds = time.perf_counter() - start
        ends = [first_stop(row, stop_ids) for row in sampled]
        tokens = sum(e for e in ends if e is not None)
        rows.append({"part": "prompts", "how": f"vllm, {args.prompts} in flight",
                     "batch": args.prompts, "seconds": seconds, "tokens_per_s": tokens / seconds,
                     "ended": sum(e is not None for e in ends) / len(ends),
                     "engine_start_s": started})  # fmt: skip
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            answering = VLLMBackend(
                RegenerateConfig(backend=Backend.vllm, max_new_tokens=args.answer_tokens,
                                 concurrency=batch),
                server.client(), tokenizer, stop_ids, "smollm2", SERVED_NAME,
            )  # fmt: skip
            todo = histories[: args.single_prompts] if batch == 1 else histories
            start = time.perf_counter()
            replies = answering(todo)
            seconds = time.perf_counter() - start
            failed = [r for r in replies if isinstance(r, RequestFailed)]
            if failed:
                raise SystemExit(f"{len(failed)} of {len(replies)} requests failed: {failed[0]}")
            tokens = sum(len(tokenizer(r.content).input_ids) for r in replies)  # type: ignore[operator, union-attr]
            rows.append({"part": "answers", "how": f"vllm backend, {batch} in flight",
                         "batch": batch, "seconds": seconds, "tokens_per_s": tokens / seconds,
                         "ended": None})  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
