"""A serving engine as the judge of a draft (``eval.engine=vllm``, ``eval.engine=llamacpp``;
the engines themselves are in ``judges.py``): the target served alone and with the draft, the
same prompts decoded one at a time and all at once, and the engine's own speculative-decoding
counters read around the one-at-a-time pass.

Per decoding setting it reports the engine's mean acceptance length (1 + accepted / drafts)
and acceptance by position, tokens/s with and without the draft at concurrency 1 and at
``eval.engine_batch`` prompts in flight, and whether each greedy output equals the engine's own
output without speculation (lossless in fp32; bf16 and quantized kernels differ between batch
shapes).

Only chains: vLLM's tree drafting (``speculative_token_tree``) needs its tree attention
backend, which the CPU build does not have, and llama.cpp drafts chains; ``unsupported_setting``
says so for each tree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleforge.engine.client import EngineClient, SpecCounters
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.prompts import PromptRenderer, PromptSet
from eagleforge.speculative.report import Summary

log = logging.getLogger("eagleforge.evaluate")

# (prompt id, turn) -> the generated token ids
Outputs = dict[tuple[str, int], list[int]]


@dataclass
class EnginePass:
    """Every prompt of a set decoded by one engine at one concurrency."""

    outputs: Outputs
    prompt_tokens: dict[tuple[str, int], int]
    generated_tokens: int
    seconds: float  # wall time of the whole pass

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(self.seconds, 1e-9)


@dataclass
class EngineRun:
    """One engine on one prompt set: alone (``counters`` None) or with a draft."""

    single: EnginePass  # concurrency 1
    batched: EnginePass | None  # eval.engine_batch prompts in flight (None: not measured)
    counters: SpecCounters | None  # vLLM's counters over the concurrency-1 pass


def speculative_config(draft_dir: Path, method: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``--speculative-config``: the draft family's ``method`` (its ``method`` and
    ``num_speculative_tokens``, and whatever else it needs) for the draft at ``draft_dir``."""
    return {**method, "model": str(draft_dir)}


def unsupported_setting(settings: DecodeSettings) -> str | None:
    """Why vLLM (its CPU build) cannot decode ``settings``; None when it can."""
    if settings.topk > 1:
        return (
            f"{settings.label} is a tree; vLLM's CPU build drafts chains only (its "
            "speculative_token_tree needs the tree attention backend), as llama.cpp does"
        )
    return None


def decode_pass(
    client: EngineClient,
    prompts: PromptSet,
    renderer: PromptRenderer,
    settings: DecodeSettings,
    eos_ids: set[int],
    concurrency: int,
) -> EnginePass:
    """Every turn of every prompt through ``client``, ``concurrency`` requests at once; turn
    i of a prompt is rendered with this engine's own answers to turns before it. Sampling is
    seeded by the engine, not per request (a seeded request crashes vLLM's CPU build when its
    prefill is split)."""
    histories: list[list[dict[str, Any]]] = [list(item.context) for item in prompts.items]
    outputs: Outputs = {}
    lengths: dict[tuple[str, int], int] = {}
    tokens, seconds = 0, 0.0
    for turn in range(max(len(item.turns) for item in prompts.items)):
        todo = [i for i, item in enumerate(prompts.items) if turn < len(item.turns)]
        ids = []
        for i in todo:
            item = prompts.items[i]
            histories[i].append(item.message(turn))
            ids.append(renderer(histories[i], f"{item.where} (turn {turn})")[0])
        completions, wall = client.complete_many(
            ids,
            concurrency,
            max_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            extra={"stop_token_ids": sorted(eos_ids)},
        )
        seconds += wall
        for i, prompt_ids, done in zip(todo, ids, completions, strict=True):
            key = (prompts.items[i].id, turn)
            # the stop token is in the ids, as eagleforge's decoder counts it
            outputs[key], lengths[key] = list(done.token_ids), len(prompt_ids)
            tokens += len(outputs[key])
            answer = renderer.tokenizer.decode(outputs[key], skip_special_tokens=True)
            histories[i].append({"role": "assistant", "content": answer})
    return EnginePass(outputs, lengths, tokens, seconds)


def run_engine(
    client: EngineClient,
    prompts: PromptSet,
    renderer: PromptRenderer,
    settings: DecodeSettings,
    eos_ids: set[int],
    batch: int,
    speculative: bool,
) -> EngineRun:
    """The concurrency-1 pass (vLLM's counters read around it when ``speculative``) and, for
    ``batch`` > 1, the batched pass."""
    client.complete(renderer([{"role": "user", "content": "Hi"}], "warm-up")[0], max_tokens=4)
    before = client.spec_counters() if speculative else None
    single = decode_pass(client, prompts, renderer, settings, eos_ids, 1)
    counters = client.spec_counters() - before if before is not None else None
    batched = None
    if min(batch, len(prompts.items)) > 1:
        batched = decode_pass(client, prompts, renderer, settings, eos_ids, batch)
    return EngineRun(single, batched, counters)


def summarise_engine(
    draft: str,
    prompts: PromptSet,
    settings: DecodeSettings,
    speculative: EngineRun,
    baseline: EngineRun | None,
    batch: int,
    dtype: str = "",
    engine: str = "vllm",
) -> Summary:
    """The evaluator's Summary of a draft ``engine`` served, decoded in ``dtype`` (float32 |
    bfloat16 | float16, or a GGUF quantization: q4_1 ...)."""
    counters = speculative.counters or SpecCounters()
    single = speculative.single
    greedy = settings.temperature == 0
    matches, batch_equal = None, None
    if greedy and baseline is not None:
        matches = single.outputs == baseline.single.outputs
        if speculative.batched is not None and baseline.batched is not None:
            batch_equal = sum(
                speculative.batched.outputs[k] == baseline.batched.outputs.get(k)
                for k in speculative.batched.outputs
            )
    rates = counters.acceptance_by_position[: settings.num_draft_tokens]
    rates += [0.0] * (settings.num_draft_tokens - len(rates))
    base_speed = baseline.single.tokens_per_s if baseline is not None else None
    batch = min(batch, len(prompts.items))  # never more in flight than there are prompts
    batch_speed = speculative.batched.tokens_per_s if speculative.batched else None
    batch_base = baseline.batched.tokens_per_s if baseline and baseline.batched else None
    return Summary(
        draft=draft,
        num_turns=len(single.outputs),
        rounds=int(counters.drafts),
        tau=counters.mean_acceptance_length,
        acceptance_by_position=rates,
        # verification rounds and one prefill a turn (vLLM's first token needs no draft)
        target_forwards=int(counters.drafts) + len(single.outputs),
        generated_tokens=single.generated_tokens,
        tokens_per_s=single.tokens_per_s,
        baseline_tokens_per_s=base_speed,
        speedup=single.tokens_per_s / base_speed if base_speed else None,
        greedy_matches_target=matches,
        prompt_set=prompts.name,
        prompt_source=prompts.source,
        setting=settings.label,
        engine=engine,
        batch_size=batch if speculative.batched is not None else None,
        batch_tokens_per_s=batch_speed,
        batch_baseline_tokens_per_s=batch_base,
        batch_speedup=batch_speed / batch_base if batch_speed and batch_base else None,
        batch_outputs_equal=batch_equal,
        dtype=dtype,
    )
