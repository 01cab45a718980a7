"""Prompt sets for the evaluator: the bundled set, every accepted jsonl shape, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleforge.errors import DataError
from eagleforge.speculative.prompts import load_prompts

pytestmark = pytest.mark.unit


def test_bundled_set_has_forty_two_turn_prompts_over_eight_categories() -> None:
    items = load_prompts("mtbench", multi_turn=True)
    assert len(items) == 40 and all(len(item.turns) == 2 for item in items)
    assert len({item.category for item in items}) == 8
    assert len({item.id for item in items}) == 40
    assert [len(i.turns) for i in load_prompts("mtbench", multi_turn=False, limit=3)] == [1, 1, 1]


def test_jsonl_shapes(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "turns": ["one", "two"]},
        {"prompt": "just this"},
        {
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "yo"},
                {"from": "human", "value": "again"},
            ]
        },  # fmt: skip
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_prompts(str(path), multi_turn=True)
    assert [i.turns for i in items] == [["one", "two"], ["just this"], ["hi", "again"], ["q"]]
    assert items[0].id == "a"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "p.jsonl:2: not valid JSON"),
        ('{"turns": []}', "p.jsonl:2: no user message"),
        ('{"turns": [3]}', "p.jsonl:2: 'turns' must be a list of non-empty strings"),
        ('{"text": "x"}', "p.jsonl:2: expected a 'turns', 'prompt'"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=message.replace("[", r"\[")):
        load_prompts(str(path), multi_turn=False)


def test_missing_file_lists_the_bundled_sets(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file.*mtbench"):
        load_prompts(str(tmp_path / "nope.jsonl"), multi_turn=False)
