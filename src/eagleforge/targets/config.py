"""The `target` config section: which backend runs the frozen target, and its options.

``TargetConfig`` is the root schema's ``target`` field (``conf/target/*.yaml`` pick its values);
``registry.build_target`` turns it into a backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from eagleforge.errors import ConfigError


class TargetBackendKind(str, Enum):
    hf = "hf"  # transformers, in-process
    sglang = "sglang"  # SGLang's model runner, in-process (CUDA)
    custom = "custom"  # eagleforge's own tensor-parallel Llama / Qwen
    vllm = "vllm"  # the vLLM engine (its own process, `vllm.*`), hidden-state capture


@dataclass
class SGLangConfig:
    """The `target.sglang` section: options of the SGLang backend (target=sglang, ``sglang.py``).
    Its tensor-parallel size is `parallel.tp`; anything else SGLang's ServerArgs takes goes in
    `extra`. Every forward here is a prefill of whole sequences (no decoding, no prefix cache)."""

    # SGLang attention backend (flashinfer | fa3 | triton | torch_native | ...).
    attention_backend: str = "flashinfer"
    # Share of GPU memory SGLang reserves for weights and KV cache (0..1); the draft and its
    # optimizer live in the rest.
    mem_fraction_static: float = 0.4
    # Longest sequence SGLang plans for, tokens; null = the target's own context length.
    context_length: int | None = None
    # Capture CUDA graphs of the target forward (SGLang's prefill graphs: every forward here is
    # a prefill, so decode graphs are never captured).
    cuda_graph: bool = False
    # Piecewise prefill graphs, split around attention so that batches of any shape replay
    # them (SGLang's "breakable" prefill backend); implies cuda_graph.
    piecewise_cuda_graph: bool = False
    # Longest sequence, tokens, a prefill CUDA graph replays for; longer batches run eagerly.
    piecewise_cuda_graph_max_tokens: int = 4096
    # torch.compile the target forward inside SGLang.
    torch_compile: bool = False
    # NVLink SHARP all-reduce (NVLS) for the target's TP collectives.
    nccl_nvls: bool = False
    # NCCL symmetric-memory collectives for the target's TP collectives.
    symm_mem: bool = False
    # Data-parallel attention inside the tp group (MoE / MLA targets; set extra.dp_size too).
    dp_attention: bool = False
    # Data-parallel lm_head with dp_attention.
    dp_lm_head: bool = False
    # Expert-parallel size for MoE targets (1 = no expert parallelism; divides parallel.tp).
    ep_size: int = 1
    # Most sequences in one forward (SGLang's request slots); null = SGLang's default.
    max_running_requests: int | None = None
    # KV-cache pool size in tokens, which bounds the tokens of one forward; null = what
    # mem_fraction_static leaves after the weights.
    max_total_tokens: int | None = None
    # Further sglang ServerArgs fields, passed as given (e.g. {kv_cache_dtype: fp8_e5m2}).
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(
                f"target.sglang.mem_fraction_static={self.mem_fraction_static} must lie in "
                "(0, 1): the share of GPU memory SGLang keeps for weights and KV cache."
            )
        if not self.attention_backend:
            raise ConfigError(
                "target.sglang.attention_backend is empty; name an SGLang attention backend "
                "(flashinfer, fa3, triton, torch_native, ...)."
            )
        if self.ep_size < 1:
            raise ConfigError(f"target.sglang.ep_size={self.ep_size} must be at least 1.")
        for name in (
            "context_length",
            "max_running_requests",
            "max_total_tokens",
            "piecewise_cuda_graph_max_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"target.sglang.{name}={value} must be at least 1.")
        if self.dp_lm_head and not self.dp_attention:
            raise ConfigError(
                "target.sglang.dp_lm_head=true needs target.sglang.dp_attention=true; set both "
                "or neither."
            )


def is_base_url(url: str) -> bool:
    """Whether ``url`` is an http(s) URL with a host and a valid port, if any."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0  # .port raises on letters, > 65535
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port_ok


@dataclass
class ProducersConfig:
    """The `target.producers` section: the vLLM engines that produce the target's hidden states
    for target=vllm (``producers.py``). Training takes them as a stream -- no store on disk --
    at most ``queue_batches`` batches ahead of its step; ``prepare`` spreads its capture over
    them. See docs/streaming.md."""

    # vLLM engines eagleforge starts (each its own process, sized by the `vllm` section); an
    # engine that dies is started again and its work goes to the others meanwhile.
    engines: int = 1
    # Base URLs of capture servers already running (`python -m eagleforge.serve_target`), used
    # instead of starting engines; a server that stops is waited for, its work goes to the others.
    urls: list[str] = field(default_factory=list)
    # Prompts in flight per producer at once (the engine batches them).
    requests_per_producer: int = 64
    # Batches produced ahead of the trainer at most (training: the bounded queue between the
    # producers and the step; each holds its hidden states in memory).
    queue_batches: int = 8
    # Seconds a producer that stopped answering has to come back (started again, or its server
    # up again) before it is given up; the run stops when every producer is given up.
    recover_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("engines", "requests_per_producer", "queue_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"target.producers.{name} must be >= 1, got {getattr(self, name)}."
                )
        if self.recover_timeout_s <= 0:
            raise ConfigError(
                f"target.producers.recover_timeout_s must be > 0, got {self.recover_timeout_s}."
            )
        for index, url in enumerate(self.urls):
            if not is_base_url(str(url)):
                raise ConfigError(
                    f"target.producers.urls[{index}]={url!r}: give a capture server's base URL, "
                    "http(s)://host:port, e.g. http://10.0.0.2:8000."
                )
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError(f"target.producers.urls names a server twice: {list(self.urls)}.")
        if self.urls and self.engines != 1:
            raise ConfigError(
                f"target.producers.engines={self.engines} with target.producers.urls: the servers "
                "at the URLs are the producers and eagleforge starts none; unset one of them."
            )


@dataclass
class ServeTargetConfig:
    """The `serve_target` section: ``python -m eagleforge.serve_target``, a capture server that
    training runs elsewhere name in ``target.producers.urls``."""

    # Address the server listens on (0.0.0.0: every interface, for trainers on other machines).
    host: str = "127.0.0.1"
    # Port it listens on.
    port: int = 8000
    # Where its connector writes each prompt's states, read and deleted by the trainers: a
    # directory on a filesystem every trainer mounts at the same path. Required.
    files_dir: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"serve_target.port must be in 1..65535, got {self.port}.")


@dataclass
class TargetConfig:
    """The `target` config section: how the frozen target runs."""

    # Backend that runs the target forward.
    backend: TargetBackendKind = TargetBackendKind.hf
    # transformers attention implementation of the target (sdpa | eager | flash_attention_2).
    attn_implementation: str = "sdpa"
    # Positions per chunk when computing the teacher through the lm_head (bounds the [chunk, V]
    # fp32 logits); null = as many as fit in 32 MiB (262 for a 32k vocab, 65 for 128k).
    teacher_chunk_size: int | None = None
    # Options of the SGLang backend (target=sglang).
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    # The engines that produce the target's states (target=vllm).
    producers: ProducersConfig = field(default_factory=ProducersConfig)

    def __post_init__(self) -> None:
        if self.backend != TargetBackendKind.vllm:
            changed = [
                f"target.producers.{f.name}"
                for f in fields(ProducersConfig)
                if getattr(self.producers, f.name) != getattr(ProducersConfig(), f.name)
            ]
            if changed:
                raise ConfigError(
                    f"{', '.join(changed)} applies to target=vllm only (the engines that "
                    f"produce the target's states), and this run's target is "
                    f"{self.backend.value}; remove it, or set target=vllm."
                )

    def supports_packing(self) -> bool:
        """Packed rows need a block-diagonal mask, which these attention implementations take."""
        if self.backend == TargetBackendKind.custom:
            return True  # its SDPA always takes an explicit mask
        if self.backend == TargetBackendKind.vllm:
            return True  # each conversation is captured alone; rows are packed after
        return self.backend == TargetBackendKind.hf and self.attn_implementation in (
            "sdpa",
            "eager",
        )
