"""Reading conversations: files and bundled data sets -> validated lists of messages.

Sources: ``.jsonl`` (one row per line), ``.json`` (a list of rows), ``.parquet``, a saved HF
dataset directory, a glob of those, or the bundled chitchat-dataset package. Rows:

- ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system" | "tool" | ..., "value": "..."}]}``
- OpenAI:   ``{"messages": [{"role": ..., "content": ..., "reasoning_content"?: ..., "tool_calls"?: [...]}]}``
- preformatted (``data.preformatted=true``): ``{"text": "<chat template already applied>"}``
- corpus rows of another shape, turned into OpenAI rows by a row converter (``ROW_CONVERTERS``):
  GSM8K ``{"question", "answer"}``, OpenCoder SFT ``{"instruction", "output"}``. ShareGPT
  turns may also be ``{"role", "content"}`` (SpecForge's prepared files, the regenerated
  PerfectBlend sets). Named hub corpora (data=ultrachat, ...) are in ``eagleforge.data.corpora``.

Images (``data.is_vlm=true``, vision-language targets; see docs/vlm.md): a user turn lists
image files in ``"images": [...]`` (or one in ``"image"``), or its OpenAI ``content`` is a list
of parts ``{"type": "text", "text": ...}`` / ``{"type": "image", "image": path}``; a row-level
``"images"`` / ``"image"`` belongs to the first user turn (LLaVA style). Relative paths are
relative to the data file's directory. A turn's images come before its text. Normalised
messages keep ``content`` a string and list absolute image paths under ``images``.

Every problem with a row is a ``RowError`` naming the row (file and line) and one ``SkipReason``,
so a run can stop on it (``data.on_error=raise``) or skip and count it (``skip``).
"""

from __future__ import annotations

import codecs
import glob
import importlib.util
import json
import re
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

from eagleforge.errors import DataError

Message = dict[str, Any]  # role, content, and optionally reasoning_content, tool_calls, name, ...
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
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
    "observation": "tool",
    "ipython": "tool",
}
# Message fields passed on to chat templates besides role and content.
EXTRA_FIELDS = ("reasoning_content", "tool_calls", "tool_call_id", "name")


class DataFormat(str, Enum):
    auto = "auto"  # detect per row: "conversations" -> sharegpt, "messages" -> openai
    sharegpt = "sharegpt"
    openai = "openai"
    chitchat = "chitchat"  # the bundled chitchat-dataset package; no path
    gsm8k = "gsm8k"  # {"question", "answer"}: one user turn, one reply (GSM8K, config main)
    opencoder = "opencoder"  # {"instruction", "output"}: OpenCoder-LLM/opc-sft-stage1


class SkipReason(str, Enum):
    invalid_utf8 = "invalid_utf8"
    invalid_unicode = "invalid_unicode"  # a lone surrogate escape ("\ud800"): valid JSON, no text
    invalid_json = "invalid_json"
    malformed_row = "malformed_row"
    unknown_role = "unknown_role"
    non_string_content = "non_string_content"
    empty_content = "empty_content"
    no_assistant_turn = "no_assistant_turn"
    template_error = "template_error"
    too_long = "too_long"
    image_error = "image_error"  # missing or unreadable image, or images in a text-only run


class RowError(Exception):
    """One bad row: where it is, why, and what is wrong with it."""

    def __init__(self, reason: SkipReason, where: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.reason, self.where, self.detail = reason, where, detail

    def __reduce__(self) -> tuple[type[RowError], tuple[SkipReason, str, str]]:
        # Pickled from worker processes: rebuild from the fields, not from the message.
        return RowError, (self.reason, self.where, self.detail)


RawRow = tuple[str, Any]  # (location, parsed row) -- or (location, RowError) for unreadable ones


def chitchat_source_file() -> Path:
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "data=chitchat needs the chitchat-dataset package: pip install 'eagleforge[demo]'."
        )
    return Path(list(spec.submodule_search_locations)[0]) / "dataset.json"


def source_files(fmt: DataFormat, patterns: list[str]) -> list[Path]:
    """The files a source reads: the bundled chitchat file, or ``patterns`` expanded."""
    return [chitchat_source_file()] if fmt == DataFormat.chitchat else expand_sources(patterns)


def expand_sources(patterns: list[str]) -> list[Path]:
    """Files and dataset directories named by paths or globs, in a stable order."""
    sources: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise DataError(f"data.path {pattern} matches no file; check the pattern.")
        for match in matches:
            path = Path(match)
            if not path.exists():
                raise DataError(
                    f"data file {path} does not exist; check data.path / data.eval_path."
                )
            if path.is_dir() and not (path / "dataset_info.json").exists():
                raise DataError(
                    f"{path} is a directory but not a saved HF dataset (no dataset_info.json); "
                    "point data.path at a .jsonl/.json/.parquet file or a directory written "
                    "by Dataset.save_to_disk."
                )
            if path.is_file() and path.suffix not in {".jsonl", ".json", ".parquet"}:
                raise DataError(
                    f"{path}: unsupported extension '{path.suffix}'; use .jsonl, .json or .parquet."
                )
            sources.append(path)
    return sources


# A JSON escape of a UTF-16 surrogate ("\ud800"). json.loads pairs a high one with the low one
# after it; one left alone is a code point no tokenizer or UTF-8 writer takes.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in the strings (keys too) of a parsed JSON value, as ``\\uXXXX``."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        return f"\\u{ord(match.group()):04x}" if match else None
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list):
        return next((found for item in value if (found := _lone_surrogate(item))), None)
    return None


def _unicode_checked(row: Any, where: str) -> Any:
    """``row``, or a RowError when one of its strings holds a lone surrogate."""
    surrogate = _lone_surrogate(row)
    if surrogate is None:
        return row
    return RowError(
        SkipReason.invalid_unicode,
        where,
        f"invalid Unicode (lone surrogate {surrogate}); fix or remove the row.",
    )


def _jsonl_rows(path: Path) -> Iterator[RawRow]:
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            where = f"{path}:{line_number}"
            if line_number == 1:  # a byte-order mark, as Windows editors write: not part of the row
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield (
                    where,
                    RowError(
                        SkipReason.invalid_utf8,
                        where,
                        f"invalid UTF-8 at byte {e.start}; re-encode the file as UTF-8.",
                    ),
                )
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield (
                    where,
                    RowError(
                        SkipReason.invalid_json,
                        where,
                        f"not valid JSON ({e.msg}); fix or remove the line.",
                    ),
                )
                continue
            yield where, _unicode_checked(row, where) if _SURROGATE_ESCAPE.search(line) else row


def _json_rows(path: Path) -> Iterator[RawRow]:
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: invalid UTF-8; re-encode the file as UTF-8.") from None
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix the file.") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a .json data file must hold a list of conversations.")
    escapes = bool(_SURROGATE_ESCAPE.search(text))
    for index, row in enumerate(rows):
        where = f"{path}[{index}]"
        yield where, _unicode_checked(row, where) if escapes else row


def _table_rows(path: Path) -> Iterator[RawRow]:
    if path.is_dir():
        import datasets

        table = datasets.load_from_disk(str(path))
        if isinstance(table, datasets.DatasetDict):
            raise DataError(
                f"{path} holds several splits ({list(table)}); point data.path at one split's directory."
            )
        rows: Any = table
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    for index, row in enumerate(rows):
        yield f"{path}[row {index}]", row


def chitchat_rows() -> Iterator[RawRow]:
    """The chitchat chats as OpenAI rows: the first speaker is the user, the other the assistant."""
    data = json.loads(chitchat_source_file().read_text(encoding="utf-8"))
    for chat_id, chat in data.items():
        groups = [group for group in chat.get("messages", []) if group]
        first = groups[0][0]["sender"] if groups else None
        messages = [
            {
                "role": "user" if group[0]["sender"] == first else "assistant",
                "content": "\n".join(utterance["text"] for utterance in group),
            }
            for group in groups
        ]
        yield f"chitchat:{chat_id}", {"messages": messages}


def read_rows(fmt: DataFormat, sources: list[Path]) -> Iterator[RawRow]:
    """(location, row) for every row of every source, in order."""
    if fmt == DataFormat.chitchat:
        yield from chitchat_rows()
        return
    for path in sources:
        if path.suffix == ".jsonl":
            yield from _jsonl_rows(path)
        elif path.suffix == ".json":
            yield from _json_rows(path)
        else:
            yield from _table_rows(path)


def _split_inline_reasoning(message: Message) -> None:
    """``<think>r</think>reply`` in an assistant's content -> reasoning_content + content."""
    content = message["content"]
    if "reasoning_content" not in message and "</think>" in content:
        reasoning, _, reply = content.partition("</think>")
        message["reasoning_content"] = reasoning.replace("<think>", "", 1).strip()
        message["content"] = reply.lstrip("\n")


def data_file_of(where: str) -> Path | None:
    """The data file a row location (``file:line``, ``file[index]``, ``file[row i]``) names."""
    match = re.fullmatch(r"(.+?)(?::\d+|\[(?:row )?\d+\])", where)
    return Path(match.group(1)) if match else None


def _image_list(value: Any, where: str, field: str) -> list[str]:
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise RowError(
            SkipReason.image_error,
            where,
            f"'{field}' must be an image path or a list of image paths.",
        )
    return list(paths)


def _content_parts(content: list[Any], where: str, index: int) -> tuple[str, list[str]]:
    """OpenAI content parts -> (text, image paths); RowError for parts it does not know."""
    texts, images = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image" and isinstance(part.get("image"), str):
            images.append(part["image"])
        else:
            raise RowError(
                SkipReason.malformed_row,
                where,
                f"turn {index} has a content part that is neither "
                '{"type": "text", "text": ...} nor {"type": "image", "image": path}.',
            )
    return "\n".join(texts), images


def _resolve_images(paths: list[str], where: str) -> list[str]:
    """Absolute paths (relative ones against the data file's directory), each an existing file."""
    data_file = data_file_of(where)
    base = data_file.parent if data_file is not None else Path.cwd()
    resolved = []
    for path in paths:
        image = Path(path) if Path(path).is_absolute() else base / path
        if not image.is_file():
            raise RowError(
                SkipReason.image_error,
                where,
                f"image {image} does not exist (relative paths start at the data file's "
                "directory); fix the path or add the file.",
            )
        resolved.append(str(image.resolve()))
    return resolved


# GSM8K's calculator annotations (``48/2 = <<48/2=24>>24``): a tool trace no chat model writes.
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def _pair_row(row: dict[str, Any], prompt_key: str, reply_key: str, where: str) -> dict[str, Any]:
    """A {prompt, reply} row -> an OpenAI row of one user turn and one assistant turn."""
    for key in (prompt_key, reply_key):
        if key not in row:
            raise RowError(
                SkipReason.malformed_row,
                where,
                f"missing the '{key}' field; a row needs '{prompt_key}' and '{reply_key}'.",
            )
    return {
        "messages": [
            {"role": "user", "content": row[prompt_key]},
            {"role": "assistant", "content": row[reply_key]},
        ]
    }


def _gsm8k_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    converted = _pair_row(row, "question", "answer", where)
    reply = converted["messages"][1]
    if isinstance(reply["content"], str):
        reply["content"] = _CALCULATOR.sub("", reply["content"])
    return converted


def _opencoder_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    return _pair_row(row, "instruction", "output", where)


# Corpus row shapes -> OpenAI rows (``{"messages": [...]}``); other columns are dropped.
ROW_CONVERTERS = {DataFormat.gsm8k: _gsm8k_row, DataFormat.opencoder: _opencoder_row}


def normalise_row(
    row: Any,
    fmt: DataFormat,
    where: str,
    images_allowed: bool = False,
    require_reply: bool = True,
) -> Conversation:
    """One data row -> messages with canonical roles; raises RowError naming ``where``.

    ``images_allowed`` (``data.is_vlm``): user turns may carry images (see the module
    docstring); otherwise a row with images is an ``image_error``. ``require_reply=False``
    accepts rows without an assistant turn (evaluation prompts)."""
    if not isinstance(row, dict):
        raise RowError(
            SkipReason.malformed_row,
            where,
            f"expected a JSON object per conversation, got {type(row).__name__}.",
        )
    if fmt in ROW_CONVERTERS:
        row, fmt = ROW_CONVERTERS[fmt](row, where), DataFormat.openai
    if fmt in (DataFormat.auto, DataFormat.chitchat):
        # Tables (parquet, HF datasets) hold both columns when formats mix: look at the values.
        fmt = (
            DataFormat.sharegpt if isinstance(row.get("conversations"), list) else DataFormat.openai
        )
    key, role_key, content_key = (
        ("conversations", "from", "value")
        if fmt == DataFormat.sharegpt
        else ("messages", "role", "content")
    )
    turns = row.get(key)
    if not isinstance(turns, list):
        raise RowError(
            SkipReason.malformed_row,
            where,
            f"missing the '{key}' list ({fmt.value} format); fix the row or set data.format.",
        )
    messages: Conversation = []
    row_images = [
        path
        for field in ("images", "image")
        if row.get(field) is not None
        for path in _image_list(row[field], where, field)
    ]
    first = turns[0] if turns else None
    if fmt == DataFormat.sharegpt and isinstance(first, dict) and "from" not in first:
        # a ShareGPT list of OpenAI turns (SpecForge's prepared files, regenerated PerfectBlend)
        role_key, content_key = "role", "content"
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn:
            raise RowError(
                SkipReason.malformed_row, where, f"turn {index} has no '{role_key}' field."
            )
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise RowError(
                SkipReason.unknown_role,
                where,
                f"turn {index} has unknown role '{turn[role_key]}'; use one of {sorted(set(ROLE_ALIASES))}.",
            )
        content = turn.get(content_key)
        images = [
            path
            for field in ("images", "image")
            if isinstance(turn, dict) and turn.get(field) is not None
            for path in _image_list(turn[field], where, f"turn {index} {field}")
        ]
        if isinstance(content, list) and (
            images_allowed or any(isinstance(p, dict) and p.get("type") == "image" for p in content)
        ):
            content, part_images = _content_parts(content, where, index)
            images += part_images
        if role == "user" and row_images and not any(m["role"] == "user" for m in messages):
            images = row_images + images
        has_tool_calls = bool(turn.get("tool_calls"))
        if content is None and has_tool_calls:
            content = ""
        if not isinstance(content, str):
            raise RowError(
                SkipReason.non_string_content,
                where,
                f"turn {index} '{content_key}' must be a string, got {type(content).__name__}.",
            )
        if not content.strip() and not has_tool_calls and not images:
            raise RowError(
                SkipReason.empty_content, where, f"turn {index} ({role}) has empty content."
            )
        message: Message = {"role": role, "content": content}
        if images:
            if not images_allowed:
                raise RowError(
                    SkipReason.image_error,
                    where,
                    f"turn {index} has images but data.is_vlm=false; train a vision-language "
                    "target (+model=qwen2_5_vl, or data.is_vlm=true) or drop the images.",
                )
            if role != "user":
                raise RowError(
                    SkipReason.image_error,
                    where,
                    f"turn {index} ({role}) has images; only user turns may carry images.",
                )
            message["images"] = _resolve_images(images, where)
        message.update({k: turn[k] for k in EXTRA_FIELDS if turn.get(k) is not None})
        if role == "assistant":
            _split_inline_reasoning(message)
        messages.append(message)
    if require_reply and not any(m["role"] == "assistant" for m in messages):
        raise RowError(SkipReason.no_assistant_turn, where, "no assistant turn to train on.")
    if row_images and not any(m["role"] == "user" for m in messages):
        raise RowError(
            SkipReason.image_error, where, "the row has images but no user turn to carry them."
        )
    return messages


def preformatted_text(row: Any, where: str) -> str:
    """The ``text`` of a preformatted row; raises RowError naming ``where``."""
    if not isinstance(row, dict) or "text" not in row:
        raise RowError(SkipReason.malformed_row, where, "a preformatted row needs a 'text' field.")
    text = row["text"]
    if not isinstance(text, str):
        raise RowError(
            SkipReason.non_string_content,
            where,
            f"'text' must be a string, got {type(text).__name__}.",
        )
    if not text.strip():
        raise RowError(SkipReason.empty_content, where, "'text' is empty.")
    return text


def read_conversations(
    fmt: DataFormat, path: str | None, images_allowed: bool = False
) -> Iterator[tuple[str, Conversation]]:
    """(location, messages) for every conversation of a source; DataError at the first bad row."""
    files = source_files(fmt, [str(path)])
    for where, row in read_rows(fmt, files):
        try:
            if isinstance(row, RowError):
                raise row
            yield where, normalise_row(row, fmt, where, images_allowed)
        except RowError as e:
            raise DataError(str(e)) from None
