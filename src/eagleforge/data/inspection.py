"""Showing preprocessed data to a person: counts, a length histogram, supervised spans marked.

Used by ``python -m eagleforge.inspect_data``; the `inspect` config section lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagleforge.data.preprocess import DataReport, TokenizedDataset
from eagleforge.errors import ConfigError

ANSI_SUPERVISED, ANSI_RESET = "\x1b[30;42m", "\x1b[0m"
PLAIN_OPEN, PLAIN_CLOSE = "⟦", "⟧"


@dataclass
class InspectConfig:
    """The `inspect` config section (used by eagleforge.inspect_data)."""

    # Training samples rendered with their supervised tokens marked.
    num_samples: int = 3
    # Buckets of the sample-length histogram.
    num_buckets: int = 8
    # Mark supervised text with colour (auto = when stdout is a terminal) or with ⟦ ⟧.
    color: bool | None = None

    def __post_init__(self) -> None:
        if self.num_samples < 0 or self.num_buckets < 1:
            raise ConfigError("inspect.num_samples must be >= 0 and inspect.num_buckets >= 1.")


def length_histogram(lengths: list[int], num_buckets: int, width: int = 40) -> list[str]:
    """Text bars of the length distribution: buckets of ``size`` tokens from 1 to the longest
    sample, at most ``num_buckets`` of them (fewer when whole-token buckets reach the longest
    sooner, so that no bucket starts past it)."""
    if not lengths:
        return []
    top = max(lengths)
    size = max(1, -(-top // num_buckets))
    counts = [0] * -(-top // size)
    for length in lengths:
        counts[max(length - 1, 0) // size] += 1
    peak = max(counts)
    return [
        f"  {i * size + 1:>6}-{min((i + 1) * size, top):<6} {count:>7}  {'#' * round(width * count / peak)}"
        for i, count in enumerate(counts)
    ]


def marked_sample(ids: list[int], mask: list[int], tokenizer: Any, color: bool) -> str:
    """The sample's text with each run of supervised tokens wrapped in markers."""
    opening, closing = (ANSI_SUPERVISED, ANSI_RESET) if color else (PLAIN_OPEN, PLAIN_CLOSE)
    pieces, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            text = tokenizer.decode(
                ids[start:end], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            pieces.append(f"{opening}{text}{closing}" if mask[start] else text)
            start = end
    return "".join(pieces)


def report_lines(report: DataReport, dataset: TokenizedDataset, num_buckets: int) -> list[str]:
    lengths = dataset.lengths()
    lines = [
        f"rows read:          {report.rows}",
        f"kept:               {report.kept}",
        f"skipped:            {sum(report.skipped.values())}",
        *(f"  {reason:<20}{count}" for reason, count in sorted(report.skipped.items())),
        f"truncated:          {report.truncated}",
        f"tokens:             {report.tokens}",
        f"supervised tokens:  {report.supervised_tokens} ({report.supervised_tokens / max(report.tokens, 1):.1%})",
        f"length (tokens):    mean {sum(lengths) / max(len(lengths), 1):.1f}, max {max(lengths, default=0)}",
        "length histogram:",
        *length_histogram(lengths, num_buckets),
    ]
    return lines
