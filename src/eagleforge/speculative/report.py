"""What the evaluator reports: τ, per-position acceptance, speed and speedup; as a console
table, a JSON summary, a jsonl of every turn, PNG plots, and one table (csv and markdown)
and plot across prompt sets."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagleforge.speculative.decoder import DecodeResult


@dataclass
class TurnRecord:
    """One prompt turn, decoded speculatively and (optionally) by the target alone."""

    prompt_id: str
    turn: int
    prompt_tokens: int
    speculative: DecodeResult
    baseline: DecodeResult | None
    reference: DecodeResult | None = None  # transformers' generate (eval.hf_generate)


@dataclass
class Summary:
    draft: str
    num_turns: int
    rounds: int  # verification forwards
    tau: float  # committed tokens per verification forward (accepted drafts + 1)
    acceptance_by_position: list[float]  # P(draft token j accepted | drafts 1..j-1 were)
    target_forwards: int  # all, prefills included
    generated_tokens: int
    tokens_per_s: float
    baseline_tokens_per_s: float | None
    speedup: float | None
    greedy_matches_target: bool | None  # temperature 0 with a baseline: outputs identical
    prompt_set: str = ""  # the eval.prompts set it was measured on
    prompt_source: str = ""  # where that set's rows came from: a hub id, a file
    setting: str = ""  # the decoding, as SGLang's steps/topk/tokens (3/1/4: a chain of 3)
    hf_generate_tokens_per_s: float | None = None  # transformers' generate (eval.hf_generate)
    engine: str = "hf"  # who decoded: eagleforge's decoder (hf) or the vLLM engine (vllm)
    # vllm: the same prompts with eval.engine_batch of them in flight at once
    batch_size: int | None = None
    batch_tokens_per_s: float | None = None
    batch_baseline_tokens_per_s: float | None = None
    batch_speedup: float | None = None
    batch_outputs_equal: int | None = None  # greedy outputs equal to the target alone's, batched
    # the dtype the target decoded in (float32 | bfloat16 | float16); "" where not known
    dtype: str = ""


def _speed(results: list[DecodeResult | None]) -> float | None:
    """Tokens per second over ``results``; None unless every one is there."""
    if not results or any(r is None for r in results):
        return None
    done = [r for r in results if r is not None]
    return sum(len(r.output_ids) for r in done) / max(sum(r.seconds for r in done), 1e-9)


def summarise(
    draft: str,
    records: list[TurnRecord],
    depth: int,
    greedy: bool,
    prompt_set: str = "",
    prompt_source: str = "",
    setting: str = "",
    dtype: str = "",
) -> Summary:
    accepted = [a for r in records for a in r.speculative.accepted_lengths]
    reached = [sum(1 for a in accepted if a >= j) for j in range(depth + 1)]
    rates = [reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, depth + 1)]
    tokens = sum(len(r.speculative.output_ids) for r in records)
    seconds = sum(r.speculative.seconds for r in records)
    baseline_speed = _speed([r.baseline for r in records])
    speed = tokens / max(seconds, 1e-9)
    matches = None
    if greedy and baseline_speed is not None:
        matches = all(
            r.baseline is not None and r.speculative.output_ids == r.baseline.output_ids
            for r in records
        )
    return Summary(
        draft=draft,
        num_turns=len(records),
        rounds=len(accepted),
        tau=(sum(accepted) + len(accepted)) / max(len(accepted), 1),
        acceptance_by_position=rates,
        target_forwards=sum(r.speculative.target_forwards for r in records),
        generated_tokens=tokens,
        tokens_per_s=speed,
        baseline_tokens_per_s=baseline_speed,
        speedup=speed / baseline_speed if baseline_speed else None,
        greedy_matches_target=matches,
        prompt_set=prompt_set,
        prompt_source=prompt_source,
        setting=setting,
        hf_generate_tokens_per_s=_speed([r.reference for r in records]),
        dtype=dtype,
    )


# bf16 and fp16 verification rounds differently from one-token steps: greedy outputs may part
# ways with the target alone's at near-tied tokens (docs/quality.md#lossless-in-bf16)
INEXACT_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


def greedy_verdict(summary: Summary, *, short: bool = False) -> str | None:
    """Whether the greedy outputs equal the target alone's, in words that say what it means:
    ``equal``; ``differs — bf16, as expected``; ``differs — float32, a bug: please report
    it``. ``short``: the table across prompt sets' cell (``differs (bf16)``). None where it
    was not checked (sampling, no baseline)."""
    if summary.greedy_matches_target is None:
        return None
    if summary.greedy_matches_target:
        return "equal"
    if not summary.dtype:
        return "differs"
    name = INEXACT_DTYPES.get(summary.dtype, summary.dtype)
    if short:
        return f"differs ({name})"
    # a GGUF quantization (q4_1, iq4_xs ...): llama.cpp's kernels round a batch of tokens
    # differently from one, as bf16's do
    if summary.dtype in INEXACT_DTYPES or summary.dtype.startswith(("q", "iq")):
        return f"differs — {name}, as expected"
    return f"differs — {name}, a bug: please report it"


def table(summary: Summary) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = [
        ("draft", summary.draft),
        ("engine", summary.engine),
        (
            "prompt set",
            f"{summary.prompt_set} ({summary.prompt_source})" if summary.prompt_set else "-",
        ),
        ("decoding (steps/topk/tokens)", summary.setting or "-"),
        ("prompt turns", str(summary.num_turns)),
        ("τ (tokens per verification forward)", f"{summary.tau:.3f}"),
        (
            "acceptance by position",
            " ".join(f"{rate:.2f}" for rate in summary.acceptance_by_position),
        ),
        ("target forwards", str(summary.target_forwards)),
        ("generated tokens", str(summary.generated_tokens)),
        ("tokens/s speculative", fmt(summary.tokens_per_s, ".1f")),
        ("tokens/s target alone", fmt(summary.baseline_tokens_per_s, ".1f")),
        ("tokens/s transformers generate", fmt(summary.hf_generate_tokens_per_s, ".1f")),
        ("speedup", fmt(summary.speedup, ".2f")),
        ("greedy output = target's", greedy_verdict(summary) or "-"),
    ]
    if summary.batch_size is not None:
        equal = summary.batch_outputs_equal
        rows += [
            (
                f"tokens/s speculative, {summary.batch_size} at once",
                fmt(summary.batch_tokens_per_s, ".1f"),
            ),
            (
                f"tokens/s target alone, {summary.batch_size} at once",
                fmt(summary.batch_baseline_tokens_per_s, ".1f"),
            ),
            (f"speedup, {summary.batch_size} at once", fmt(summary.batch_speedup, ".2f")),
            (
                f"greedy outputs = target's, {summary.batch_size} at once",
                "-" if equal is None else f"{equal} of {summary.num_turns}",
            ),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_outputs(summary: Summary, records: list[TurnRecord], out_dir: Path) -> list[Path]:
    """summary.json and outputs.jsonl (token ids and accepted lengths of every turn)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(asdict(summary), indent=2) + "\n")
    outputs_path = out_dir / "outputs.jsonl"
    with outputs_path.open("w") as f:
        for r in records:
            row = {
                "prompt_id": r.prompt_id,
                "turn": r.turn,
                "prompt_tokens": r.prompt_tokens,
                "output_ids": r.speculative.output_ids,
                "accepted_lengths": r.speculative.accepted_lengths,
                "seconds": round(r.speculative.seconds, 4),
            }
            if r.baseline is not None:
                row["baseline_output_ids"] = r.baseline.output_ids
                row["baseline_seconds"] = round(r.baseline.seconds, 4)
            if r.reference is not None:
                row["hf_generate_seconds"] = round(r.reference.seconds, 4)
            f.write(json.dumps(row) + "\n")
    return [summary_path, outputs_path]


def plot_acceptance(summary: Summary, path: Path) -> Path:
    """Bars of the per-position acceptance rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    positions = list(range(1, len(summary.acceptance_by_position) + 1))
    ax.bar(positions, summary.acceptance_by_position, color="#4c72b0")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(positions)
    ax.set_title(f"τ = {summary.tau:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_tau_by_step(points: dict[str, list[tuple[int, float]]], path: Path) -> Path:
    """τ against the training step of each evaluated checkpoint, one line per prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, series in points.items():
        ax.plot([s for s, _ in series], [t for _, t in series], marker="o", label=name)
    if len(points) > 1:
        ax.legend()
    ax.set_xlabel("training step")
    ax.set_ylabel("τ")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def learning_curve_figure(
    eval_by_step: dict[int, dict[str, float]],
    tau_by_step: dict[int, float],
    title: str,
    position_label: str = "TTT position",
) -> Any:
    """A training run's learning curve as one matplotlib figure: above, eval τ_sim by step
    with the real-τ measurements on it (τ from 1, where a draft starts); below, eval acc_i of
    every ``position_label`` (TTT position, or a DFlash block's slot) by step (from 0). A long
    title is wrapped, never cut."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(eval_by_step)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    taus = [eval_by_step[s]["eval/tau_sim"] for s in steps if "eval/tau_sim" in eval_by_step[s]]
    if taus:
        top.plot([s for s in steps if "eval/tau_sim" in eval_by_step[s]], taus, marker="o",
                 label="eval τ_sim (held-out conversations)")  # fmt: skip
    if tau_by_step:
        real = sorted(tau_by_step.items())
        top.plot([s for s, _ in real], [t for _, t in real], "s", color="C3", ms=7,
                 label="real τ (speculative decoding, held-out prompts)")  # fmt: skip
    highest = max([*taus, *tau_by_step.values(), 1.0])
    top.set_ylim(1.0, highest + max(0.1, 0.1 * (highest - 1.0)))
    top.set_ylabel("τ (tokens per verification)")
    top.legend(fontsize=8, loc="lower right")
    positions = sorted(
        {int(k.rsplit("_", 1)[1]) for m in eval_by_step.values() for k in m if k.startswith("eval/acc_")}
    )  # fmt: skip
    for i in positions:
        key = f"eval/acc_{i}"
        points = [(s, eval_by_step[s][key]) for s in steps if key in eval_by_step[s]]
        bottom.plot([s for s, _ in points], [a for _, a in points], marker=".", label=f"acc_{i}")
    accs = [m[k] for m in eval_by_step.values() for k in m if k.startswith("eval/acc_")]
    bottom.set_ylim(0.0, min(1.0, max([*accs, 0.0]) * 1.15 + 0.02))
    bottom.set_ylabel(f"eval accuracy by {position_label}")
    bottom.set_xlabel("training step")
    if positions:
        bottom.legend(fontsize=8, ncol=min(4, len(positions)), loc="lower right")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.suptitle(textwrap.fill(title, 90), fontsize=10)
    fig.tight_layout()
    return fig


def plot_learning_curve(
    eval_by_step: dict[int, dict[str, float]],
    tau_by_step: dict[int, float],
    title: str,
    path: Path,
    position_label: str = "TTT position",
) -> Path:
    """``learning_curve_figure`` written to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = learning_curve_figure(eval_by_step, tau_by_step, title, position_label)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# the columns of the table across prompt sets: (header, value of a Summary)
SET_COLUMNS: list[tuple[str, Callable[[Summary], object]]] = [
    ("draft", lambda s: Path(s.draft).name),
    ("prompt set", lambda s: s.prompt_set),
    ("decoding", lambda s: s.setting),
    ("engine", lambda s: s.engine),
    ("turns", lambda s: s.num_turns),
    ("tau", lambda s: round(s.tau, 3)),
    ("accept pos 1", lambda s: round(s.acceptance_by_position[0], 3)),
    ("tokens/s", lambda s: round(s.tokens_per_s, 1)),
    ("tokens/s target", lambda s: _round(s.baseline_tokens_per_s, 1)),
    ("tokens/s generate", lambda s: _round(s.hf_generate_tokens_per_s, 1)),
    ("speedup", lambda s: _round(s.speedup, 2)),
    ("greedy = target", lambda s: greedy_verdict(s, short=True)),
    ("speedup batched", lambda s: _round(s.batch_speedup, 2)),
    ("source", lambda s: s.prompt_source),
]


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _cells(summary: Summary) -> list[str]:
    return ["-" if (v := value(summary)) is None else str(v) for _, value in SET_COLUMNS]


def sets_table(summaries: list[Summary]) -> str:
    """One markdown table row per (draft, prompt set): τ, first-position acceptance, speed."""
    headers = [h for h, _ in SET_COLUMNS]
    rows = [_cells(s) for s in summaries]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def write_sets_table(summaries: list[Summary], out_dir: Path) -> list[Path]:
    """summary.csv and summary.md: the table across prompt sets, for MLflow and for people."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "summary.csv", out_dir / "summary.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([h for h, _ in SET_COLUMNS])
        writer.writerows(["" if c == "-" else c for c in _cells(s)] for s in summaries)
    md_path.write_text(sets_table(summaries) + "\n")
    return [csv_path, md_path]


def _series(summary: Summary) -> str:
    """A draft and its decoding setting, as one bar series."""
    name = Path(summary.draft).name
    return f"{name} {summary.setting}" if summary.setting else name


def plot_tau_by_set(summaries: list[Summary], path: Path) -> Path:
    """Bars of τ per prompt set, one bar per draft in each group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(s.prompt_set for s in summaries))
    drafts = list(dict.fromkeys(_series(s) for s in summaries))
    tau = {(_series(s), s.prompt_set): s.tau for s in summaries}
    width = 0.8 / len(drafts)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(sets)), 3.5))
    for i, draft in enumerate(drafts):
        xs = [j + (i - (len(drafts) - 1) / 2) * width for j in range(len(sets))]
        heights = [tau.get((draft, name), 0.0) for name in sets]
        ax.bar(xs, heights, width, label=draft)
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels(sets)
    ax.set_ylabel("τ")
    ax.axhline(1.0, color="grey", linewidth=0.8)  # τ = 1: the draft never helps
    if len(drafts) > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
