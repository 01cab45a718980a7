"""The engine sections: ``vllm`` (where the vLLM engine's interpreter is, or which server to use,
and how the engine eagleforge starts is sized; read by ``evaluate`` (eval.engine=vllm),
``regenerate`` (regenerate.backend=vllm) and ``prepare`` (target=vllm)) and ``llamacpp``
(llama.cpp's ``llama-server``, read by ``evaluate`` (eval.engine=llamacpp)); see docs/serving.md.
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


@dataclass
class LlamaCppConfig:
    """The ``llamacpp`` section: llama.cpp's ``llama-server`` as eagleforge starts it
    (``eval.engine=llamacpp``; docs/serving.md#llamacpp-a-gguf-draft)."""

    # The llama-server binary; null = $EAGLEFORGE_LLAMA_SERVER, else `make llamacpp`'s build.
    server: str | None = None
    # The target's GGUF file (llama-server -m); null = the bundled SmolLM2's for model=smollm2.
    target_gguf: str | None = None
    # Compute threads (-t); null = this command's own (parallel.num_threads, OMP_NUM_THREADS,
    # else the cores).
    threads: int | None = None
    # Requests served at once (--parallel); each gets max_model_len tokens of context.
    parallel: int = 8
    # Longest sequence (prompt + generation) of one request, in tokens.
    max_model_len: int = 2048
    # The draft GGUF's weights: keep (the checkpoint's, fp32 from training) | bfloat16 |
    # float16 (its norms stay float32, as llama.cpp's converter writes them).
    draft_dtype: str = "keep"
    # Drafting stops at a token the draft gives less than this probability
    # (--spec-draft-p-min); 0 drafts every chain to its full length, as vLLM does.
    draft_p_min: float = 0.0
    # Seconds to wait for the server to answer /health before giving up.
    startup_timeout_s: float = 300.0
    # Seconds to wait for one request.
    request_timeout_s: float = 1800.0
    # Further llama-server arguments, e.g. ["--spec-draft-n-min", "1"].
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.parallel < 1 or self.max_model_len < 16:
            raise ConfigError("llamacpp.parallel must be >= 1 and llamacpp.max_model_len >= 16.")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"llamacpp.threads must be >= 1 or null, got {self.threads}.")
        if self.draft_dtype not in ("keep", "bfloat16", "float16", "float32"):
            raise ConfigError(
                f"llamacpp.draft_dtype must be keep, bfloat16, float16 or float32, got "
                f"{self.draft_dtype!r}."
            )
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise ConfigError(f"llamacpp.draft_p_min must be in [0, 1], got {self.draft_p_min}.")
        if self.startup_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ConfigError(
                "llamacpp.startup_timeout_s and llamacpp.request_timeout_s must be > 0."
            )
