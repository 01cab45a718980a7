"""Preprocessing throughput: chitchat rendered + tokenized with the SmolLM2 tokenizer and template.

    .venv/bin/python benchmarks/preprocess.py [--rows 7168] [--num-proc 1,2]

Compares eagleforge's pipeline (exact loss masks; the cache is bypassed) at several process
counts with a plain loop of ``apply_chat_template(tokenize=True)`` per conversation (no mask).
Prints a table and one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from eagleforge.data.config import OnError
from eagleforge.data.conversations import DataFormat, normalise_row, read_rows
from eagleforge.data.preprocess import _Settings, preprocess_rows
from eagleforge.data.template import make_renderer
from eagleforge.targets.source import bundled_smollm2_dir


def cache_dir() -> str:
    return os.environ.get("EAGLEFORGE_CACHE_DIR") or os.path.expanduser("~/.cache/eagleforge")


def bench_pipeline(tokenizer, rows: int, num_proc: int) -> dict[str, float | int | str]:  # type: ignore[no-untyped-def]
    settings = _Settings(
        DataFormat.chitchat, False, max_length=1 << 20, truncate=True, train_only_last_turn=False
    )
    renderer = make_renderer("auto", tokenizer)
    start = time.perf_counter()
    dataset, report = preprocess_rows(
        read_rows(DataFormat.chitchat, []),
        renderer,
        tokenizer,
        settings,
        OnError.skip,
        num_proc,
        rows,
    )
    seconds = time.perf_counter() - start
    return {"bench": "preprocess", "method": "eagleforge", "num_proc": num_proc, "rows": report.rows,
            "kept": report.kept, "tokens": report.tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(report.tokens / seconds)}  # fmt: skip


def bench_plain_loop(tokenizer, rows: int) -> dict[str, float | int | str]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    tokens = kept = 0
    for index, (where, row) in enumerate(read_rows(DataFormat.chitchat, [])):
        if index >= rows:
            break
        try:
            messages = normalise_row(row, DataFormat.chitchat, where)
        except Exception:
            continue
        tokens += len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        kept += 1
    seconds = time.perf_counter() - start
    return {"bench": "preprocess", "method": "apply_chat_template loop", "num_proc": 1, "rows": rows,
            "kept": kept, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=7168, help="chitchat conversations to process")
    parser.add_argument("--num-proc", default="1,2", help="comma-separated process counts")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_smollm2_dir(cache_dir()))
    results = [bench_plain_loop(tokenizer, args.rows)]
    results += [bench_pipeline(tokenizer, args.rows, int(n)) for n in args.num_proc.split(",")]
    print(f"{'method':<26} {'procs':>5} {'kept':>6} {'tokens':>9} {'seconds':>8} {'tokens/s':>9}")
    for r in results:
        print(
            f"{r['method']:<26} {r['num_proc']:>5} {r['kept']:>6} {r['tokens']:>9} {r['seconds']:>8} {r['tokens_per_s']:>9}"
        )
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
