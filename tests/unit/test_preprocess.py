"""Preprocessing (data/preprocess.py): reading every kind of source into the same tokenized rows, bad rows
raised or skipped and counted by reason, preformatted rows, the content-keyed cache, several
processes, and the cached vocab map. Small files in tmp_path, the real SmolLM2 tokenizer, and a
fresh cache directory per test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import eagleforge.data.preprocess as preprocess_module
from eagleforge.data.config import DataConfig, OnError
from eagleforge.data.conversations import DataFormat, SkipReason, normalise_row
from eagleforge.data.preprocess import preprocess_source
from eagleforge.data.split import build_datasets
from eagleforge.data.template import TokenizerTemplate, tokenize_rendered
from eagleforge.data.vocab import build_vocab_map, cached_vocab_map, count_supervised_tokens
from eagleforge.errors import ConfigError, DataError

pytestmark = pytest.mark.unit

GOOD_ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
            {"role": "assistant", "content": "Green, like grass."},
        ]
    },
]
LONG_REPLY = " ".join(["word"] * 300)

# One bad line per reason; the raw line and a fragment of the error detail.
BAD_LINES: dict[SkipReason, tuple[bytes, str]] = {
    SkipReason.invalid_json: (b'{"messages": [', "not valid JSON"),
    SkipReason.invalid_utf8: (b'{"messages": "\xff\xfe"}', "invalid UTF-8"),
    SkipReason.invalid_unicode: (
        b'{"messages": [{"role": "user", "content": "cut \\ud800 off"}, '
        b'{"role": "assistant", "content": "y"}]}',
        "invalid Unicode (lone surrogate \\ud800)",
    ),
    SkipReason.malformed_row: (b"[1, 2]", "expected a JSON object"),
    SkipReason.unknown_role: (
        json.dumps(
            {
                "messages": [
                    {"role": "wizard", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ]
            }
        ).encode(),
        "unknown role 'wizard'",
    ),
    SkipReason.empty_content: (
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "  "},
                ]
            }
        ).encode(),
        "empty content",
    ),
    SkipReason.non_string_content: (
        json.dumps(
            {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}
        ).encode(),
        "must be a string, got int",
    ),
    SkipReason.no_assistant_turn: (
        json.dumps({"messages": [{"role": "user", "content": "Anyone?"}]}).encode(),
        "no assistant turn",
    ),
    SkipReason.too_long: (
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "Talk a lot."},
                    {"role": "assistant", "content": LONG_REPLY},
                ]
            }
        ).encode(),
        "exceed data.max_length=128",
    ),
}
MAX_LENGTH = 128


def _config(path: Path | str, **overrides) -> DataConfig:  # type: ignore[no-untyped-def]
    settings = {
        "name": "t",
        "format": DataFormat.auto,
        "path": str(path),
        "max_length": MAX_LENGTH,
        "truncate": False,
        "num_eval_samples": 0,
    }
    settings.update(overrides)
    return DataConfig(**settings)


def _write_jsonl(path: Path, rows: list) -> Path:  # type: ignore[type-arg]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _pairs(dataset) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    return [(list(ids), list(mask)) for ids, mask in dataset]


def _reference(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    """The expected samples, computed without data/preprocess.py."""
    template = TokenizerTemplate(tokenizer)
    rendered = [template.render(normalise_row(row, DataFormat.auto, "ref"), "ref") for row in rows]
    return tokenize_rendered(rendered, tokenizer)


def _run(cfg: DataConfig, tokenizer, cache: Path):  # type: ignore[no-untyped-def]
    return preprocess_source(cfg, cfg.format, cfg.sources(), tokenizer, cache, cfg.max_num_samples)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def reference(smollm2_tokenizer) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    samples = _reference(smollm2_tokenizer, GOOD_ROWS)
    assert all(len(ids) < MAX_LENGTH for ids, _ in samples)
    return samples


# --- bad rows ------------------------------------------------------------------------------


@pytest.mark.parametrize("reason", list(BAD_LINES), ids=[r.value for r in BAD_LINES])
def test_on_error_raise_names_file_line_and_problem(
    smollm2_tokenizer, tmp_path: Path, cache: Path, reason: SkipReason
) -> None:  # type: ignore[no-untyped-def]
    """on_error=raise: the bad line 2 stops preprocessing with a DataError naming file:2, the
    problem, and data.on_error=skip; nothing is cached."""
    line, fragment = BAD_LINES[reason]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps(GOOD_ROWS[0]).encode() + b"\n" + line + b"\n")
    with pytest.raises(DataError) as info:
        _run(_config(path), smollm2_tokenizer, cache)
    message = str(info.value)
    assert message.startswith(f"{path}:2: ")
    assert fragment in message
    assert "set data.on_error=skip" in message
    assert not (cache / "data").exists() or not any((cache / "data").iterdir())


def test_on_error_skip_counts_each_reason(
    smollm2_tokenizer, tmp_path: Path, cache: Path, reference
) -> None:  # type: ignore[no-untyped-def]
    """on_error=skip: every bad row is counted under its reason exactly once; the good rows
    (interleaved with them) are kept in order with the expected ids and masks."""
    lines = [json.dumps(GOOD_ROWS[0]).encode()]
    lines += [BAD_LINES[r][0] for r in list(BAD_LINES)[:4]]
    lines += [json.dumps(GOOD_ROWS[1]).encode(), b""]  # a blank line is not a row
    lines += [BAD_LINES[r][0] for r in list(BAD_LINES)[4:]]
    lines += [json.dumps(GOOD_ROWS[2]).encode()]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    dataset, report, entry = _run(_config(path, on_error=OnError.skip), smollm2_tokenizer, cache)
    assert report.skipped == {reason.value: 1 for reason in BAD_LINES}
    assert report.rows == len(GOOD_ROWS) + len(BAD_LINES)
    assert report.kept == len(dataset) == len(GOOD_ROWS)
    assert _pairs(dataset) == reference
    assert report.tokens == sum(len(ids) for ids, _ in reference)
    assert report.supervised_tokens == sum(sum(mask) for _, mask in reference)
    assert report.truncated == 0
    assert (entry / "report.json").exists()
    metrics = report.metrics("data")
    assert metrics["data/skipped_invalid_utf8"] == 1.0
    assert metrics["data/kept"] == 3.0


def test_template_error_is_a_skip_reason(smollm2_tokenizer, tmp_path: Path, cache: Path) -> None:  # type: ignore[no-untyped-def]
    """A conversation the (named) template rejects -- tool calls -- is a template_error row."""
    tool_row = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w"}}]},
            {"role": "tool", "content": "Sunny"},
            {"role": "assistant", "content": "Sunny."},
        ]
    }
    path = _write_jsonl(tmp_path / "rows.jsonl", [GOOD_ROWS[0], tool_row])
    _, report, _ = _run(
        _config(path, template="chatml", on_error=OnError.skip), smollm2_tokenizer, cache
    )
    assert report.skipped == {"template_error": 1}
    assert report.kept == 1
    with pytest.raises(DataError, match=r"rows\.jsonl:2: turn 1 has tool calls"):
        _run(_config(path, template="chatml"), smollm2_tokenizer, cache)


def test_truncation(smollm2_tokenizer, tmp_path: Path, cache: Path) -> None:  # type: ignore[no-untyped-def]
    """truncate=true keeps the first max_length tokens and counts the row as truncated; a row
    whose reply starts after max_length has nothing to train on and is skipped as too_long."""
    long_reply = {
        "messages": [
            {"role": "user", "content": "Talk a lot."},
            {"role": "assistant", "content": LONG_REPLY},
        ]
    }
    long_prompt = {
        "messages": [
            {"role": "user", "content": LONG_REPLY},
            {"role": "assistant", "content": "Ok."},
        ]
    }
    path = _write_jsonl(tmp_path / "rows.jsonl", [long_reply, long_prompt, GOOD_ROWS[1]])
    dataset, report, _ = _run(
        _config(path, truncate=True, on_error=OnError.skip), smollm2_tokenizer, cache
    )
    full = _reference(smollm2_tokenizer, [long_reply])[0]
    assert report.skipped == {"too_long": 1}
    assert report.truncated == 1
    assert _pairs(dataset)[0] == (full[0][:MAX_LENGTH], full[1][:MAX_LENGTH])
    assert len(dataset[0][0]) == MAX_LENGTH


def test_no_usable_row_is_an_error(smollm2_tokenizer, tmp_path: Path, cache: Path) -> None:  # type: ignore[no-untyped-def]
    """Every row skipped: DataError naming the file and the report."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(BAD_LINES[SkipReason.no_assistant_turn][0] + b"\n")
    with pytest.raises(DataError, match=r"no usable conversation .*1 no_assistant_turn"):
        _run(_config(path, on_error=OnError.skip), smollm2_tokenizer, cache)


def test_max_num_samples_takes_the_first_rows(
    smollm2_tokenizer, tmp_path: Path, cache: Path, reference
) -> None:  # type: ignore[no-untyped-def]
    """max_num_samples=2 keeps the first two rows."""
    path = _write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    dataset, report, _ = _run(_config(path, max_num_samples=2), smollm2_tokenizer, cache)
    assert _pairs(dataset) == reference[:2]
    assert report.rows == 2


# --- sources -------------------------------------------------------------------------------


def _jsonl(tmp_path: Path) -> DataConfig:
    return _config(_write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS))


def _json(tmp_path: Path) -> DataConfig:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(GOOD_ROWS, indent=1), encoding="utf-8")
    return _config(path)


def _parquet(tmp_path: Path) -> DataConfig:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(GOOD_ROWS), path)
    return _config(path)


def _hf_dir(tmp_path: Path) -> DataConfig:
    import datasets

    path = tmp_path / "hf"
    datasets.Dataset.from_list(GOOD_ROWS).save_to_disk(str(path))
    return _config(path)


def _glob(tmp_path: Path) -> DataConfig:
    _write_jsonl(tmp_path / "part-a.jsonl", GOOD_ROWS[:2])
    _write_jsonl(tmp_path / "part-b.jsonl", GOOD_ROWS[2:])
    return _config(tmp_path / "part-*.jsonl")


def _extra_paths(tmp_path: Path) -> DataConfig:
    first = _write_jsonl(tmp_path / "first.jsonl", GOOD_ROWS[:1])
    (tmp_path / "more").mkdir()
    _write_jsonl(tmp_path / "more" / "x1.jsonl", GOOD_ROWS[1:2])
    _write_jsonl(tmp_path / "more" / "x2.jsonl", GOOD_ROWS[2:])
    return _config(first, extra_paths=[str(tmp_path / "more" / "x*.jsonl")])


def _sharegpt(tmp_path: Path) -> DataConfig:
    rows = [
        {
            "conversations": [
                {
                    "from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                    "value": m["content"],
                }
                for m in row["messages"]
            ]
        }
        for row in GOOD_ROWS
    ]
    return _config(_write_jsonl(tmp_path / "rows.jsonl", rows), format=DataFormat.sharegpt)


@pytest.mark.parametrize(
    "make",
    [_jsonl, _json, _parquet, _hf_dir, _glob, _extra_paths, _sharegpt],
    ids=["jsonl", "json", "parquet", "hf-dir", "glob", "extra-paths", "sharegpt"],
)
def test_every_source_kind_gives_the_same_rows(
    smollm2_tokenizer, tmp_path: Path, cache: Path, reference, make
) -> None:  # type: ignore[no-untyped-def]
    """.jsonl, .json, .parquet, a saved HF dataset, a glob, extra_paths and ShareGPT rows all give
    the reference samples, in order."""
    dataset, report, _ = _run(make(tmp_path), smollm2_tokenizer, cache)
    assert _pairs(dataset) == reference
    assert (report.rows, report.kept, report.skipped) == (3, 3, {})


def test_parquet_mixing_formats(smollm2_tokenizer, tmp_path: Path, cache: Path) -> None:  # type: ignore[no-untyped-def]
    """A parquet file mixing ShareGPT and OpenAI rows reads like the same rows in .jsonl."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        GOOD_ROWS[1],
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
    ]
    path = tmp_path / "rows.parquet"
    # from_pylist infers the schema from the first row alone: give it both columns.
    schema = pa.unify_schemas([pa.Table.from_pylist([row]).schema for row in rows])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    dataset, _, _ = _run(_config(path, on_error=OnError.skip), smollm2_tokenizer, cache)
    assert _pairs(dataset) == _reference(smollm2_tokenizer, rows)


# --- preformatted rows -----------------------------------------------------------------------


def _preformatted_file(tokenizer, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in GOOD_ROWS]
    return _write_jsonl(tmp_path / "text.jsonl", [{"text": text} for text in texts])


def test_preformatted_rows_match_messages(
    smollm2_tokenizer, tmp_path: Path, cache: Path, reference
) -> None:  # type: ignore[no-untyped-def]
    """preformatted=true on the SmolLM2-templated text of the rows gives the same ids and masks
    as the messages themselves."""
    path = _preformatted_file(smollm2_tokenizer, tmp_path)
    dataset, report, _ = _run(_config(path, preformatted=True), smollm2_tokenizer, cache)
    assert _pairs(dataset) == reference
    assert report.kept == 3


def test_preformatted_bad_rows_are_counted(smollm2_tokenizer, tmp_path: Path, cache: Path) -> None:  # type: ignore[no-untyped-def]
    """Preformatted rows without text, with non-string or empty text are skipped by reason."""
    path = _preformatted_file(smollm2_tokenizer, tmp_path)
    with path.open("a", encoding="utf-8") as f:
        for row in [{"messages": []}, {"text": 3}, {"text": "  "}]:
            f.write(json.dumps(row) + "\n")
    _, report, _ = _run(
        _config(path, preformatted=True, on_error=OnError.skip), smollm2_tokenizer, cache
    )
    assert report.skipped == {"malformed_row": 1, "non_string_content": 1, "empty_content": 1}
    assert report.kept == 3


def test_preformatted_train_only_last_turn(smollm2_tokenizer, tmp_path: Path, cache: Path) -> None:  # type: ignore[no-untyped-def]
    """train_only_last_turn applies to preformatted rows as to messages rows."""
    messages_path = _write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    text_path = _preformatted_file(smollm2_tokenizer, tmp_path)
    expected, _, _ = _run(
        _config(messages_path, train_only_last_turn=True), smollm2_tokenizer, cache
    )
    got, _, _ = _run(
        _config(text_path, preformatted=True, train_only_last_turn=True), smollm2_tokenizer, cache
    )
    assert _pairs(got) == _pairs(expected)


def test_preformatted_row_without_reply_is_skipped(
    smollm2_tokenizer, tmp_path: Path, cache: Path
) -> None:  # type: ignore[no-untyped-def]
    """A preformatted row with no assistant reply is skipped (and counted) under on_error=skip."""
    path = _preformatted_file(smollm2_tokenizer, tmp_path)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "<|im_start|>user\nHi<|im_end|>\n"}) + "\n")
    _, report, _ = _run(
        _config(path, preformatted=True, on_error=OnError.skip), smollm2_tokenizer, cache
    )
    assert report.kept == 3
    assert sum(report.skipped.values()) == 1


def test_train_only_last_turn(smollm2_tokenizer, tmp_path: Path, cache: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """train_only_last_turn: same ids, only the last reply of each row supervised."""
    path = _write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    dataset, _, _ = _run(_config(path, train_only_last_turn=True), smollm2_tokenizer, cache)
    for (ids, mask), (ref_ids, ref_mask) in zip(_pairs(dataset), reference, strict=True):
        assert ids == ref_ids
        start = max(i for i in range(1, len(ref_mask)) if ref_mask[i] > ref_mask[i - 1])
        assert mask == [0] * start + ref_mask[start:]
    assert sum(_pairs(dataset)[2][1]) < sum(reference[2][1])


# --- cache ---------------------------------------------------------------------------------


def _forbid_preprocessing(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("preprocess_rows called: the cache was not used")

    monkeypatch.setattr(preprocess_module, "preprocess_rows", fail)


def _count_preprocessing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = preprocess_module.preprocess_rows

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(preprocess_module, "preprocess_rows", counting)
    return calls


def test_second_call_loads_from_cache(
    smollm2_tokenizer, tmp_path: Path, cache: Path, reference, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The second identical call returns the cached entry (no preprocessing): same samples,
    report and entry; num_proc is not part of the key."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        b"\n".join(
            [json.dumps(r).encode() for r in GOOD_ROWS] + [BAD_LINES[SkipReason.invalid_json][0]]
        )
    )
    cfg = _config(path, on_error=OnError.skip)
    first, first_report, entry = _run(cfg, smollm2_tokenizer, cache)
    _forbid_preprocessing(monkeypatch)
    second, second_report, again = _run(cfg, smollm2_tokenizer, cache)
    assert again == entry
    assert _pairs(second) == _pairs(first) == reference
    assert second_report == first_report
    assert second_report.skipped == {"invalid_json": 1}
    # num_proc is not part of the key: still served from the cache
    _run(_config(path, on_error=OnError.skip, num_proc=2), smollm2_tokenizer, cache)


def test_a_lookup_removes_the_temporary_of_a_killed_write(
    smollm2_tokenizer, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A write killed midway leaves its temporary directory; the next lookup (a cache hit
    here) removes it, since its writer no longer runs."""
    cfg = _config(_write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS))
    _, _, entry = _run(cfg, smollm2_tokenizer, cache)
    real_save = preprocess_module._save

    def killed(dataset, report, out: Path) -> None:  # type: ignore[no-untyped-def]
        real_save(dataset, report, out)
        os._exit(9)  # before the rename

    monkeypatch.setattr(preprocess_module, "_save", killed)
    pid = os.fork()
    if pid == 0:  # the writer: another entry of the same cache (a longer max_length)
        try:
            _run(_config(cfg.path, max_length=MAX_LENGTH + 1), smollm2_tokenizer, cache)
        finally:
            os._exit(0)  # never back into pytest
    assert os.waitpid(pid, 0)[1] >> 8 == 9
    left = [p for p in entry.parent.iterdir() if p.name.startswith(".")]
    assert len(left) == 1 and (left[0] / "report.json").is_file()
    _forbid_preprocessing(monkeypatch)
    _run(cfg, smollm2_tokenizer, cache)
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


def test_editing_the_file_rebuilds(
    smollm2_tokenizer, tmp_path: Path, cache: Path, reference, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """New content at the same path is a new cache entry with the new rows."""
    path = _write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    _, _, entry = _run(_config(path), smollm2_tokenizer, cache)
    _write_jsonl(path, GOOD_ROWS[1:])
    calls = _count_preprocessing(monkeypatch)
    dataset, report, new_entry = _run(_config(path), smollm2_tokenizer, cache)
    assert calls == [1]
    assert new_entry != entry
    assert _pairs(dataset) == reference[1:]
    assert report.kept == 2


@pytest.mark.parametrize(
    "change",
    [
        {"max_length": MAX_LENGTH + 1},
        {"truncate": True},
        {"train_only_last_turn": True},
        {"template": "chatml"},
        {"on_error": OnError.skip},
        {"max_num_samples": 2},
    ],
    ids=["max_length", "truncate", "last_turn", "template", "on_error", "limit"],
)
def test_changing_an_option_rebuilds(
    smollm2_tokenizer, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, change: dict
) -> None:  # type: ignore[no-untyped-def]
    """Every option that can change the result is part of the key: a new entry is built."""
    path = _write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    _, _, entry = _run(_config(path), smollm2_tokenizer, cache)
    calls = _count_preprocessing(monkeypatch)
    _, _, new_entry = _run(_config(path, **change), smollm2_tokenizer, cache)
    assert calls == [1]
    assert new_entry != entry
    assert new_entry.parent == entry.parent


def test_leftover_tmp_dir_is_not_loaded(smollm2_tokenizer, tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """A temporary directory left by a crashed writer (complete-looking, with other data) is never
    read: the entry is built afresh."""
    path = _write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    _, _, probe = _run(_config(path), smollm2_tokenizer, tmp_path / "probe")
    cache = tmp_path / "cache"
    leftover = _mkdir(cache / "data" / f".{probe.name}.abc123")
    bogus = preprocess_module.TokenizedDataset([[1, 2, 3]], [[0, 1, 1]])
    preprocess_module._save(bogus, preprocess_module.DataReport(rows=1, kept=1), leftover)
    dataset, report, entry = _run(_config(path), smollm2_tokenizer, cache)
    assert entry.name == probe.name
    assert _pairs(dataset) == reference
    assert report.kept == 3
    assert (entry / "report.json").exists()


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def test_half_written_entry_is_not_loaded(smollm2_tokenizer, tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """An entry directory without report.json (half written) is not loaded: the data is rebuilt."""
    path = _write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    _, _, probe = _run(_config(path), smollm2_tokenizer, tmp_path / "probe")
    cache = tmp_path / "cache"
    half = _mkdir(cache / "data" / probe.name)
    bogus = preprocess_module.TokenizedDataset([[1, 2, 3]], [[0, 1, 1]])
    preprocess_module._save(bogus, preprocess_module.DataReport(rows=1, kept=1), half)
    (half / "report.json").unlink()
    dataset, report, entry = _run(_config(path), smollm2_tokenizer, cache)
    assert entry == half
    assert _pairs(dataset) == reference
    assert report.kept == 3


def test_half_written_entry_is_replaced(
    smollm2_tokenizer, tmp_path: Path, reference, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """After rebuilding over a half-written entry, the next call loads from the cache."""
    path = _write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    _, _, probe = _run(_config(path), smollm2_tokenizer, tmp_path / "probe")
    cache = tmp_path / "cache"
    half = _mkdir(cache / "data" / probe.name)
    (half / "dataset").mkdir()
    _run(_config(path), smollm2_tokenizer, cache)
    _forbid_preprocessing(monkeypatch)
    dataset, _, _ = _run(_config(path), smollm2_tokenizer, cache)
    assert _pairs(dataset) == reference


@pytest.mark.timeout(120)
def test_num_proc_2_matches_num_proc_1(
    smollm2_tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Two worker processes over many small chunks give the same samples, order and report."""
    monkeypatch.setattr(preprocess_module, "CHUNK_ROWS", 2)
    lines = []
    for index in range(5):
        for row in GOOD_ROWS:
            lines.append(json.dumps(row).encode())
        lines.append(list(BAD_LINES.values())[index][0])
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    results = []
    for num_proc in (1, 2):
        cfg = _config(path, on_error=OnError.skip, num_proc=num_proc)
        dataset, report, _ = _run(cfg, smollm2_tokenizer, tmp_path / f"cache{num_proc}")
        results.append((_pairs(dataset), report))
    assert results[0] == results[1]
    assert results[0][1].kept == 15
    assert sum(results[0][1].skipped.values()) == 5


@pytest.mark.timeout(120)
def test_num_proc_2_raises_on_bad_row(
    smollm2_tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """With two processes, on_error=raise still names the bad row."""
    monkeypatch.setattr(preprocess_module, "CHUNK_ROWS", 2)
    lines = [json.dumps(row).encode() for row in GOOD_ROWS * 2]
    lines.insert(4, BAD_LINES[SkipReason.unknown_role][0])
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=rf"{path}:5: turn 0 has unknown role 'wizard'"):
        _run(_config(path, num_proc=2), smollm2_tokenizer, tmp_path / "cache")


# --- build_datasets --------------------------------------------------------------------------


def test_build_datasets_holdout_split(
    smollm2_tokenizer, tmp_path: Path, cache: Path, reference
) -> None:  # type: ignore[no-untyped-def]
    """num_eval_samples holds out that many rows by a seeded permutation: train and eval are
    disjoint, cover every row, and the same seed gives the same split and cache key."""
    path = _write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    cfg = _config(path, num_eval_samples=1)
    prepared = build_datasets(cfg, smollm2_tokenizer, cache, seed=3)
    assert prepared.eval is not None
    assert len(prepared.train) == 2 and len(prepared.eval) == 1
    assert sorted(_pairs(prepared.train) + _pairs(prepared.eval)) == sorted(reference)
    again = build_datasets(cfg, smollm2_tokenizer, cache, seed=3)
    assert _pairs(again.eval) == _pairs(prepared.eval)  # type: ignore[arg-type]
    assert again.cache_key == prepared.cache_key
    assert prepared.cache_key.endswith("-holdout1-seed3")
    assert build_datasets(cfg, smollm2_tokenizer, cache, seed=4).cache_key != prepared.cache_key


def test_build_datasets_eval_path_and_no_eval(
    smollm2_tokenizer, tmp_path: Path, cache: Path, reference
) -> None:  # type: ignore[no-untyped-def]
    """eval_path: eval is that file's rows and train keeps every row; num_eval_samples=0: no eval;
    holding out every row is a ConfigError."""
    train = _write_jsonl(tmp_path / "train.jsonl", GOOD_ROWS)
    held = _write_jsonl(tmp_path / "eval.jsonl", GOOD_ROWS[2:])
    prepared = build_datasets(_config(train, eval_path=str(held)), smollm2_tokenizer, cache, seed=0)
    assert _pairs(prepared.train) == reference
    assert _pairs(prepared.eval) == reference[2:]  # type: ignore[arg-type]
    assert prepared.report.kept == 3
    assert build_datasets(_config(train), smollm2_tokenizer, cache, seed=0).eval is None
    with pytest.raises(ConfigError, match="num_eval_samples=3"):
        build_datasets(_config(train, num_eval_samples=3), smollm2_tokenizer, cache, seed=0)


@pytest.mark.parametrize(("num_rows", "num_eval"), [(19, 0), (40, 2), (108, 5), (1400, 64)])
def test_default_holdout_scales_with_the_data(
    smollm2_tokenizer, tmp_path: Path, cache: Path, num_rows: int, num_eval: int
) -> None:  # type: ignore[no-untyped-def]
    """num_eval_samples unset: 5% of the usable conversations are held out, at most 64 (and
    none below 20), so a small file keeps 95% of its rows for training."""
    rows = [
        {"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "A"}]}
        for i in range(num_rows)
    ]
    cfg = DataConfig(name="t", path=str(_write_jsonl(tmp_path / "rows.jsonl", rows)))
    assert cfg.num_eval_samples is None
    prepared = build_datasets(cfg, smollm2_tokenizer, cache, seed=0)
    assert len(prepared.eval or []) == num_eval
    assert len(prepared.train) == num_rows - num_eval


# --- vocab cache ---------------------------------------------------------------------------


def test_cached_vocab_map_writes_once_and_reloads(tmp_path: Path) -> None:
    """The first call builds and writes the map; later calls load it (ignoring the samples),
    giving equal tensors; no temporary file is left behind."""
    samples = [([1, 2, 2, 3, 5], [0, 1, 1, 1, 0]), ([7, 7, 7, 4], [1, 1, 1, 0])]
    cache_file = tmp_path / "vocab" / "key-10-3.safetensors"
    first = cached_vocab_map(samples, 10, 3, cache_file)
    expected = build_vocab_map(count_supervised_tokens(samples, 10), 3)
    assert torch.equal(first.d2t_W, expected.d2t_W) and torch.equal(first.t2d_V, expected.t2d_V)
    assert first.draft_ids_W.tolist() == [2, 3, 7]
    assert cache_file.exists()
    mtime = os.stat(cache_file).st_mtime_ns
    other = [([9, 9, 8, 8, 6], [1, 1, 1, 1, 1])]
    again = cached_vocab_map(other, 10, 3, cache_file)
    assert torch.equal(again.d2t_W, first.d2t_W)
    assert torch.equal(again.t2d_V, first.t2d_V)
    assert again.d2t_W.dtype == torch.int64 and again.t2d_V.dtype == torch.bool
    assert os.stat(cache_file).st_mtime_ns == mtime
    assert sorted(p.name for p in cache_file.parent.iterdir()) == [cache_file.name]
