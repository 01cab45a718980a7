"""Named hub corpora (data=ultrachat, ...) and mixtures (data=mix): each converter on a fixture
shaped like its corpus's real rows (tests/fixtures/corpora), the hub path through `datasets`
with the hub replaced by those files, the offline preflight, and mixture sampling and dedup."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagleforge.config import compose_config, group_choices, to_typed
from eagleforge.data.config import DataConfig
from eagleforge.data.conversations import DataFormat, RowError, normalise_row
from eagleforge.data.corpora import CORPORA, MixSource, content_key, quotas
from eagleforge.data.sources import training_source
from eagleforge.data.split import build_datasets
from eagleforge.errors import ConfigError, DataError
from eagleforge.preflight import check_inputs
from eagleforge.regeneration.rows import read_input

pytestmark = pytest.mark.unit

CORPORA_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "corpora"
FIXTURE = {
    "sharegpt": "sharegpt_vicuna.json",
    "ultrachat": "ultrachat_200k.parquet",
    "magpie_qwen25_pro": "magpie_qwen25_pro.parquet",
    "perfectblend": "open_perfectblend.parquet",
    "perfectblend_llama3_8b": "perfectblend_regenerated.jsonl",
    "perfectblend_llama3_70b": "perfectblend_regenerated.jsonl",
    "opencoder_sft1": "opc_sft_stage1.parquet",
    "gsm8k": "gsm8k_main.parquet",
}


def data_config(name: str, *overrides: str) -> DataConfig:
    return to_typed(
        compose_config(["+model=smollm2", f"data={name}", "output_dir=.", *overrides])
    ).data


def converted(name: str) -> list[Any]:
    """Each fixture row of corpus ``name`` read from a local copy: messages, or the skip reason."""
    source = training_source(data_config(name, f"data.path={CORPORA_DIR / FIXTURE[name]}"))
    out: list[Any] = []
    for where, row in source.rows():
        try:
            out.append(normalise_row(row, source.fmt, where))
        except RowError as e:
            out.append(e.reason.value)
    return out


def test_every_corpus_has_a_data_config_that_agrees_with_the_registry() -> None:
    assert set(CORPORA) <= set(group_choices("data"))
    assert set(FIXTURE) == set(CORPORA)
    for name, corpus in CORPORA.items():
        data = data_config(name)
        assert (data.hub_id, data.subset, data.split, data.format, data.streaming) == (
            corpus.hub_id,
            corpus.subset,
            corpus.split,
            corpus.format,
            corpus.streaming,
        ), name
        assert data.path is None and data.sources() == []


def test_sharegpt_converter_keeps_system_prompts_and_maps_role_names() -> None:
    rows = converted("sharegpt")
    assert rows[0] == [
        {"role": "user", "content": "What is a good name for a grey cat?"},
        {"role": "assistant", "content": "A few ideas: Ash, Smokey, Pebble or Earl Grey."},
    ]
    assert [m["role"] for m in rows[2]] == ["system", "user", "assistant"]
    # chatgpt / user / bing: the alternate names of a real export
    assert [m["role"] for m in rows[3]] == ["user", "assistant", "user", "assistant"]
    assert rows[4][0]["role"] == "assistant"  # an export that starts on a reply is kept as is
    assert rows[5:] == ["empty_content", "no_assistant_turn", "no_assistant_turn"]


def test_ultrachat_converter_reads_messages_and_drops_prompt_columns() -> None:
    rows = converted("ultrachat")
    assert [m["role"] for m in rows[0]] == ["user", "assistant", "user", "assistant"]
    assert rows[0][0] == {"role": "user", "content": "How do tides work?"}
    assert all(set(m) == {"role", "content"} for m in rows[0] + rows[1])
    assert rows[2] == "empty_content"  # a reply that is an empty string


def test_magpie_converter_keeps_the_conversation_and_drops_metadata() -> None:
    rows = converted("magpie_qwen25_pro")
    assert rows[0] == [
        {"role": "user", "content": "Explain what a hash map is."},
        {
            "role": "assistant",
            "content": "A hash map stores key-value pairs in buckets chosen by hashing the key, "
            "so lookups take constant time on average.",
        },
    ]
    assert rows[1][1]["content"].startswith("```python")
    assert rows[2] == "empty_content"


def test_perfectblend_converter_keeps_system_prompts_and_drops_source() -> None:
    rows = converted("perfectblend")
    assert len(rows[0]) == 2 and rows[0][1]["content"].endswith("The answer is: 5")
    assert rows[1][0] == {
        "role": "system",
        "content": "You are a helpful assistant who answers in French.",
    }
    assert [m["role"] for m in rows[2]] == ["user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("name", ["perfectblend_llama3_8b", "perfectblend_llama3_70b"])
def test_regenerated_perfectblend_converter_reads_role_content_turns(name: str) -> None:
    rows = converted(name)
    assert rows[0][1] == {
        "role": "assistant",
        "content": "Subtracting 5 from both sides gives 3x = 15, so x = 5.",
    }
    assert [m["role"] for m in rows[1]] == ["system", "user", "assistant"]
    assert rows[2] == "empty_content"


def test_opencoder_converter_makes_one_exchange() -> None:
    rows = converted("opencoder_sft1")
    assert rows[0] == [
        {"role": "user", "content": "Write a SQL query that counts the rows of table users."},
        {"role": "assistant", "content": "```sql\nSELECT COUNT(*) FROM users;\n```"},
    ]
    assert rows[1][0]["content"] == "用 Python 写一个判断回文的函数。"
    assert rows[2] == "non_string_content"  # a null output


def test_gsm8k_converter_drops_calculator_annotations() -> None:
    rows = converted("gsm8k")
    assert rows[0][1]["content"] == (
        "Each day she earns 12 * 3 = $36.\nIn 5 days she earns 36 * 5 = $180.\n#### 180"
    )
    assert rows[1][0]["content"].startswith("Tom has 20 marbles")


def test_pair_converter_names_a_missing_column() -> None:
    with pytest.raises(RowError, match="missing the 'answer' field"):
        normalise_row({"question": "2+2?"}, DataFormat.gsm8k, "f.jsonl:1")


# ---------------------------------------------------------------------------------------------
# The hub path, with the hub replaced by the fixtures


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """datasets.load_dataset(hub_id, ...) reads the corpus's fixture; records each call."""
    import datasets

    real = datasets.load_dataset
    by_hub_id = {CORPORA[name].hub_id: CORPORA_DIR / file for name, file in FIXTURE.items()}
    calls: list[dict[str, Any]] = []

    def load_dataset(path: str, name: str | None = None, **kwargs: Any) -> Any:
        calls.append({"path": path, "name": name, **kwargs})
        file = by_hub_id[path]
        builder = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}[file.suffix]
        return real(
            builder, data_files=str(file), split="train", streaming=kwargs.get("streaming", False)
        )

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_named_corpus_trains_without_a_path(  # type: ignore[no-untyped-def]
    fake_hub: list[dict[str, Any]], smollm2_tokenizer, tmp_path: Path
) -> None:
    data = data_config("ultrachat", "data.num_eval_samples=0")
    prepared = build_datasets(data, smollm2_tokenizer, tmp_path, seed=0)
    assert fake_hub[0] == {
        "path": "HuggingFaceH4/ultrachat_200k",
        "name": None,
        "split": "train_sft",
        "revision": None,
        "streaming": False,
    }
    assert prepared.report.rows == 3 and prepared.report.kept == 2
    assert prepared.report.skipped == {"empty_content": 1}
    assert all(sum(mask) > 0 for _, mask in prepared.train)
    # the split and the revision are part of the cache key; the same config hits the cache
    again = build_datasets(data, smollm2_tokenizer, tmp_path, seed=0)
    assert again.cache_key == prepared.cache_key
    other = data_config("ultrachat", "data.num_eval_samples=0", "data.revision=abc123")
    assert build_datasets(other, smollm2_tokenizer, tmp_path, seed=0).cache_key != (
        prepared.cache_key
    )


def test_streamed_corpus_is_bounded_by_max_num_samples(  # type: ignore[no-untyped-def]
    fake_hub: list[dict[str, Any]], smollm2_tokenizer, tmp_path: Path
) -> None:
    data = data_config("perfectblend", "data.num_eval_samples=0", "data.max_num_samples=2")
    prepared = build_datasets(data, smollm2_tokenizer, tmp_path, seed=0)
    assert fake_hub[0]["streaming"] is True and fake_hub[0]["path"] == "mlabonne/open-perfectblend"
    assert prepared.report.rows == 2


def test_regenerate_reads_a_named_corpus(fake_hub: list[dict[str, Any]]) -> None:
    rows, bad = read_input(data_config("gsm8k"), limit=None)
    assert [row.messages[1]["content"][-6:] for row in rows] == ["## 180", "### 10"]
    assert bad == [] and fake_hub[0]["name"] == "main"


def test_unreachable_hub_at_load_is_one_line_naming_the_source(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import datasets

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("Couldn't reach 'HuggingFaceH4/ultrachat_200k' on the Hub\nmore")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataError) as info:
        list(training_source(data_config("ultrachat")).rows())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("data=ultrachat (HuggingFaceH4/ultrachat_200k) cannot be read")
    assert "set data.path=/local/copy" in message


# ---------------------------------------------------------------------------------------------
# Preflight: offline, a named source fails at startup, in one line, without network


@pytest.fixture
def offline_empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the offline preflight must not touch the network")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", no_network)
    return tmp_path


def typed(*overrides: str):  # type: ignore[no-untyped-def]
    return to_typed(compose_config(["+model=smollm2", "output_dir=.", *overrides]))


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_offline_named_source_fails_at_startup_naming_it(
    name: str, offline_empty_cache: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        check_inputs(typed(f"data={name}"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"data={name} ({CORPORA[name].hub_id}) cannot be read")
    assert "set data.path=/local/copy" in message


def test_offline_cached_source_passes_and_local_copy_wins(offline_empty_cache: Path) -> None:
    (offline_empty_cache / "datasets" / "HuggingFaceH4___ultrachat_200k").mkdir(parents=True)
    check_inputs(typed("data=ultrachat"))
    check_inputs(typed("data=perfectblend", f"data.path={CORPORA_DIR / FIXTURE['perfectblend']}"))


def test_offline_mixture_names_the_entry_to_point_at_a_copy(offline_empty_cache: Path) -> None:
    sharegpt = CORPORA_DIR / FIXTURE["sharegpt"]
    with pytest.raises(ConfigError, match=r"data=mix corpus ultrachat .*data\.mixture\.1\.path="):
        check_inputs(typed("data=mix", f"data.mixture.0.path={sharegpt}"))


def test_paper_experiment_composes_for_both_steps() -> None:
    config = typed("+experiment=eagle3_paper_llama3_8b")
    assert [(e.corpus, e.split) for e in config.data.mixture] == [
        ("sharegpt", "train"),
        ("ultrachat", "train_sft"),
    ]
    assert config.regenerate.temperature == 0.0
    trained = typed("+experiment=eagle3_paper_llama3_8b", "data.path=regenerated.jsonl")
    assert trained.data.sources() == ["regenerated.jsonl"]


# ---------------------------------------------------------------------------------------------
# Mixtures


def test_quotas_take_counts_then_share_the_rest_by_weight() -> None:
    entries = [
        MixSource("sharegpt", num_samples=10),
        MixSource("ultrachat", weight=3.0),
        MixSource("gsm8k", weight=1.0),
    ]
    assert quotas(entries, None) == [10, None, None]
    assert quotas(entries, 50) == [10, 30, 10]
    assert sum(q or 0 for q in quotas(entries, 51)) == 51


def test_mixture_entry_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="corpus 'nope' is unknown"):
        MixSource("nope")
    with pytest.raises(ConfigError, match="num_samples must be >= 1"):
        MixSource("gsm8k", num_samples=0)


def mixture(*entries: str, seed: int = 0) -> DataConfig:
    listed = ", ".join(entries)
    return data_config("mix", f"data.mixture=[{listed}]", f"data.mix_seed={seed}")


def local(name: str, extra: str = "") -> str:
    return f"{{corpus: {name}, path: '{CORPORA_DIR / FIXTURE[name]}'{extra}}}"


def mixed_rows(config: DataConfig) -> list[tuple[str, Any]]:
    return list(training_source(config).rows())


def test_mixture_converts_each_corpus_and_drops_duplicates() -> None:
    rows = mixed_rows(mixture(local("sharegpt"), local("gsm8k"), local("opencoder_sft1")))
    good = [row for _, row in rows if not isinstance(row, RowError)]
    # sharegpt: 8 rows, one a whitespace-only copy of another; 3 bad rows pass on as errors
    assert len(rows) == 7 + 2 + 3
    assert len(good) == 4 + 2 + 2
    keys = [content_key(row["messages"]) for row in good]
    assert len(set(keys)) == len(keys)
    reasons = sorted(row.reason.value for _, row in rows if isinstance(row, RowError))
    assert reasons == [
        "empty_content",
        "no_assistant_turn",
        "no_assistant_turn",
        "non_string_content",
    ]
    gsm = [row for row in good if row["messages"][0]["content"].startswith("Tom has")]
    assert "<<" not in gsm[0]["messages"][1]["content"]


def test_mixture_is_seeded_and_takes_counts() -> None:
    entries = (local("sharegpt", ", num_samples: 3"), local("ultrachat", ", num_samples: 2"))
    first = [where for where, _ in mixed_rows(mixture(*entries, seed=1))]
    assert first == [where for where, _ in mixed_rows(mixture(*entries, seed=1))]
    assert len(first) <= 5 and sum("ultrachat" in where for where in first) == 2
    other = [where for where, _ in mixed_rows(mixture(*entries, seed=2))]
    assert sorted(other) != sorted(first) or other != first


def test_mixture_trains_and_its_cache_key_follows_the_recipe(  # type: ignore[no-untyped-def]
    smollm2_tokenizer, tmp_path: Path
) -> None:
    entries = (local("sharegpt"), local("ultrachat"))
    config = mixture(*entries)
    config.num_eval_samples = 0
    prepared = build_datasets(config, smollm2_tokenizer, tmp_path, seed=0)
    assert prepared.report.kept == 4 + 2 and prepared.report.skipped == {
        "empty_content": 2,
        "no_assistant_turn": 2,
        "duplicate": 1,  # data/skipped_duplicate in MLflow
    }
    assert prepared.report.rows == 8 + 3
    reseeded = mixture(*entries, seed=7)
    reseeded.num_eval_samples = 0
    assert build_datasets(reseeded, smollm2_tokenizer, tmp_path, seed=0).cache_key != (
        prepared.cache_key
    )


def test_mixture_rows_are_openai_rows_for_regenerate() -> None:
    rows, bad = read_input(mixture(local("gsm8k"), local("perfectblend")), limit=None)
    assert len(rows) == 5 and bad == []
    assert json.dumps(rows[0].messages)  # plain, serialisable messages


def test_mixture_of_hub_corpora_samples_each_with_the_seed(
    fake_hub: list[dict[str, Any]],
) -> None:
    entries = (
        "{corpus: ultrachat, num_samples: 2}",
        "{corpus: opencoder_sft1, subset: realuser_instruct, num_samples: 2}",
    )
    rows = mixed_rows(mixture(*entries))
    assert [(call["path"], call["name"]) for call in fake_hub] == [
        ("HuggingFaceH4/ultrachat_200k", None),
        ("OpenCoder-LLM/opc-sft-stage1", "realuser_instruct"),
    ]
    assert len(rows) == 4 and [where for where, _ in mixed_rows(mixture(*entries))] == [
        where for where, _ in rows
    ]


def test_eval_path_of_a_converted_corpus_uses_its_converter(  # type: ignore[no-untyped-def]
    smollm2_tokenizer, tmp_path: Path
) -> None:
    gsm8k = CORPORA_DIR / FIXTURE["gsm8k"]
    data = data_config("gsm8k", f"data.path={gsm8k}", f"data.eval_path={gsm8k}")
    prepared = build_datasets(data, smollm2_tokenizer, tmp_path, seed=0)
    assert prepared.eval is not None and len(prepared.eval) == 2


def test_online_preflight_names_an_unreachable_hub_and_a_missing_data_set(
    offline_empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    probes: list[str] = []

    def unreachable(self: Any, repo_id: str, **kwargs: Any) -> Any:
        probes.append(repo_id)
        raise ConnectionError("[Errno 101] Network is unreachable")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    with pytest.raises(
        ConfigError, match=r"the hub is unreachable \(ConnectionError\); set data\.path"
    ):
        check_inputs(typed("data=gsm8k"))
    assert probes == ["openai/gsm8k"]
    # cached: an unreachable hub is no reason to stop (datasets reads its cache)
    (offline_empty_cache / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)
    check_inputs(typed("data=gsm8k"))

    class NotFound(RepositoryNotFoundError):
        def __init__(self) -> None:  # the real one wants an HTTP response
            Exception.__init__(self, "404 Repository Not Found")

    def missing(self: Any, repo_id: str, **kwargs: Any) -> Any:
        raise NotFound()

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", missing)
    with pytest.raises(ConfigError, match=r"no such data set or revision \(v9\)"):
        check_inputs(typed("data=gsm8k", "data.revision=v9"))
