"""Reading conversations: files and bundled data sets -> lists of {"role", "content"} messages.

Accepted rows (jsonl: one per line; json: a list of rows):
- ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system" | ..., "value": "..."}]}``
- OpenAI:   ``{"messages": [{"role": "user" | "assistant" | "system" | ..., "content": "..."}]}``
Bundled: the chitchat-dataset package (7,168 human chats; speaker turns alternate user/assistant).

A malformed row stops the run with an error naming the file and line.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

from eagleforge.errors import DataError

Message = dict[str, str]
Conversation = list[Message]

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


class DataFormat(str, Enum):
    auto = "auto"  # detect per row: "conversations" -> sharegpt, "messages" -> openai
    sharegpt = "sharegpt"
    openai = "openai"
    chitchat = "chitchat"  # the bundled chitchat-dataset package; no path


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, row) pairs of a .jsonl or .json file."""
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix the file.") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json data file must hold a list of conversations.")
        for index, row in enumerate(rows):
            yield f"{path}[{index}]", row
        return
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{line_number}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{line_number}: not valid JSON ({e.msg}); fix or remove the line."
                ) from None


def normalise_row(row: Any, fmt: DataFormat, where: str) -> Conversation:
    """One data row -> messages with canonical roles; raises DataError naming ``where``."""
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: expected a JSON object per conversation, got {type(row).__name__}."
        )
    if fmt == DataFormat.auto:
        fmt = DataFormat.sharegpt if "conversations" in row else DataFormat.openai
    key, role_key, content_key = (
        ("conversations", "from", "value")
        if fmt == DataFormat.sharegpt
        else ("messages", "role", "content")
    )
    turns = row.get(key)
    if not isinstance(turns, list):
        raise DataError(
            f"{where}: missing the '{key}' list ({fmt.value} format); fix the row or set data.format."
        )
    messages: Conversation = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn:
            raise DataError(f"{where}: turn {index} has no '{role_key}' field.")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise DataError(
                f"{where}: turn {index} has unknown role '{turn[role_key]}'; "
                f"use one of {sorted(set(ROLE_ALIASES))}."
            )
        content = turn.get(content_key)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise DataError(f"{where}: turn {index} '{content_key}' must be a string.")
        messages.append({"role": role, "content": content})
    return messages


def chitchat_conversations() -> Iterator[tuple[str, Conversation]]:
    """The chitchat-dataset chats; the first speaker is the user, the other the assistant."""
    data = json.loads(chitchat_source_file().read_text(encoding="utf-8"))
    for chat_id, chat in data.items():
        groups = chat.get("messages", [])
        if not groups:
            continue
        first_sender = groups[0][0]["sender"]
        messages = [
            {
                "role": "user" if group[0]["sender"] == first_sender else "assistant",
                "content": "\n".join(utterance["text"] for utterance in group),
            }
            for group in groups
            if group
        ]
        yield f"chitchat:{chat_id}", messages


def chitchat_source_file() -> Path:
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "data=chitchat needs the chitchat-dataset package: pip install 'eagleforge[demo]'."
        )
    return Path(list(spec.submodule_search_locations)[0]) / "dataset.json"


def read_conversations(fmt: DataFormat, path: str | None) -> Iterator[tuple[str, Conversation]]:
    """(location, messages) for every conversation of the source, in file order."""
    if fmt == DataFormat.chitchat:
        yield from chitchat_conversations()
        return
    assert path is not None
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"data.path {path} does not exist or is not a file; point it at a .jsonl or .json file."
        )
    if file.suffix not in {".jsonl", ".json"}:
        raise DataError(
            f"data.path {path}: unsupported extension '{file.suffix}'; use .jsonl or .json."
        )
    for where, row in _rows(file):
        yield where, normalise_row(row, fmt, where)
