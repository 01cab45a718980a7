"""The `eval` config section (options of ``python -m eagleforge.evaluate``) and the decoding
settings it yields: one per ``eval.sweep`` entry, or the one of its fields."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from eagleforge.errors import ConfigError

ENGINES = ("hf", "vllm", "llamacpp")


@dataclass
class EvalConfig:
    """The `eval` config section: options of ``python -m eagleforge.evaluate``."""

    # Draft to evaluate: a training checkpoint (…/checkpoints/step_N), an exported SGLang
    # draft directory, or a directory of checkpoints (each is evaluated; τ plotted by step).
    draft: str | None = None
    # Prompt set, or a list of them (each measured on its own, then one table across them): a
    # benchmark (mtbench, humaneval, gsm8k, math500; NAME:PATH reads a local copy of its rows),
    # mtbench_style (bundled, 40 prompts in 8 categories) or a jsonl path. str | list[str]:
    # typed Any because OmegaConf cannot type a union of a string and a list.
    prompts: Any = "mtbench"
    # Every user turn of a prompt (answered by the model in turn), not only the first.
    multi_turn: bool = False
    # At most this many prompts; null = all.
    max_prompts: int | None = None
    # Tokens generated per turn (fewer if the model ends its answer).
    max_new_tokens: int = 128
    # Draft tokens per round: the chain length, or the tree depth when topk > 1.
    num_draft_tokens: int = 5
    # Children per expanded node; > 1 drafts an EAGLE-2 tree.
    topk: int = 1
    # Tree nodes verified per round; null = num_draft_tokens * topk.
    total_draft_tokens: int | None = None
    # 0: greedy; > 0: sampling, verified by speculative rejection sampling.
    temperature: float = 0.0
    # Also decode with the target alone (speed baseline, and the lossless check when greedy).
    baseline: bool = True
    # Several decoding settings in one call, each "steps/topk/tokens" as SGLang's
    # --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens
    # (3/1/4: a chain of 3; 6/4/16: a tree of depth 6, 4 children a node, 15 drafts verified);
    # they replace num_draft_tokens, topk and total_draft_tokens, and one table compares them.
    # Greedy: the target alone is decoded once per prompt, whatever the number of settings.
    sweep: list[str] = field(default_factory=list)
    # Also time transformers' own generate on the same prompts (greedy text targets): the
    # target-alone loop's speed beside it.
    hf_generate: bool = False
    # Who decodes: hf (eagleforge's own decoder, the target in this process), vllm (the vLLM
    # engine serves the target with the draft; chains only), llamacpp (llama.cpp's llama-server
    # serves the target's GGUF with a GGUF draft; chains only), or a list: [hf,vllm,llamacpp]
    # side by side.
    # str | list[str], typed Any as `prompts` is.
    engine: Any = "hf"
    # vllm, llamacpp: prompts in flight at once for the batched speed (1 = concurrency 1 only).
    engine_batch: int = 8

    def __post_init__(self) -> None:
        self.prompt_sets()  # raises ConfigError for anything but a name or a list of names
        self.engines()  # raises ConfigError for an unknown engine
        if self.engine_batch < 1:
            raise ConfigError(f"eval.engine_batch must be >= 1, got {self.engine_batch}.")
        for name in ("max_new_tokens", "num_draft_tokens", "topk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"eval.{name} must be >= 1, got {getattr(self, name)}.")
        if self.total_draft_tokens is not None and self.total_draft_tokens < 1:
            raise ConfigError(
                f"eval.total_draft_tokens must be >= 1 or null, got {self.total_draft_tokens}."
            )
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0, got {self.temperature}.")
        self.decode_settings()  # raises ConfigError for a malformed sweep entry
        if self.hf_generate and self.temperature > 0:
            raise ConfigError(
                "eval.hf_generate times transformers' greedy generate; set eval.temperature=0."
            )

    def prompt_sets(self) -> list[str]:
        """``prompts`` as a list of entries (``eval.prompts=gsm8k`` and
        ``eval.prompts=[mtbench,gsm8k]`` alike)."""
        sets = [self.prompts] if isinstance(self.prompts, str) else self.prompts
        if (
            not isinstance(sets, list | tuple)
            or not sets
            or not all(isinstance(s, str) and s.strip() for s in sets)
        ):
            raise ConfigError(
                f"eval.prompts must be a prompt set or a list of them (e.g. mtbench, or "
                f"[mtbench,gsm8k,humaneval]), got {self.prompts!r}."
            )
        duplicates = sorted({s for s in sets if sets.count(s) > 1})
        if duplicates:
            raise ConfigError(f"eval.prompts names {', '.join(duplicates)} twice; list each once.")
        return list(sets)

    def engines(self) -> list[str]:
        """``engine`` as a list (``eval.engine=vllm`` and ``eval.engine=[hf,vllm]`` alike)."""
        engines = [self.engine] if isinstance(self.engine, str) else self.engine
        if (
            not isinstance(engines, list | tuple)
            or not engines
            or any(e not in ENGINES for e in engines)
            or len(set(engines)) < len(engines)
        ):
            raise ConfigError(
                f"eval.engine must be one of hf, vllm, llamacpp or a list of them "
                f"([hf,vllm,llamacpp]), each once; got {self.engine!r}."
            )
        return list(engines)

    def decode_settings(self) -> list[DecodeSettings]:
        """The settings to decode with: each entry of ``sweep``, or the one of the fields."""
        if not self.sweep:
            return [self.settings()]
        settings = []
        for text in self.sweep:
            match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*/\s*(\d+)\s*", str(text))
            steps, topk, tokens = (int(g) for g in match.groups()) if match else (0, 0, 0)
            most = steps + 1 if topk == 1 else steps * topk + 1  # a chain verifies all
            if not (
                steps >= 1 and topk >= 1 and 2 <= tokens <= most and (topk > 1 or tokens == most)
            ):
                raise ConfigError(
                    f"eval.sweep entry {text!r}: expected steps/topk/tokens as SGLang counts "
                    "them (tokens include the verified root): a chain is steps/1/steps+1, e.g. 3/1/4; "
                    "a tree has 2 <= tokens <= steps*topk + 1, e.g. 6/4/16."
                )
            settings.append(replace(self.settings(), num_draft_tokens=steps, topk=topk,
                                    total_draft_tokens=tokens - 1))  # fmt: skip
        labels = [s.label for s in settings]
        if len(set(labels)) < len(labels):
            raise ConfigError(f"eval.sweep lists a setting twice: {self.sweep}.")
        return settings

    def settings(self) -> DecodeSettings:
        return DecodeSettings(
            max_new_tokens=self.max_new_tokens,
            num_draft_tokens=self.num_draft_tokens,
            topk=self.topk,
            total_draft_tokens=self.total_draft_tokens or self.num_draft_tokens * self.topk,
            temperature=self.temperature,
        )


@dataclass
class DecodeSettings:
    max_new_tokens: int
    num_draft_tokens: int  # chain length / tree depth
    topk: int  # 1: chain; > 1: tree
    total_draft_tokens: int  # nodes verified per round (tree); the chain verifies all
    temperature: float  # 0: greedy

    @property
    def label(self) -> str:
        """SGLang's steps/topk/tokens (tokens counting the verified root): 3/1/4 = chain 3."""
        return f"{self.num_draft_tokens}/{self.topk}/{self.total_draft_tokens + 1}"
