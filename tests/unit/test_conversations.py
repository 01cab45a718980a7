"""Reading conversation files: ShareGPT and OpenAI rows, auto detection, .jsonl and .json, and
DataErrors that name the file and line (or turn) of a bad row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleforge.data.conversations import DataFormat, read_conversations
from eagleforge.errors import DataError

pytestmark = pytest.mark.unit

SHAREGPT_ROW = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello."},
    ]
}
OPENAI_ROW = {
    "messages": [
        {"role": "user", "content": "Ping"},
        {"role": "assistant", "content": "Pong"},
    ]
}
SHAREGPT_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
]
OPENAI_MESSAGES = [{"role": "user", "content": "Ping"}, {"role": "assistant", "content": "Pong"}]


def write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_sharegpt_roles_are_mapped(tmp_path: Path) -> None:
    """ShareGPT from=system/human/gpt become system/user/assistant, values kept verbatim."""
    path = write_jsonl(tmp_path / "file.jsonl", [json.dumps(SHAREGPT_ROW)])
    rows = list(read_conversations(DataFormat.sharegpt, path))
    assert [messages for _, messages in rows] == [SHAREGPT_MESSAGES]
    assert rows[0][0] == f"{path}:1"


def test_openai_messages(tmp_path: Path) -> None:
    """OpenAI rows keep their roles and contents."""
    path = write_jsonl(tmp_path / "file.jsonl", [json.dumps(OPENAI_ROW)])
    assert [m for _, m in read_conversations(DataFormat.openai, path)] == [OPENAI_MESSAGES]


def test_auto_detects_per_row(tmp_path: Path) -> None:
    """format=auto reads a file mixing ShareGPT and OpenAI rows, each in its own format, in order;
    blank lines are skipped but line numbers stay the file's."""
    path = write_jsonl(
        tmp_path / "file.jsonl", [json.dumps(OPENAI_ROW), "", json.dumps(SHAREGPT_ROW)]
    )
    rows = list(read_conversations(DataFormat.auto, path))
    assert [m for _, m in rows] == [OPENAI_MESSAGES, SHAREGPT_MESSAGES]
    assert [where for where, _ in rows] == [f"{path}:1", f"{path}:3"]


def test_role_aliases_case_insensitive(tmp_path: Path) -> None:
    """Aliases (chatgpt, model, Human) map case-insensitively."""
    row = {
        "conversations": [
            {"from": "Human", "value": "q"},
            {"from": "chatgpt", "value": "a"},
            {"from": "USER", "value": "c"},
            {"from": "model", "value": "b"},
        ]
    }
    path = write_jsonl(tmp_path / "file.jsonl", [json.dumps(row)])
    [(_, messages)] = list(read_conversations(DataFormat.auto, path))
    assert messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "b"},
    ]


def test_malformed_json_line_names_file_and_line(tmp_path: Path) -> None:
    """A broken line 3 raises DataError containing "file.jsonl:3", after yielding lines 1-2."""
    path = write_jsonl(
        tmp_path / "file.jsonl",
        [
            json.dumps(OPENAI_ROW),
            json.dumps(SHAREGPT_ROW),
            '{"messages": [',
            json.dumps(OPENAI_ROW),
        ],
    )
    reader = read_conversations(DataFormat.auto, path)
    assert next(reader)[1] == OPENAI_MESSAGES
    assert next(reader)[1] == SHAREGPT_MESSAGES
    with pytest.raises(DataError, match=r"file\.jsonl:3\b"):
        next(reader)


def test_unknown_role_names_turn(tmp_path: Path) -> None:
    """An unknown role raises DataError naming the line, the turn index and the role."""
    row = {"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]}
    path = write_jsonl(tmp_path / "file.jsonl", [json.dumps(OPENAI_ROW), json.dumps(row)])
    with pytest.raises(DataError) as info:
        list(read_conversations(DataFormat.auto, path))
    message = str(info.value)
    assert "file.jsonl:2" in message
    assert "turn 1" in message
    assert "wizard" in message


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ([1, 2], "JSON object"),
        ({"messages": "not a list"}, "'messages'"),
        ({"messages": [{"content": "no role"}]}, "turn 0"),
        ({"messages": [{"role": "user", "content": 5}]}, "turn 0"),
    ],
)
def test_bad_rows_raise_data_error(tmp_path: Path, row, fragment: str) -> None:  # type: ignore[no-untyped-def]
    """Rows that are not objects, lack the turn list, a role, or have non-string content fail clearly."""
    path = write_jsonl(tmp_path / "file.jsonl", [json.dumps(row)])
    with pytest.raises(DataError, match=fragment) as info:
        list(read_conversations(DataFormat.auto, path))
    assert "file.jsonl:1" in str(info.value)


def test_explicit_format_mismatch(tmp_path: Path) -> None:
    """format=sharegpt on an OpenAI row fails naming the missing 'conversations' list."""
    path = write_jsonl(tmp_path / "file.jsonl", [json.dumps(OPENAI_ROW)])
    with pytest.raises(DataError, match="'conversations'"):
        list(read_conversations(DataFormat.sharegpt, path))


def test_json_list_file(tmp_path: Path) -> None:
    """A .json file holding a list of rows is read in order, located as path[index]."""
    path = tmp_path / "data.json"
    path.write_text(json.dumps([SHAREGPT_ROW, OPENAI_ROW]), encoding="utf-8")
    rows = list(read_conversations(DataFormat.auto, str(path)))
    assert [m for _, m in rows] == [SHAREGPT_MESSAGES, OPENAI_MESSAGES]
    assert [where for where, _ in rows] == [f"{path}[0]", f"{path}[1]"]


def test_json_file_not_a_list_or_invalid(tmp_path: Path) -> None:
    """A .json object (not a list) or invalid JSON raises DataError naming the file."""
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps(OPENAI_ROW), encoding="utf-8")
    with pytest.raises(DataError, match="list"):
        list(read_conversations(DataFormat.auto, str(obj)))
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"messages": []},\n{oops}\n]', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.json:3"):
        list(read_conversations(DataFormat.auto, str(bad)))


def test_missing_file_and_bad_extension(tmp_path: Path) -> None:
    """A missing path or an unsupported extension raises DataError naming the path."""
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="nope.jsonl"):
        list(read_conversations(DataFormat.auto, str(missing)))
    with pytest.raises(DataError, match="not a saved HF dataset"):
        list(read_conversations(DataFormat.auto, str(tmp_path)))  # a plain directory
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"\.csv"):
        list(read_conversations(DataFormat.auto, str(csv)))
