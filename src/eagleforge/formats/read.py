"""Reading a draft directory in any format back: its format, its architecture (from
``config.json``) and its tensors under eagleforge's names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagleforge.draft.dflash import DFlashArchitecture
from eagleforge.draft.model import DraftArchitecture
from eagleforge.errors import CheckpointError
from eagleforge.files import unreadable_reason
from eagleforge.formats.dflash import (
    dflash_architecture_of,
    is_dflash,
    is_speculators,
    read_dflash,
)
from eagleforge.formats.kinds import VLLM_ARCHITECTURE, DraftFormat


def detect_format(config: dict[str, Any]) -> DraftFormat:
    """The format a draft's ``config.json`` is written in."""
    if "speculators_model_type" in config:
        return DraftFormat.speculators
    if config.get("architectures") == [VLLM_ARCHITECTURE] or (
        "eagle_aux_hidden_state_layer_ids" in config and "eagle_config" not in config
    ):
        return DraftFormat.vllm
    return DraftFormat.sglang


def from_format(name: str) -> str:
    """eagleforge's name of a tensor in any format (vLLM also accepts ``midlayer.*``)."""
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def read_draft(
    path: str | Path,
) -> tuple[DraftFormat, DraftArchitecture | DFlashArchitecture, dict[str, torch.Tensor]]:
    """A draft directory in any format: its format, architecture and tensors (eagleforge names).
    A DFlash draft reads as vllm (the layout vLLM and SGLang load) or speculators."""
    config_path, weights_path = Path(path) / "config.json", Path(path) / "model.safetensors"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_path}: unreadable ({unreadable_reason(e)})") from None
    if is_dflash(config):
        dflash_fmt = DraftFormat.speculators if is_speculators(config) else DraftFormat.vllm
        return (dflash_fmt, *read_dflash(path))
    fmt = detect_format(config)
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own type, and OSError
        raise CheckpointError(
            f"{weights_path}: unreadable ({unreadable_reason(e)}); export the draft again, or "
            "fetch it again"
        ) from None
    return fmt, architecture_of(config), {from_format(k): v for k, v in tensors.items()}


def load_draft_dir(
    path: str | Path,
) -> tuple[DraftArchitecture | DFlashArchitecture, dict[str, torch.Tensor]]:
    """Read a draft directory (SGLang, or any format ``read_draft`` knows) back: the
    architecture and its tensors."""
    _, arch, tensors = read_draft(path)
    return arch, tensors


def read_architecture(path: str | Path) -> DraftArchitecture | DFlashArchitecture:
    """The architecture of a draft directory (either family), from its config.json alone."""
    config = json.loads((Path(path) / "config.json").read_text())
    return dflash_architecture_of(config) if is_dflash(config) else architecture_of(config)


def llama_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder-layer fields, wherever the format keeps them."""
    return config.get("transformer_layer_config") or config


def aux_layer_ids_of(config: dict[str, Any]) -> Any:
    """The aux layer ids in eagleforge's numbering (output of layer), as the config gives
    them (None or malformed when absent)."""
    fmt = detect_format(config)
    if fmt == DraftFormat.sglang:
        return (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return [i - fmt.layer_id_offset for i in ids]
    return ids


def eagle31_switches(config: dict[str, Any]) -> dict[str, bool]:
    """EAGLE-3.1's norm switches as the engines read them from a ``config.json``: absent
    means false, except ``norm_before_residual`` in a speculators draft, which vLLM's
    speculators reader takes as true when unstated."""
    eagle = config.get("eagle_config") or {}
    unstated_residual = detect_format(config) == DraftFormat.speculators
    return {
        "norm_before_residual": bool(config.get("norm_before_residual", unstated_residual)),
        # vLLM looks in eagle_config first (NVIDIA's checkpoints keep it there)
        "norm_before_fc": bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False))),
        "fc_norm": bool(config.get("fc_norm", False)),
        "norm_output": bool(config.get("norm_output", False)),
    }


def architecture_of(config: dict[str, Any]) -> DraftArchitecture:
    """The architecture a draft's ``config.json`` describes, in any format."""
    layer = llama_fields(config)
    norms = eagle31_switches(config)
    return DraftArchitecture(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        rms_norm_eps=layer["rms_norm_eps"],
        rope_theta=layer.get("rope_theta", 10000.0),
        max_position_embeddings=layer["max_position_embeddings"],
        vocab_size=layer["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config.get("target_hidden_size", layer["hidden_size"]),
        aux_layer_ids=list(aux_layer_ids_of(config)),
        rope_scaling=layer.get("rope_scaling"),
        hidden_act=layer.get("hidden_act", "silu"),
        attention_bias=layer.get("attention_bias", False),
        target_model_type=config.get("eagleforge", {}).get("target_model_type", "llama"),
        fc_norm=norms["fc_norm"],
        norm_before_fc=norms["norm_before_fc"],
        norm_output=norms["norm_output"],
        norm_before_residual=norms["norm_before_residual"],
        mask_token_id=config.get("mask_token_id"),
    )
