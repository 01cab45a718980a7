"""The ``vllm`` config section: where the vLLM engine's interpreter is (or which server to
use), and how the engine eagleforge starts is sized. Read by ``evaluate`` (eval.engine=vllm),
``regenerate`` (regenerate.backend=vllm) and ``prepare`` (target=vllm); see docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from eagleforge.errors import ConfigError


class EngineDType(str, Enum):
    model = "model"  # the target's model.dtype
    float32 = "float32"  # lossless speculative decoding (bf16 batch-1 kernels differ)
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class VLLMConfig:
    """The ``vllm`` section: the engine eagleforge runs as its own process."""

    # Interpreter of the engine's environment (`make vllm` builds .venv-vllm); null =
    # $EAGLEFORGE_VLLM_PYTHON, else .venv-vllm/bin/python in the working directory or the checkout.
    python: str | None = None
    # Base URL of a vLLM server already running (http://host:port); null = eagleforge starts one.
    url: str | None = None
    # Weights and activations of the engine; `model` follows model.dtype.
    dtype: EngineDType = EngineDType.model
    # CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE). CUDA: ignored (see gpu_memory_utilization).
    kv_cache_space_gib: float = 2.0
    # CUDA: share of GPU memory the engine may take.
    gpu_memory_utilization: float = 0.85
    # Longest sequence (prompt + generation) in tokens.
    max_model_len: int = 2048
    # Sequences decoded at once at most (vLLM's --max-num-seqs); null = vLLM's default.
    max_num_seqs: int | None = None
    # Skip torch.compile: the engine starts in ~45 s instead of ~70-135 s on a CPU.
    enforce_eager: bool = False
    # Seconds to wait for the engine to answer /health before giving up.
    startup_timeout_s: float = 900.0
    # Seconds to wait for one request.
    request_timeout_s: float = 1800.0
    # Further `vllm serve` arguments, e.g. ["--max-num-batched-tokens", "4096"].
    extra_args: list[str] = field(default_factory=list)

    def dtype_for(self, model_dtype: str) -> str:
        """The engine's dtype: ``dtype``, or ``model_dtype`` (the target's, resolved for this
        machine) when it is ``model``."""
        return model_dtype if self.dtype == EngineDType.model else self.dtype.value

    def __post_init__(self) -> None:
        if self.kv_cache_space_gib <= 0 or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                "vllm.kv_cache_space_gib must be > 0 and vllm.gpu_memory_utilization in (0, 1]."
            )
        if self.max_model_len < 16 or (self.max_num_seqs is not None and self.max_num_seqs < 1):
            raise ConfigError("vllm.max_model_len must be >= 16 and vllm.max_num_seqs >= 1.")
        if self.startup_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ConfigError("vllm.startup_timeout_s and vllm.request_timeout_s must be > 0.")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(
                f"vllm.url={self.url!r}: give the server's base URL, e.g. http://127.0.0.1:8000."
            )
