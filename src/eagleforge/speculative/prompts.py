"""Prompt sets for the evaluator: the bundled MT-bench-style set or any jsonl file.

A jsonl line may be ``{"turns": ["first user message", "second", ...]}`` (optionally with
``id`` and ``category``), ``{"prompt": "..."}``, or a training-style conversation (ShareGPT
``conversations`` or OpenAI ``messages``), whose user turns are the prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleforge.data.conversations import ROLE_ALIASES, DataFormat, RowError, read_rows
from eagleforge.errors import DataError

BUNDLED = {"mtbench": Path(__file__).parent / "prompts" / "mtbench_style.jsonl"}


@dataclass
class PromptItem:
    id: str
    category: str
    turns: list[str]  # user messages; turn i follows the model's answer to turn i-1


def load_prompts(source: str, multi_turn: bool, limit: int | None = None) -> list[PromptItem]:
    """Prompts from a bundled set name or a jsonl path; only the first turn unless
    ``multi_turn``. Raises DataError naming the file and line of a bad row."""
    path = BUNDLED.get(source, Path(source))
    if not path.is_file():
        raise DataError(
            f"eval.prompts={source}: no such file; give a jsonl path or one of: "
            f"{', '.join(sorted(BUNDLED))}."
        )
    items: list[PromptItem] = []
    for where, row in read_rows(DataFormat.auto, [path]):
        if isinstance(row, RowError):
            raise DataError(str(row))
        turns = _user_turns(row, where)
        if not turns:
            raise DataError(f"{where}: no user message to use as a prompt.")
        items.append(
            PromptItem(
                id=str(row.get("id", row.get("question_id", len(items)))),
                category=str(row.get("category", "")),
                turns=turns if multi_turn else turns[:1],
            )
        )
        if limit is not None and len(items) == limit:
            break
    if not items:
        raise DataError(
            f"{path}: holds no prompts; give one JSON object per line with 'turns', 'prompt', "
            "'conversations' or 'messages', or use eval.prompts=mtbench."
        )
    return items


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ending with a user turn, with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _user_turns(row: object, where: str) -> list[str]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}.")
    if "turns" in row or "prompt" in row:
        turns = row.get("turns", [row.get("prompt")])
        if not isinstance(turns, list) or not all(isinstance(t, str) and t for t in turns):
            raise DataError(f"{where}: 'turns' must be a list of non-empty strings.")
        return turns
    for key, role_key, content_key in (
        ("conversations", "from", "value"),
        ("messages", "role", "content"),
    ):
        if isinstance(row.get(key), list):
            return [
                turn[content_key]
                for turn in row[key]
                if isinstance(turn, dict)
                and ROLE_ALIASES.get(str(turn.get(role_key)).lower()) == "user"
                and isinstance(turn.get(content_key), str)
                and turn[content_key].strip()
            ]
    raise DataError(f"{where}: expected a 'turns', 'prompt', 'conversations' or 'messages' field.")
