"""The engine tier's vLLM settings: small and quick to start -- eager (no torch.compile
warm-up, ~35 s instead of ~70-135 s on 2 cores), 1 GiB of KV cache, 1,024-token sequences."""

from __future__ import annotations

from eagleforge.engine.config import VLLMConfig

ENGINE = VLLMConfig(enforce_eager=True, kv_cache_space_gib=1.0, max_model_len=1024)
ENGINE_OVERRIDES = [
    "vllm.enforce_eager=true",
    "vllm.kv_cache_space_gib=1",
    "vllm.max_model_len=1024",
]
