"""Reading data files (data/conversations.py) whatever their encoding quirks: a UTF-8 byte-order
mark is read as JSON tools read it, and a lone surrogate escape ("\\ud800", valid JSON) is a bad
row named by file and line, never a tokenizer crash. No tokenizer: the rows as read."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest

from eagleforge.data.conversations import DataFormat, RowError, SkipReason, read_rows
from eagleforge.errors import DataError
from eagleforge.speculative.prompts import load_prompts

pytestmark = pytest.mark.unit

ROWS = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
]
# json.dumps escapes a lone surrogate as \ud800, as scraped ShareGPT dumps hold it.
LONE = {
    "messages": [{"role": "user", "content": "cut \ud800"}, {"role": "assistant", "content": "x"}]
}


def _read(path: Path) -> list[tuple[str, object]]:
    return list(read_rows(DataFormat.auto, [path]))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_leading_byte_order_mark_is_read(tmp_path: Path, suffix: str) -> None:
    """A file that starts with a UTF-8 BOM gives the same rows as one without."""
    text = (
        "".join(json.dumps(row) + "\n" for row in ROWS) if suffix == ".jsonl" else json.dumps(ROWS)
    )
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(codecs.BOM_UTF8 + text.encode())
    assert [row for _, row in _read(path)] == ROWS


def test_a_lone_surrogate_in_jsonl_is_its_own_reason(tmp_path: Path) -> None:
    """The row with a lone surrogate is an invalid_unicode RowError at file:line; the rows
    around it, and an escaped surrogate pair (an emoji), read as they are."""
    emoji = {"messages": [{"role": "user", "content": "\U0001f600"}, ROWS[0]["messages"][1]]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [ROWS[0], LONE, emoji]))
    assert "\\ud83d\\ude00" in path.read_text()
    (_, first), (where, bad), (_, last) = _read(path)
    assert first == ROWS[0] and last == emoji
    assert isinstance(bad, RowError)
    assert bad.reason == SkipReason.invalid_unicode
    assert str(bad) == f"{path}:2: invalid Unicode (lone surrogate \\ud800); fix or remove the row."


def test_a_lone_surrogate_in_a_json_list_names_the_row(tmp_path: Path) -> None:
    """In a .json list, also in a key, the row is named by its index."""
    in_key = {"messages": ROWS[1]["messages"], "\udfff": 1}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([ROWS[0], LONE, in_key]))
    rows = _read(path)
    assert rows[0][1] == ROWS[0]
    for index in (1, 2):
        assert isinstance(rows[index][1], RowError)
        assert str(rows[index][1]).startswith(f"{path}[{index}]: invalid Unicode")
    assert "\\udfff" in str(rows[2][1])


def test_evaluation_prompts_with_a_lone_surrogate_name_the_line(tmp_path: Path) -> None:
    """eval.prompts reads files the same way: one DataError naming file:line."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(LONE) + "\n")
    with pytest.raises(DataError, match=r"prompts\.jsonl:2: invalid Unicode \(lone surrogate"):
        load_prompts(str(path), multi_turn=False)
