"""eagleforge.evaluate over several prompt sets, with a stand-in decoder: files, metrics and
the table and plot across sets; eval.prompts as one name or a list; the preflight of named
sets while the hub is offline."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.errors import ConfigError
from eagleforge.evaluate import evaluate_sets, report_sets
from eagleforge.preflight import check_inputs
from eagleforge.speculative import prompts as prompts_module
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import DecodeResult
from eagleforge.speculative.prompts import load_prompt_sets
from eagleforge.speculative.report import Summary

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parents[1] / "fixtures" / "benchmarks"
GSM8K = f"gsm8k:{FIXTURES / 'gsm8k_main_test.jsonl'}"
HUMANEVAL = f"humaneval:{FIXTURES / 'openai_humaneval_test.jsonl'}"


def typed(*overrides: str):  # type: ignore[no-untyped-def]
    return to_typed(compose_config(["+model=smollm2", "data=chitchat", "output_dir=.", *overrides]))


class FakeDecoder:
    """Three tokens per turn in two rounds (two drafts accepted, then none)."""

    def __init__(self, settings: DecodeSettings | None = None) -> None:
        self.settings = settings or DecodeSettings(8, 2, 1, 2, 0.0)
        self.target_only_calls = 0

    def generate(self, prompt_ids: list[int], generator: Any, images: Any) -> DecodeResult:
        return DecodeResult([5, 6, 7], 0.01, 3, accepted_lengths=[2, 0])

    def generate_target_only(self, prompt_ids: list[int], generator: Any, images: Any) -> Any:
        self.target_only_calls += 1
        return DecodeResult([5, 6, 7], 0.02, 4)

    def generate_hf(self, prompt_ids: list[int]) -> DecodeResult:
        return DecodeResult([5, 6, 7], 0.03, 3)


class FakeRenderer:
    def __init__(self) -> None:
        self.tokenizer = self
        self.conversations: list[list[dict[str, Any]]] = []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "answer"

    def __call__(self, messages: list[dict[str, Any]], where: str) -> tuple[list[int], None]:
        self.conversations.append([dict(m) for m in messages])
        return list(range(len(messages) + 1)), None


class Recorder:
    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.artifacts: list[Path] = []

    def log_config(self, params: Any, config_yaml: str) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.update(metrics)

    def log_artifact(self, path: str | Path) -> None:
        self.artifacts.append(Path(path))

    def close(self) -> None:
        pass


def run_sets(
    config: Any, renderer: FakeRenderer, draft: Path, step: int, tracker: Recorder
) -> list[Summary]:
    """evaluate_sets with the stand-in decoder over every set of ``config``'s eval.prompts."""
    sets = load_prompt_sets(config.eval.prompt_sets(), multi_turn=False)
    return evaluate_sets(
        config,
        FakeDecoder(),
        renderer,
        draft,
        step,
        sets,
        torch.device("cpu"),
        tracker,  # type: ignore[arg-type]
    )


def test_several_sets_give_files_metrics_and_one_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = typed(f"output_dir={tmp_path}", f"eval.prompts=[{GSM8K},{HUMANEVAL}]")
    renderer, tracker = FakeRenderer(), Recorder()
    summaries = run_sets(config, renderer, Path("runs/x/checkpoints/step_00000004"), 4, tracker)
    assert [(s.prompt_set, s.num_turns, s.tau) for s in summaries] == [
        ("gsm8k", 2, 2.0),
        ("humaneval", 2, 2.0),
    ]
    # gsm8k's five worked examples come before its question; humaneval's prompt alone
    assert [m["role"] for m in renderer.conversations[0]] == ["user", "assistant"] * 5 + ["user"]
    assert [m["role"] for m in renderer.conversations[-1]] == ["user"]
    eval_dir = tmp_path / "eval"
    for name in ("gsm8k", "humaneval"):
        assert (eval_dir / "step_00000004" / name / "summary.json").is_file()
        assert tracker.metrics[f"eval/{name}/tau"] == 2.0
        assert tracker.metrics[f"eval/{name}/speedup"] == pytest.approx(2.0 * 2 / 2)
    assert "eval/tau" not in tracker.metrics

    report_sets(summaries, eval_dir, tracker)
    with (eval_dir / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["draft"], r["prompt set"], r["tau"]) for r in rows] == [
        ("step_00000004", "gsm8k", "2.0"),
        ("step_00000004", "humaneval", "2.0"),
    ]
    assert {eval_dir / n for n in ("summary.csv", "summary.md", "tau_by_set.png")} <= set(
        tracker.artifacts
    )
    assert (eval_dir / "tau_by_set.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| step_00000004 | gsm8k" in printed and "prompt set" in printed


def test_one_set_keeps_the_single_set_layout(tmp_path: Path) -> None:
    config = typed(f"output_dir={tmp_path}", f"eval.prompts={HUMANEVAL}", "eval.baseline=false")
    tracker = Recorder()
    run_sets(config, FakeRenderer(), Path("step_00000002"), 2, tracker)
    assert (tmp_path / "eval" / "step_00000002" / "summary.json").is_file()
    assert tracker.metrics["eval/tau"] == 2.0 and "eval/speedup" not in tracker.metrics


def test_prompts_take_one_name_or_a_list_on_the_command_line() -> None:
    assert typed("eval.prompts=mtbench").eval.prompt_sets() == ["mtbench"]
    assert typed().eval.prompt_sets() == ["mtbench"]
    many = typed("eval.prompts=[mtbench,gsm8k,humaneval]")
    assert many.eval.prompt_sets() == ["mtbench", "gsm8k", "humaneval"]
    with pytest.raises(ConfigError, match=r"eval\.prompts must be a prompt set or a list"):
        typed("eval.prompts=[]")
    with pytest.raises(ConfigError, match=r"eval\.prompts names gsm8k twice"):
        typed("eval.prompts=[gsm8k,gsm8k]")


def test_preflight_names_a_set_the_offline_hub_cannot_give(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import datasets

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the preflight fetched something")

    monkeypatch.setattr(prompts_module, "hub_offline", lambda: True)
    monkeypatch.setattr(prompts_module, "hub_cached", lambda bench: False)
    monkeypatch.setattr(datasets, "load_dataset", no_network)
    config = typed("eval.prompts=[mtbench,humaneval]")
    with pytest.raises(ConfigError) as error:
        check_inputs(config, model=False, data=False, prompts=True)
    message = str(error.value)
    assert message.startswith("eval.prompts=humaneval: openai/openai_humaneval is not in the")
    assert "eval.prompts=humaneval:/path/to/test.parquet" in message and "\n" not in message
    # mtbench falls back to the bundled set; a local copy needs no hub
    check_inputs(
        typed(f"eval.prompts=[mtbench,{HUMANEVAL}]"), model=False, data=False, prompts=True
    )
    with pytest.raises(ConfigError, match=r"eval\.prompts=gsm8k:/nope\.parquet: /nope\.parquet is"):
        check_inputs(
            typed("eval.prompts=gsm8k:/nope.parquet"), model=False, data=False, prompts=True
        )
    # in-training τ checks its prompts too
    with pytest.raises(ConfigError, match=r"eval\.prompts=math500: HuggingFaceH4/MATH-500"):
        check_inputs(
            typed("eval.prompts=math500", "trainer.eval_tau_every_n_steps=5"),
            model=False,
            data=False,
        )


def test_in_training_tau_takes_the_first_prompts_of_every_set() -> None:
    from types import SimpleNamespace

    from eagleforge.speculative.probe import TauProbe

    config = typed(f"eval.prompts=[{GSM8K},{HUMANEVAL}]")
    renderer = FakeRenderer()
    renderer.processor = None  # type: ignore[attr-defined]
    renderer.eos_token_id = 0  # type: ignore[attr-defined]
    target = SimpleNamespace(model=SimpleNamespace(generation_config=None))
    probe = TauProbe(config.eval, 1, target, renderer, seed=0, decoder=None)  # type: ignore[arg-type]
    assert [prompt_id for prompt_id, _, _ in probe.prompts] == ["5", "HumanEval/0"]
    # gsm8k's question follows its five worked examples, as in eagleforge.evaluate
    assert len(renderer.conversations[0]) == 11 and len(renderer.conversations[1]) == 1


def test_a_sweep_decodes_the_target_alone_once_and_tables_every_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """eval.sweep: each setting in its own directory and metric scope, the greedy target-alone
    decoding (and transformers' generate) reused, one table across the settings."""
    config = typed(f"output_dir={tmp_path}", f"eval.prompts={GSM8K}", "eval.hf_generate=true",
                   "eval.sweep=[3/1/4,6/4/16]")  # fmt: skip
    chain, tree = config.eval.decode_settings()
    assert (chain.num_draft_tokens, chain.topk, chain.total_draft_tokens) == (3, 1, 3)
    assert (tree.num_draft_tokens, tree.topk, tree.total_draft_tokens) == (6, 4, 15)
    sets = load_prompt_sets(config.eval.prompt_sets(), multi_turn=False)
    renderer, tracker, baselines = FakeRenderer(), Recorder(), {}  # type: ignore[var-annotated]
    draft = Path("runs/x/checkpoints/step_00000004")
    summaries, calls = [], []
    for setting in (chain, tree):
        decoder = FakeDecoder(setting)
        summaries += evaluate_sets(config, decoder, renderer, draft, 4, sets,  # type: ignore[arg-type]
                                   torch.device("cpu"), tracker, baselines, sweep=True)  # type: ignore[arg-type]  # fmt: skip
        calls.append(decoder.target_only_calls)
    assert calls == [2, 0]  # two prompts, decoded alone once
    assert [s.setting for s in summaries] == ["3/1/4", "6/4/16"]
    assert all(s.hf_generate_tokens_per_s == pytest.approx(100.0) for s in summaries)
    for setting in ("3-1-4", "6-4-16"):
        assert (tmp_path / "eval" / draft.name / setting / "summary.json").is_file()
        assert f"eval/{setting}/tau" in tracker.metrics
    report_sets(summaries, tmp_path / "eval", tracker)  # type: ignore[arg-type]
    table_rows = (tmp_path / "eval" / "summary.md").read_text().splitlines()
    assert "decoding" in table_rows[0] and "tokens/s generate" in table_rows[0]
    assert "3/1/4" in table_rows[2] and "6/4/16" in table_rows[3]


@pytest.mark.parametrize("entry", ["3/1/3", "3/2/8", "0/1/1", "chain3", "3/1"])
def test_a_malformed_sweep_entry_is_one_error(entry: str) -> None:
    with pytest.raises(ConfigError, match=f"eval.sweep entry '{entry}'"):
        typed(f"eval.sweep=[{entry}]")


class PartingDecoder(FakeDecoder):
    """The target alone's greedy output parts ways with the speculative one at its last token."""

    def generate_target_only(self, prompt_ids: list[int], generator: Any, images: Any) -> Any:
        return DecodeResult([5, 6, 8], 0.02, 4)


def test_the_table_says_a_bf16_difference_is_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = typed(f"output_dir={tmp_path}", f"eval.prompts={HUMANEVAL}", "model.dtype=bfloat16")
    (prompts,) = load_prompt_sets(config.eval.prompt_sets(), multi_turn=False)
    evaluate_sets(config, PartingDecoder(), FakeRenderer(), Path("step_00000002"), 2, [prompts],
                  torch.device("cpu"), Recorder())  # type: ignore[arg-type]  # fmt: skip
    printed = capsys.readouterr().out
    assert "greedy output = target's             differs — bf16, as expected" in printed
    assert "in bfloat16, as expected: a forward over several tokens" in printed  # and why
