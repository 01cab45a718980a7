"""The vLLM judge's arithmetic and settings, without an engine: which settings vLLM runs,
how its passes become a Summary (τ from its counters, speeds, greedy equality one at a time
and batched), the capture's layer ids, and the vLLM regenerate backend's replies."""

from __future__ import annotations

from typing import Any

import pytest

from eagleforge.engine.client import Completion, EngineRequestError, SpecCounters
from eagleforge.engine.server import EngineError
from eagleforge.errors import ConfigError
from eagleforge.regeneration.backends import VLLMBackend
from eagleforge.regeneration.config import MagpieConfig, RegenerateConfig
from eagleforge.regeneration.rows import RequestFailed
from eagleforge.speculative.config import DecodeSettings, EvalConfig
from eagleforge.speculative.engine_judge import (
    EnginePass,
    EngineRun,
    summarise_engine,
    unsupported_setting,
)
from eagleforge.speculative.prompts import PromptItem, PromptSet
from eagleforge.targets.vllm import capture_layer_ids

pytestmark = pytest.mark.unit


def test_engines_are_named_once_from_the_three_known() -> None:
    assert EvalConfig(engine="vllm").engines() == ["vllm"]
    assert EvalConfig(engine=["hf", "vllm"]).engines() == ["hf", "vllm"]
    assert EvalConfig(engine=["hf", "vllm", "llamacpp"]).engines() == ["hf", "vllm", "llamacpp"]
    for wrong in ("sglang", "llama.cpp", ["hf", "hf"], []):
        with pytest.raises(ConfigError, match="eval.engine must be one of hf, vllm, llamacpp"):
            EvalConfig(engine=wrong)


def test_vllm_runs_chains_and_names_why_not_trees() -> None:
    chain, tree = EvalConfig(sweep=["3/1/4", "4/2/8"]).decode_settings()
    assert unsupported_setting(chain) is None
    assert "4/2/8 is a tree" in (unsupported_setting(tree) or "")


def _pass(outputs: dict[tuple[str, int], list[int]], seconds: float) -> EnginePass:
    tokens = sum(len(o) for o in outputs.values())
    return EnginePass(outputs, {k: 5 for k in outputs}, tokens, seconds)


def test_a_summary_takes_tau_from_the_counters_and_compares_outputs() -> None:
    prompts = PromptSet("set", "file", [PromptItem(str(i), "c", ["q"]) for i in range(3)])
    same = {(str(i), 0): [i, 7, 8, 9] for i in range(3)}
    other = {**same, ("2", 0): [2, 7, 8, 1]}
    counters = SpecCounters(10, 30, 12, [6.0, 4.0, 2.0])
    speculative = EngineRun(_pass(same, 1.0), _pass(other, 0.5), counters)
    baseline = EngineRun(_pass(same, 2.0), _pass(same, 0.5), None)
    settings = DecodeSettings(4, 3, 1, 3, 0.0)
    summary = summarise_engine("d", prompts, settings, speculative, baseline, batch=8)
    assert summary.engine == "vllm" and summary.tau == pytest.approx(2.2)
    assert summary.acceptance_by_position == pytest.approx([0.6, 4 / 6, 0.5])
    assert summary.speedup == pytest.approx(2.0) and summary.greedy_matches_target is True
    assert summary.batch_size == 3  # never more in flight than there are prompts
    assert summary.batch_outputs_equal == 2 and summary.batch_speedup == pytest.approx(1.0)


def test_capture_ids_are_vllms_inputs_of_layers_and_the_last_output() -> None:
    assert capture_layer_ids([1, 14, 26], 30) == [2, 15, 27, 30]
    assert capture_layer_ids([1, 14, 29], 30) == [2, 15, 30]  # the last aux is the last layer


class ScriptedClient:
    def __init__(self, answers: list[Completion | Exception]) -> None:
        self.answers = answers
        self.requests: list[tuple[Any, ...]] = []

    def complete(self, ids: list[int], *args: Any, **kwargs: Any) -> Completion:
        self.requests.append((ids, args, kwargs))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_vllm_backend_drops_the_stop_token_and_names_a_cut(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    eos = smollm2_tokenizer.eos_token_id
    hi = smollm2_tokenizer("Hello there.", add_special_tokens=False)["input_ids"]
    client = ScriptedClient([
        Completion([*hi, eos], "stop", 0.1),
        Completion(hi, "length", 0.1),
        EngineRequestError("HTTP 400: too long"),
    ])  # fmt: skip
    cfg = RegenerateConfig(backend="vllm", concurrency=1)  # type: ignore[arg-type]
    backend = VLLMBackend(cfg, client, smollm2_tokenizer, {eos}, "vllm:m", "target")  # type: ignore[arg-type]
    history = [{"role": "user", "content": "Hi"}]
    done, cut, failed = backend([history, history, history])
    assert not isinstance(done, RequestFailed) and done.content == "Hello there."
    assert not isinstance(cut, RequestFailed) and cut.content == "Hello there."
    assert isinstance(failed, RequestFailed) and "too long" in str(failed)


def test_a_stopped_engine_ends_the_job(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Rows are not recorded as failed for an engine that died: the job stops, a rerun
    answers them."""
    client = ScriptedClient([EngineRequestError("connection refused")])
    cfg = RegenerateConfig(backend="vllm", concurrency=1)  # type: ignore[arg-type]
    backend = VLLMBackend(
        cfg,
        client,
        smollm2_tokenizer,
        {0},
        "vllm:m",
        "target",
        engine_alive=lambda: False,  # type: ignore[arg-type]
    )
    with pytest.raises(EngineError, match="the vLLM engine stopped: connection refused"):
        backend([[{"role": "user", "content": "Hi"}]])


def test_magpie_prompts_ask_vllm_for_top_k_not_a_sort(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """top_k goes to the engine with each Magpie request (top_p < 1 alone would make vLLM
    sort the whole vocabulary of every row at every step)."""
    client = ScriptedClient([Completion([5, 6], "stop", 0.1), Completion([7], "length", 0.1)])
    cfg = RegenerateConfig(backend="vllm", concurrency=2)  # type: ignore[arg-type]
    backend = VLLMBackend(cfg, client, smollm2_tokenizer, {6}, "vllm:m", "target")  # type: ignore[arg-type]
    rows = backend.sample_rows([1, 2], MagpieConfig(top_p=1.0, top_k=64, max_new_tokens=9))
    assert sorted(rows) == [[5, 6], [7]]
    for ids, args, kwargs in client.requests:
        assert ids == [1, 2] and args == (9, 1.0, 1.0) and kwargs["extra"]["top_k"] == 64
