"""Helpers shared by the loss-mask tests: supervised text of a Rendered, runs of supervised ids."""

from __future__ import annotations

from typing import Any

from eagleforge.data.rendered import Rendered


def supervised_text(rendered: Rendered) -> list[str]:
    return [rendered.text[s:e] for s, e in rendered.spans]


def decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def supervised_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """Contiguous runs of supervised token ids."""
    runs: list[list[int]] = []
    previous = 0
    for token, flag in zip(ids, mask, strict=True):
        if flag and not previous:
            runs.append([])
        if flag:
            runs[-1].append(token)
        previous = flag
    return runs
