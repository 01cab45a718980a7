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


def test_prompts_with_images_read_as_training_data(tmp_path: Path) -> None:
    """With images allowed (data.is_vlm) every training shape carries images: a row-level
    image goes to the first user turn, per-turn images and content parts to their turn;
    paths resolve against the file's directory; a missing image names the file and line."""
    (tmp_path / "img").mkdir()
    for name in ("a.png", "b.png"):
        (tmp_path / "img" / name).write_bytes(b"")  # only existence is checked here
    rows = [
        {"turns": ["one", "two"], "image": "img/a.png"},
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "img/b.png"}]},
                {"role": "assistant", "content": "ignored"},
                {"role": "user", "content": "again", "images": ["img/a.png", "img/b.png"]},
            ]
        },
        {"prompt": "text only"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "b.png")
    items = load_prompts(str(path), multi_turn=True, images_allowed=True)
    assert [i.turns for i in items] == [["one", "two"], ["", "again"], ["text only"]]
    assert [i.images for i in items] == [[[a], []], [[b], [a, b]], [[]]]
    assert items[1].message(1) == {"role": "user", "content": "again", "images": [a, b]}
    assert items[2].message(0) == {"role": "user", "content": "text only"}
    # without images allowed (text targets) the prompts read as before
    assert load_prompts(str(path), multi_turn=True)[0].images == []
    path.write_text(json.dumps({"prompt": "x", "images": ["img/missing.png"]}) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:1: image .*missing\.png does not exist"):
        load_prompts(str(path), multi_turn=False, images_allowed=True)
