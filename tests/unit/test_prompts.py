"""Prompt sets for the evaluator: the bundled set, every accepted jsonl shape, bad input; the
named benchmarks (each converter on a local file shaped like the hub's rows, the hub read
through a stand-in for datasets.load_dataset, offline behaviour) and eval.prompts lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleforge.errors import DataError
from eagleforge.speculative import prompts as prompts_module
from eagleforge.speculative.prompts import (
    BENCHMARKS,
    MTBENCH_SYSTEM_PROMPT,
    load_prompt_set,
    load_prompt_sets,
    load_prompts,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "benchmarks"

pytestmark = pytest.mark.unit


def test_bundled_set_has_forty_two_turn_prompts_over_eight_categories() -> None:
    items = load_prompts("mtbench_style", multi_turn=True)
    assert len(items) == 40 and all(len(item.turns) == 2 for item in items)
    assert len({item.category for item in items}) == 8
    assert len({item.id for item in items}) == 40
    assert [len(i.turns) for i in load_prompts("mtbench_style", False, limit=3)] == [1, 1, 1]


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


def rows_of(name: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


@pytest.fixture
def hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub offline and nothing cached, whatever this machine's cache holds."""
    monkeypatch.setattr(prompts_module, "hub_unavailable", lambda bench: True)
    monkeypatch.setattr(prompts_module, "hub_offline", lambda: True)


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:  # type: ignore[type-arg]
    """datasets.load_dataset answering each benchmark's hub id with its fixture's rows."""
    import datasets

    by_id = {
        "HuggingFaceH4/mt_bench_prompts": "mt_bench_prompts.jsonl",
        "openai/openai_humaneval": "openai_humaneval_test.jsonl",
        "openai/gsm8k": "gsm8k_main_test.jsonl",
        "HuggingFaceH4/MATH-500": "math500_test.jsonl",
    }
    calls: list[tuple] = []  # type: ignore[type-arg]

    def load_dataset(path: str, name: str | None = None, **kwargs: object) -> object:
        calls.append((path, name, kwargs["split"], kwargs["revision"]))
        return datasets.Dataset.from_list(rows_of(by_id[path]))

    monkeypatch.setattr(prompts_module, "hub_unavailable", lambda bench: False)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_mtbench_converter_reads_both_turns_after_the_system_prompt() -> None:
    for name in ("mt_bench_prompts.jsonl", "mt_bench_question.jsonl"):  # H4's and FastChat's
        found = load_prompt_set(f"mtbench:{FIXTURES / name}", multi_turn=True)
        assert found.name == "mtbench" and found.source == str(FIXTURES / name)
        first = found.items[0]
        assert first.turns == [
            "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
            "cultural experiences and must-see attractions.",
            "Rewrite your previous response. Start every sentence with the letter A.",
        ]
        assert first.context == [{"role": "system", "content": MTBENCH_SYSTEM_PROMPT}]
        assert [i.category for i in found.items] == ["writing", "math", "coding"]
    ids = [i.id for i in load_prompts(f"mtbench:{FIXTURES / 'mt_bench_question.jsonl'}", False)]
    assert ids == ["81", "111", "121"]
    h4 = load_prompts(f"mtbench:{FIXTURES / 'mt_bench_prompts.jsonl'}", multi_turn=False)
    assert h4[0].id == str(rows_of("mt_bench_prompts.jsonl")[0]["prompt_id"])
    assert [len(i.turns) for i in h4] == [1, 1, 1]


def test_humaneval_converter_sends_the_raw_prompt() -> None:
    items = load_prompts(f"humaneval:{FIXTURES / 'openai_humaneval_test.jsonl'}", True)
    rows = rows_of("openai_humaneval_test.jsonl")
    assert [i.turns for i in items] == [[r["prompt"]] for r in rows]
    assert [i.id for i in items] == ["HumanEval/0", "HumanEval/2"] and items[0].context == []


def test_gsm8k_converter_asks_after_five_worked_examples() -> None:
    rows = rows_of("gsm8k_main_test.jsonl")
    items = load_prompts(f"gsm8k:{FIXTURES / 'gsm8k_main_test.jsonl'}", multi_turn=True)
    assert [i.turns for i in items] == [[rows[5]["question"]], [rows[6]["question"]]]
    assert [i.id for i in items] == ["5", "6"]
    shots = items[0].context
    assert [m["role"] for m in shots] == ["user", "assistant"] * 5
    assert shots[0]["content"] == rows[0]["question"] and shots[1]["content"] == rows[0]["answer"]


def test_math500_converter_sends_the_raw_problem() -> None:
    items = load_prompts(f"math500:{FIXTURES / 'math500_test.jsonl'}", multi_turn=True)
    rows = rows_of("math500_test.jsonl")
    assert [i.turns for i in items] == [[r["problem"]] for r in rows]
    assert [i.id for i in items] == ["test/precalculus/807.json", "test/algebra/2838.json"]
    assert [i.category for i in items] == ["Precalculus", "Algebra"]


def test_local_copy_as_parquet_and_limit(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows_of("math500_test.jsonl")), path)
    items = load_prompts(f"math500:{path}", multi_turn=False, limit=1)
    assert [i.id for i in items] == ["test/precalculus/807.json"]


def test_rows_of_another_shape_are_named(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match=r"gsm8k_main_test\.jsonl:1: a humaneval row needs .*'prompt'"
    ):
        load_prompts(f"humaneval:{FIXTURES / 'gsm8k_main_test.jsonl'}", multi_turn=False)
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps(r) + "\n" for r in rows_of("gsm8k_main_test.jsonl")[:3]))
    with pytest.raises(DataError, match="gsm8k needs more than 5 rows"):
        load_prompts(f"gsm8k:{short}", multi_turn=False)
    with pytest.raises(DataError, match=r"eval\.prompts=gsm8k:.*nope\.parquet is not a"):
        load_prompts(f"gsm8k:{tmp_path / 'nope.parquet'}", multi_turn=False)


def test_hub_sets_are_read_with_their_id_config_and_split(fake_hub: list[tuple]) -> None:  # type: ignore[type-arg]
    sets = load_prompt_sets(["mtbench", "humaneval", "gsm8k", "math500"], multi_turn=False)
    assert [s.name for s in sets] == ["mtbench", "humaneval", "gsm8k", "math500"]
    assert [(s.source, len(s.items)) for s in sets] == [
        ("HuggingFaceH4/mt_bench_prompts", 3),
        ("openai/openai_humaneval", 2),
        ("openai/gsm8k", 2),
        ("HuggingFaceH4/MATH-500", 2),
    ]
    assert fake_hub == [
        ("HuggingFaceH4/mt_bench_prompts", None, "train", None),
        ("openai/openai_humaneval", None, "test", None),
        ("openai/gsm8k", "main", "test", None),
        ("HuggingFaceH4/MATH-500", None, "test", None),
    ]
    assert sets[0].items[0].where == "HuggingFaceH4/mt_bench_prompts[train row 0]"


@pytest.mark.usefixtures("hub_offline")
def test_offline_named_sets_fail_in_one_line_and_mtbench_falls_back() -> None:
    for name, bench in BENCHMARKS.items():
        if bench.fallback:
            continue
        with pytest.raises(DataError) as error:
            load_prompts(name, multi_turn=False)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"eval.prompts={name}: {bench.hub_id}")
        assert f"eval.prompts={name}:/path/to/test.parquet" in message
    fallback = load_prompt_set("mtbench", multi_turn=True)
    assert fallback.name == "mtbench" and fallback.source.endswith("mtbench_style.jsonl")
    assert len(fallback.items) == 40


def test_unreachable_hub_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def unreachable(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(prompts_module, "hub_unavailable", lambda bench: False)
    monkeypatch.setattr(prompts_module, "hub_offline", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(
        DataError,
        match=r"^eval\.prompts=gsm8k: could not load openai/gsm8k .*ConnectionError.*gsm8k:/path",
    ):
        load_prompts("gsm8k", multi_turn=False)
    assert load_prompt_set("mtbench", multi_turn=False).source.endswith("mtbench_style.jsonl")


def test_unknown_name_lists_the_benchmarks() -> None:
    with pytest.raises(DataError, match=r"eval\.prompts=gsm9k: no such file; .*humaneval, gsm8k"):
        load_prompts("gsm9k", multi_turn=False)


def test_sets_with_one_label_are_told_apart(tmp_path: Path) -> None:
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "p.jsonl").write_text('{"prompt": "hi"}\n')
    sets = load_prompt_sets(
        [str(tmp_path / "a" / "p.jsonl"), str(tmp_path / "b" / "p.jsonl")], False
    )
    assert [s.name for s in sets] == ["p_0", "p_1"]
