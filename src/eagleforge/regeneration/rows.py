"""The conversations to regenerate, and one chunk of them regenerated through any backend.

A backend (``Generate``) turns conversation histories into one ``Reply`` each, or the
``RequestFailed`` that says why it could not; ``regenerate_rows`` drives it turn by turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eagleforge.data.config import DataConfig, OnError
from eagleforge.data.conversations import Conversation, RowError, normalise_row
from eagleforge.data.sources import training_source
from eagleforge.errors import ConfigError
from eagleforge.regeneration.config import RegenerateConfig


@dataclass
class Reply:
    """One generated assistant turn."""

    content: str
    reasoning: str | None = None


class RequestFailed(Exception):
    """A request that failed after every retry; the message says why."""


# A backend turns conversation histories into one reply each (or the reason it failed).
Generate = Callable[[list[Conversation]], list["Reply | RequestFailed"]]


@dataclass
class Row:
    index: int  # position in the source (after data.max_num_samples / regenerate.max_rows)
    id: str
    messages: Conversation


def read_input(data: DataConfig, limit: int | None) -> tuple[list[Row], list[dict[str, Any]]]:
    """The conversations to regenerate and the rows that could not be read (data.on_error)."""
    source = training_source(data)  # files, a hub data set or a mixture
    rows: list[Row] = []
    bad: list[dict[str, Any]] = []
    for where, raw in source.rows():
        if limit is not None and len(rows) + len(bad) >= limit:
            break
        try:
            if isinstance(raw, RowError):
                raise raw
            messages = normalise_row(raw, source.fmt, where)
        except RowError as e:
            if data.on_error == OnError["raise"]:
                raise ConfigError(
                    f"{e} (or set data.on_error=skip to leave such rows out)"
                ) from None
            bad.append({"where": where, "reason": str(e)})
            continue
        row_id = raw.get("id") if isinstance(raw.get("id"), str) else where
        rows.append(Row(len(rows), row_id, messages))
    return rows, bad


def regenerate_rows(
    rows: list[Row], generate: Generate, cfg: RegenerateConfig
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(output rows, failures) for ``rows``: every assistant turn replaced, in order, for
    ``num_samples`` samples of each conversation (the first ``max_turns``, the conversation
    cut after them). ``generate`` is called once per assistant turn position with the
    histories of every conversation still going."""
    work = [(row, sample) for row in rows for sample in range(cfg.num_samples)]
    histories: list[Conversation] = [[] for _ in work]
    turn_of = [0 for _ in work]
    failed: dict[int, str] = {}
    live = list(range(len(work)))
    turns = 0
    while live and (not cfg.max_turns or turns < cfg.max_turns):
        turns += 1
        # advance every live conversation to its next assistant turn (or to its end)
        waiting = []
        for i in live:
            messages = work[i][0].messages
            while turn_of[i] < len(messages) and messages[turn_of[i]]["role"] != "assistant":
                histories[i].append(dict(messages[turn_of[i]]))
                turn_of[i] += 1
            if turn_of[i] < len(messages):
                waiting.append(i)
        if not waiting:
            break
        replies = generate([histories[i] for i in waiting])
        live = []
        for i, reply in zip(waiting, replies, strict=True):
            if isinstance(reply, RequestFailed):
                failed[i] = str(reply)
                continue
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if cfg.keep_reasoning and reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            histories[i].append(message)
            turn_of[i] += 1
            live.append(i)
    out, failures = [], []
    for i, (row, sample) in enumerate(work):
        row_id = row.id if cfg.num_samples == 1 else f"{row.id}#{sample}"
        if i in failed:
            failures.append({"index": row.index, "id": row_id, "reason": failed[i]})
        else:
            out.append({"id": row_id, "messages": histories[i]})
    return out, failures
