"""The ``regenerate`` config section: where the target runs, how it samples, Magpie prompts.

Read by ``eagleforge.regenerate`` (``python -m eagleforge.regenerate``); see docs/regenerate.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from eagleforge.errors import ConfigError


class Backend(str, Enum):
    server = "server"  # any OpenAI-compatible chat endpoint (SGLang, vLLM, transformers serve)
    hf = "hf"  # the target in this process, batched generation with transformers
    vllm = "vllm"  # the vLLM engine eagleforge starts (or vllm.url), continuous batching


@dataclass
class MagpieConfig:
    """``regenerate.magpie``: the target writes the user turns too (hf or vllm backend)."""

    # Distinct first user turns to write and answer; 0 = off (the turns are read from `data`).
    num_prompts: int = 0
    # Further prompts, not answered, written beside the output (regen.jsonl ->
    # regen.heldout.jsonl) as eval.prompts rows: validation prompts no training row holds.
    held_out: int = 0
    # Sampling of the prompts (the answers follow regenerate.temperature / top_p).
    temperature: float = 1.0
    top_p: float = 0.95
    # Candidates a step: the top_k most likely tokens (0 = the whole vocabulary). The top_p
    # nucleus is cut to them, its probabilities still over the whole vocabulary. vLLM sorts the
    # whole vocabulary of every row at every step when top_p < 1 (2.4x slower on a CPU, 128 in
    # flight), and not for top_k alone: top_p=1 samples the same top_k there and here.
    top_k: int = 256
    # Tokens per prompt at most; a prompt the target has not ended by then is dropped.
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.held_out, self.top_k) < 0 or self.max_new_tokens < 1:
            raise ConfigError(
                "regenerate.magpie.num_prompts, held_out and top_k must be >= 0 and "
                "max_new_tokens >= 1."
            )
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"regenerate.magpie.temperature must be > 0 (the prompts are sampled) and top_p "
                f"in (0, 1], got {self.temperature} and {self.top_p}."
            )


@dataclass
class RegenerateConfig:
    """The `regenerate` config section (python -m eagleforge.regenerate)."""

    # Output jsonl file (OpenAI messages format); chunks and failures are kept beside it.
    output: str | None = None
    # Where the target runs: server | hf.
    backend: Backend = Backend.server
    # server: base URLs of OpenAI-compatible endpoints (…/v1); conversations are spread over them.
    base_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:30000/v1"])
    # server: the model name to request; null = the first model the endpoint lists.
    model: str | None = None
    # server: API key sent as a bearer token (null = none, or $OPENAI_API_KEY).
    api_key: str | None = None
    # server, vllm: conversations in flight at once (over all base URLs).
    concurrency: int = 16
    # server: attempts per request after the first, with exponential backoff (each retry
    # goes to the next base URL).
    max_retries: int = 3
    # server: seconds before the first retry (doubled each time).
    retry_backoff_s: float = 1.0
    # server: seconds to wait for one response.
    timeout_s: float = 600.0
    # hf: conversations generated together.
    batch_size: int = 8
    # Sampling temperature (0 = greedy, reproducible).
    temperature: float = 0.0
    # Nucleus sampling threshold (1 = off).
    top_p: float = 1.0
    # Tokens generated per assistant turn at most.
    max_new_tokens: int = 1024
    # Keep the model's reasoning (reasoning_content) in the regenerated turns, or drop it.
    keep_reasoning: bool = False
    # Regenerated versions of each conversation (> 1 needs temperature > 0).
    num_samples: int = 1
    # Conversations per chunk (the unit of atomic writes and of resume).
    chunk_rows: int = 256
    # Only the first N conversations (null = all).
    max_rows: int | None = None
    # Assistant turns regenerated per conversation at most; the conversation ends after the
    # last one (0 = every turn). 1: first user turns answered, e.g. of a multi-turn chat set.
    max_turns: int = 0
    # Seed of the hf and vllm backends' sampling.
    seed: int = 0
    # Magpie: the target writes the first user turns as well (see MagpieConfig).
    magpie: MagpieConfig = field(default_factory=MagpieConfig)

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size", "max_new_tokens", "num_samples", "chunk_rows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"regenerate.{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_turns < 0:
            raise ConfigError(
                f"regenerate.max_turns must be >= 0 (0 = every turn), got {self.max_turns}."
            )
        if self.max_retries < 0 or self.retry_backoff_s < 0 or self.timeout_s <= 0:
            raise ConfigError(
                "regenerate.max_retries and retry_backoff_s must be >= 0 and timeout_s > 0."
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"regenerate.temperature must be >= 0 and top_p in (0, 1], got "
                f"{self.temperature} and {self.top_p}."
            )
        if self.num_samples > 1 and self.temperature == 0:
            raise ConfigError(
                f"regenerate.num_samples={self.num_samples} with temperature 0 gives identical "
                "copies; set regenerate.temperature > 0 (e.g. 0.7)."
            )
        if self.backend == Backend.server and not self.base_urls:
            raise ConfigError("regenerate.base_urls is empty; give the server's …/v1 URL.")
        if self.magpie.num_prompts and self.backend == Backend.server:
            raise ConfigError(
                "regenerate.magpie.num_prompts samples prompts from the chat template's user "
                "header, which a chat endpoint does not expose; set regenerate.backend=hf or vllm."
            )
