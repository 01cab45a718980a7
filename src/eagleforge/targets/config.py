"""The `target` config section: which backend runs the frozen target, and its options.

``TargetConfig`` is the root schema's ``target`` field (``conf/target/*.yaml`` pick its values);
``registry.build_target`` turns it into a backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

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

    def supports_packing(self) -> bool:
        """Packed rows need a block-diagonal mask, which these attention implementations take."""
        if self.backend == TargetBackendKind.custom:
            return True  # its SDPA always takes an explicit mask
        return self.backend == TargetBackendKind.hf and self.attn_implementation in (
            "sdpa",
            "eager",
        )
