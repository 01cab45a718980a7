"""A DFlash draft directory: the layout z-lab's checkpoints have and vLLM's ``qwen3_dflash``
(``DFlashDraftModel``) and SGLang's ``dflash`` load -- writing it, reading it back, and every
problem that would make it load wrongly (``export --check``).

``config.json`` is a Qwen3 config with every field explicit (transformers defaults a missing
``head_dim`` to 128), ``block_size`` at the top level and in ``dflash_config`` with the mask
token and the tapped layers (output-of-layer ids: vLLM adds one, as for EAGLE-3's SGLang
numbering), ``num_target_layers``, ``layer_types``, no ``auto_map``. ``model.safetensors``
holds ``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.*`` and ``norm.weight``; no embedding
and no lm_head (the engine shares the target's) and never ``mask_hidden`` (vLLM refuses it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagleforge.draft.config import DraftFamily
from eagleforge.draft.dflash import DFlashArchitecture
from eagleforge.errors import CheckpointError
from eagleforge.files import checksum_problem, save_safetensors, unreadable_reason
from eagleforge.formats.kinds import DraftFormat, Verifier, dtype_name
from eagleforge.formats.layout import Found, unusable

DFLASH_ARCHITECTURE = "DFlashDraftModel"


SPECULATORS_DFLASH_ARCHITECTURE = "DFlashSpeculator"

# the tensors of each of the draft's Qwen3 layers, as vLLM and SGLang name them
LAYER_TENSORS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    *(f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")),
)


def is_dflash(config: dict[str, Any]) -> bool:
    """Whether a draft's ``config.json`` describes a DFlash draft (either layout)."""
    return (
        config.get("architectures") == [DFLASH_ARCHITECTURE]
        or "dflash_config" in config
        or is_speculators(config)
    )


def is_speculators(config: dict[str, Any]) -> bool:
    """Whether a DFlash ``config.json`` is speculators' layout (``speculators_model_type``)."""
    return config.get("speculators_model_type") == "dflash"


def as_engine_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config vLLM builds from a DFlash ``config.json``: a speculators one becomes its
    ``transformer_layer_config`` with the DFlash fields (its aux layer ids are input-of-layer
    ids, one above ``dflash_config.target_layer_ids``), as vLLM's speculators reader does; the
    vLLM layout is returned as it is."""
    if not is_speculators(config):
        return config
    layer = dict(config.get("transformer_layer_config") or {})
    ids = config.get("aux_hidden_state_layer_ids")
    layer["architectures"] = [DFLASH_ARCHITECTURE]
    layer["target_hidden_size"] = config.get("target_hidden_size", layer.get("hidden_size"))
    layer["dflash_config"] = {
        "mask_token_id": config.get("mask_token_id"),
        "target_layer_ids": [i - 1 for i in ids] if isinstance(ids, list) else ids,
        "block_size": layer.get("block_size"),
    }
    layer.setdefault("torch_dtype", config.get("torch_dtype"))
    layer.setdefault("eagleforge", config.get("eagleforge") or {})
    return layer


def dflash_config(arch: DFlashArchitecture, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of a DFlash draft."""
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": arch.rope_theta, "rope_type": "default"},
        "max_position_embeddings": arch.max_position_embeddings,
        "attention_bias": arch.attention_bias,
        "attention_dropout": 0.0,
        "vocab_size": arch.vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": arch.num_hidden_layers,
        # every layer attends bidirectionally within the block (vLLM: non-causal)
        "layer_types": ["full_attention"] * arch.num_hidden_layers,
        "torch_dtype": dtype_name(dtype),
        "block_size": arch.block_size,
        "num_target_layers": arch.num_target_layers,
        "target_hidden_size": arch.target_hidden_size,
        "dflash_config": {
            "mask_token_id": arch.mask_token_id,
            "target_layer_ids": list(arch.aux_layer_ids),
            "block_size": arch.block_size,
        },
        "eagleforge": {"target_model_type": arch.target_model_type},
    }


def speculators_dflash_config(
    arch: DFlashArchitecture,
    dtype: torch.dtype,
    verifier: str,
    verifier_architectures: list[str],
) -> dict[str, Any]:
    """The speculators ``config.json`` of a DFlash draft (``speculators_model_type: dflash``):
    the Qwen3 layer config under ``transformer_layer_config``, the taps as input-of-layer
    ``aux_hidden_state_layer_ids``, and a greedy proposal of the block's B-1 tokens."""
    layer = dflash_config(arch, dtype)
    own = {"dflash_config", "target_hidden_size", "eagleforge", "architectures"}
    return {
        "architectures": [SPECULATORS_DFLASH_ARCHITECTURE],
        "speculators_model_type": "dflash",
        "transformer_layer_config": {
            **{k: v for k, v in layer.items() if k not in own},
            "architectures": ["Qwen3ForCausalLM"],
        },
        "draft_vocab_size": arch.vocab_size,
        "target_hidden_size": arch.target_hidden_size,
        "mask_token_id": arch.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in arch.aux_layer_ids],
        "torch_dtype": layer["torch_dtype"],
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": arch.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "eagleforge": layer["eagleforge"],
    }


def write_dflash(
    arch: DFlashArchitecture,
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    fmt: DraftFormat = DraftFormat.vllm,
    verifier: Verifier | None = None,
) -> Path:
    """Write a DFlash draft directory from the draft's state dict: one layout, which vLLM and
    SGLang both load (``fmt`` sglang or vllm), or speculators' config over the same tensors
    naming ``verifier``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_safetensors(kept, out / "model.safetensors", metadata={"format": "pt"})
    dtype = kept["fc.weight"].dtype
    if fmt != DraftFormat.speculators:
        config = dflash_config(arch, dtype)
    else:
        verifier = verifier or Verifier(name_or_path="")
        config = speculators_dflash_config(
            arch, dtype, verifier.name_or_path, verifier.architectures
        )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def dflash_architecture_of(config: dict[str, Any]) -> DFlashArchitecture:
    """The architecture a DFlash ``config.json`` (either layout) describes."""
    config = as_engine_config(config)
    dflash = config.get("dflash_config") or {}
    rope = config.get("rope_parameters") or {}
    return DFlashArchitecture(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
        num_target_layers=config["num_target_layers"],
        aux_layer_ids=list(dflash["target_layer_ids"]),
        block_size=int(dflash.get("block_size") or config["block_size"]),
        mask_token_id=int(dflash["mask_token_id"]),
        attention_bias=bool(config.get("attention_bias", False)),
        target_model_type=(config.get("eagleforge") or {}).get("target_model_type", "llama"),
    )


def read_dflash(path: str | Path) -> tuple[DFlashArchitecture, dict[str, torch.Tensor]]:
    """A DFlash draft directory's architecture and tensors; CheckpointError when unreadable."""
    config_path, weights_path = Path(path) / "config.json", Path(path) / "model.safetensors"
    try:
        config = json.loads(config_path.read_text())
        arch = dflash_architecture_of(config)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{config_path}: unreadable ({unreadable_reason(e)})") from None
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own type, and OSError
        raise CheckpointError(f"{weights_path}: unreadable ({unreadable_reason(e)})") from None
    return arch, tensors


def check_dflash(path: str | Path, target_num_layers: int | None = None) -> list[str]:
    """Every problem that would make a DFlash directory load wrongly in vLLM or SGLang, or
    draft from other layers than it was trained on; empty when there is none. What SGLang
    checks is from its ``models/dflash.py`` and ``speculative/dflash_utils.py``: the taps
    within ``num_target_layers``, known layer types, fc of [hidden, taps x hidden]."""
    path = Path(path)
    config_path, weights_path = path / "config.json", path / "model.safetensors"
    corrupt = checksum_problem(path)
    if corrupt is not None:
        return [f"{path}: {corrupt}, so its files are corrupt (use an earlier checkpoint)"]
    try:
        written = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        return [f"{config_path}: unreadable ({unreadable_reason(e)})"]
    problems = []
    if is_speculators(written):
        problems += _speculators_problems(written)
    config = as_engine_config(written)
    if config.get("architectures") != [DFLASH_ARCHITECTURE]:
        problems.append(
            f"architectures is {config.get('architectures')!r}; vLLM loads a DFlash draft as "
            f"['{DFLASH_ARCHITECTURE}']"
        )
    if "auto_map" in config:
        problems.append("auto_map is set: the engines load their own DFlash code, remove it")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers"):  # fmt: skip
        if not isinstance(config.get(key), int):
            problems.append(
                f"config.json has no integer '{key}'"
                + (" (transformers would default it to 128)" if key == "head_dim" else "")
            )
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        return [*problems, "config.json has no dflash_config (mask_token_id, target_layer_ids)"]
    mask, layer_ids = dflash.get("mask_token_id"), dflash.get("target_layer_ids")
    vocab = config.get("vocab_size")
    if not isinstance(mask, int) or (isinstance(vocab, int) and not 0 <= mask < vocab):
        problems.append(f"dflash_config.mask_token_id {mask!r} is not a token id below {vocab}")
    if not (
        isinstance(layer_ids, list) and layer_ids and all(isinstance(i, int) for i in layer_ids)
    ):
        problems.append(f"dflash_config.target_layer_ids must list layer ids, got {layer_ids!r}")
        layer_ids = None
    else:
        # the target's layer count given, else the draft's own num_target_layers, which SGLang
        # checks the taps against when it loads the draft
        limit = target_num_layers or config.get("num_target_layers")
        if isinstance(limit, int) and not all(0 <= i < limit for i in layer_ids):
            problems.append(
                f"dflash_config.target_layer_ids {layer_ids} (output of layer) are outside the "
                f"target's 0..{limit - 1}"
            )
    sizes = {config.get("block_size"), dflash.get("block_size")} - {None}
    if len(sizes) != 1 or not all(isinstance(s, int) and s >= 2 for s in sizes):
        problems.append(
            f"block_size must be one integer >= 2 at the top level and in dflash_config, got "
            f"{config.get('block_size')!r} and {dflash.get('block_size')!r}"
        )
    layers = config.get("num_hidden_layers")
    layer_types = config.get("layer_types")
    if isinstance(layers, int) and (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or not set(layer_types) <= {"full_attention", "sliding_attention"}
    ):
        problems.append(
            f"layer_types must list {layers} layer types (full_attention or sliding_attention, "
            f"what SGLang builds), got {layer_types!r}"
        )
    if not weights_path.is_file():
        return [*problems, f"{path}: no model.safetensors"]
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own type, and OSError
        return [*problems, f"{weights_path}: unreadable ({unreadable_reason(e)})"]
    if any("mask_hidden" in k for k in tensors):
        problems.append("a mask_hidden tensor is in the weights: vLLM refuses it")
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            problems.append(f"{name} is in the weights: a DFlash draft shares the target's")
    hidden, target_hidden = (
        config.get("hidden_size"),
        config.get("target_hidden_size", config.get("hidden_size")),
    )
    fc = tensors.get("fc.weight")
    if fc is None:
        problems.append("no fc.weight: the draft could not read the target's states")
    elif layer_ids is not None and isinstance(target_hidden, int):
        expected = (hidden, len(layer_ids) * target_hidden)
        if tuple(fc.shape) != expected:
            problems.append(
                f"fc.weight has shape {tuple(fc.shape)}, expected {expected} "
                f"({len(layer_ids)} tapped layers x target hidden {target_hidden})"
            )
        if target_hidden != hidden:
            problems.append(
                f"target_hidden_size {target_hidden} is not hidden_size {hidden}: SGLang sizes "
                "fc by hidden_size and would refuse these weights"
            )
    wanted = ["hidden_norm.weight", "norm.weight"]  # fc.weight: checked above
    if isinstance(layers, int):
        wanted += [f"layers.{i}.{name}" for i in range(layers) for name in LAYER_TENSORS]
        if config.get("attention_bias"):
            projections = ("q_proj", "k_proj", "v_proj", "o_proj")
            wanted += [f"layers.{i}.self_attn.{p}.bias" for i in range(layers) for p in projections]
        extra = sorted(
            {k.split(".")[1] for k in tensors if k.startswith("layers.")}
            - {str(i) for i in range(layers)}
        )
        if extra:
            problems.append(f"weights hold layers {extra} beyond num_hidden_layers {layers}")
        # vLLM and SGLang skip a tensor whose name they do not know: it would never load
        reported = {"fc.weight", "embed_tokens.weight", "lm_head.weight"}  # and mask_hidden
        unknown = sorted(k for k in set(tensors) - set(wanted) - reported if "mask_hidden" not in k)
        if unknown:
            problems.append(f"tensors no engine loads: {', '.join(unknown[:5])}")
    missing = [name for name in wanted if name not in tensors]
    problems += [f"no {name} in the weights" for name in missing[:5]]
    floats = {v.dtype for v in tensors.values() if v.is_floating_point()}
    declared = config.get("torch_dtype")
    if declared and len(floats) == 1 and str(next(iter(floats))) != f"torch.{declared}":
        problems.append(f"config says torch_dtype {declared}, the weights are {next(iter(floats))}")
    return problems


def _speculators_problems(config: dict[str, Any]) -> list[str]:
    """What vLLM's speculators reader needs of a DFlash config before it converts it."""
    problems = []
    if not isinstance(config.get("transformer_layer_config"), dict):
        problems.append("a speculators DFlash config needs its transformer_layer_config")
    ids = config.get("aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        problems.append(f"aux_hidden_state_layer_ids must list layer ids, got {ids!r}")
    try:
        methods = config["speculators_config"]["proposal_methods"]
        _ = methods[0]["speculative_tokens"]
        _ = config["speculators_config"]["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError):
        problems.append(
            "speculators_config needs proposal_methods[0].speculative_tokens and "
            "verifier.name_or_path (vLLM's speculators reader refuses it otherwise)"
        )
    return problems


class DFlashLayout:
    """A DFlash draft's directory: the one layout vLLM and SGLang both load, or speculators'."""

    family = DraftFamily.dflash
    title = "DFlash"
    signature = f"DFlash (architectures {DFLASH_ARCHITECTURE}, or speculators_model_type dflash)"
    served_by = "vLLM and SGLang"
    writes = {
        DraftFormat.sglang: DraftFormat.vllm,
        DraftFormat.vllm: DraftFormat.vllm,
        DraftFormat.speculators: DraftFormat.speculators,
    }

    def recognises(self, found: Found) -> bool:
        return found.config is not None and is_dflash(found.config)

    def owns(self, arch: object) -> bool:
        return isinstance(arch, DFlashArchitecture)

    def read(self, found: Found) -> tuple[DraftFormat, DFlashArchitecture, dict[str, torch.Tensor]]:
        assert found.config is not None  # recognised by it
        fmt = DraftFormat.speculators if is_speculators(found.config) else DraftFormat.vllm
        return (fmt, *read_dflash(found.path))

    def architecture_of(self, found: Found) -> DFlashArchitecture:
        assert found.config is not None
        return dflash_architecture_of(found.config)

    def check(self, found: Found, target_num_layers: int | None) -> list[str]:
        return check_dflash(found.path, target_num_layers)

    def load_checked(
        self, found: Found, target_num_layers: int
    ) -> tuple[DFlashArchitecture, dict[str, torch.Tensor]]:
        problems = check_dflash(found.path, target_num_layers)
        if problems:
            raise unusable(found.path, "DFlash", problems)
        return read_dflash(found.path)

    def write(
        self,
        arch: DFlashArchitecture,
        tensors: dict[str, torch.Tensor],
        out_dir: Path,
        fmt: DraftFormat,
        verifier: Verifier | None,
        speculative_tokens: int,
        target_gguf: Path | None,
    ) -> Path:
        return write_dflash(arch, tensors, out_dir, fmt, verifier)


DFLASH_LAYOUT = DFlashLayout()
