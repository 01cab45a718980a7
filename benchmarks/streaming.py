"""Offline (a feature store) against streaming from vLLM engines (target=vllm), side by side:
the wall time to the same number of training steps, training tokens/s, the peak memory of the
run's whole process tree (the engines included), and the draft's eval τ_sim.

    python benchmarks/streaming.py --steps 150 --engines 1,2 --json     # after make quality

Each run is ``python -m eagleforge.train`` on `make quality`'s data and recipe (QUALITY, the
overrides of ``make quality`` where `make vllm` built the engine), alone on the machine, one
after the other. The offline run reads --store; where it holds no store yet, the benchmark
captures it first (``eagleforge.prepare``, as `make quality` does) and adds the capture's time
to the offline wall time, since a stream pays for the target inside the run. Tokens/s is the
mean of the run's logged windows; the memory is sampled every second from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

QUALITY = ["+model=smollm2", "+experiment=smollm2_quality_vllm", "data=jsonl"]


def _tree_rss(root: int) -> int:
    """Bytes resident in ``root`` and every process below it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    total = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def timed(command: list[str], log: Path) -> tuple[int, float, int]:
    """Run ``command`` into ``log``: its status, wall seconds and peak tree memory (bytes)."""
    start = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    peak = 0

    def sample() -> None:
        nonlocal peak
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    status = proc.wait()
    wall = time.perf_counter() - start
    sampler.join()
    return status, wall, peak


def run(name: str, overrides: list[str], out: Path) -> dict[str, float | str]:
    """One training run: its wall time, peak tree memory, tokens/s and final eval τ_sim."""
    run_dir = out / name
    command = [sys.executable, "-m", "eagleforge.train", *QUALITY, *overrides,
               f"hydra.run.dir={run_dir}", "tracker=console", "trainer.progress_bar=false"]  # fmt: skip
    log = out / f"{name}.log"
    status, wall, peak = timed(command, log)
    text = log.read_text(errors="replace")
    if status != 0:
        raise SystemExit(f"{name} failed ({status}); its log: {log}")
    rates = [float(r.replace(",", "")) for r in re.findall(r"tok/s ([\d,]+)", text)]
    summary = json.loads((run_dir / "summary.json").read_text())
    fed = re.search(r"^fed by: (.*) \(", text, re.MULTILINE)
    return {
        "run": name,
        "wall_s": round(wall, 1),
        "tokens_per_s": round(sum(rates) / len(rates), 1) if rates else float("nan"),
        "peak_rss_gib": round(peak / 2**30, 2),
        "eval_tau_sim": round(summary["final_eval"].get("eval/tau_sim", float("nan")), 4),
        "eval_acc_0": round(summary["final_eval"].get("eval/acc_0", float("nan")), 4),
        "fed_by": fed.group(1) if fed else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="outputs/quality/magpie.jsonl")
    parser.add_argument("--store", default="outputs/quality/features")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--engines", default="1,2", help="streaming runs, engines each")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="also print one JSON line per run")
    args = parser.parse_args()  # fmt: skip
    out = Path(args.out or tempfile.mkdtemp(prefix="eagleforge-streaming-"))
    out.mkdir(parents=True, exist_ok=True)
    common = [f"data.path={args.data}", f"trainer.max_num_steps={args.steps}",
              "trainer.eval_tau_every_n_steps=0", "trainer.eval_at_start=false"]  # fmt: skip
    capture_s = None
    if not (Path(args.store) / "train" / "manifest.json").is_file():
        command = [sys.executable, "-m", "eagleforge.prepare", *QUALITY, f"data.path={args.data}",
                   f"prepare.output_dir={args.store}", f"hydra.run.dir={out / 'prepare'}"]  # fmt: skip
        status, capture_s, _ = timed(command, out / "prepare.log")
        if status != 0:
            raise SystemExit(f"the capture failed ({status}); its log: {out / 'prepare.log'}")
    results = [run("offline", [*common, f"data.features={args.store}"], out)]
    if capture_s is not None:
        results[0]["capture_s"] = round(capture_s, 1)
        results[0]["wall_s_with_capture"] = round(float(results[0]["wall_s"]) + capture_s, 1)
    for engines in (int(e) for e in args.engines.split(",")):
        overrides = [*common, "target=vllm", f"target.producers.engines={engines}"]
        results.append(run(f"stream-{engines}", overrides, out))
    print(f"{args.steps} steps of make quality's recipe on {args.data}; runs in {out}")
    print("| run | wall s | tokens/s | peak RSS GiB (tree) | eval acc_0 | eval τ_sim |")
    print("|---|---|---|---|---|---|")
    for r in results:
        wall = f"{r['wall_s']}" + (
            f" ({r['wall_s_with_capture']} with capture)" if "wall_s_with_capture" in r else ""
        )
        print(f"| {r['run']} | {wall} | {r['tokens_per_s']} | {r['peak_rss_gib']} | "
              f"{r['eval_acc_0']} | {r['eval_tau_sim']} |")  # fmt: skip
    if args.json:
        for r in results:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
