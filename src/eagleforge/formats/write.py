"""Writing a draft directory in any format (SGLang, vLLM, speculators) from tensors with
eagleforge's names."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagleforge.draft.dflash import DFlashArchitecture
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.errors import ConfigError
from eagleforge.files import save_safetensors
from eagleforge.formats.dflash import write_dflash
from eagleforge.formats.kinds import (
    SGLANG_ARCHITECTURE,
    SPECULATORS_ARCHITECTURE,
    VLLM_ARCHITECTURE,
    DraftFormat,
    dtype_name,
)


def sglang_config(arch: DraftArchitecture, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": arch.hidden_act,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "attention_bias": arch.attention_bias,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "vocab_size": arch.vocab_size,
        "draft_vocab_size": arch.draft_vocab_size,
        "target_hidden_size": arch.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(arch.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        # What vLLM reads first (and SGLang never reads): the same layers in vLLM's
        # input-of-layer numbering, so that this directory served by vLLM as it is taps the
        # layers the draft was trained on (vLLM would read eagle_config's ids one layer low).
        "eagle_aux_hidden_state_layer_ids": [
            i + DraftFormat.vllm.layer_id_offset for i in arch.aux_layer_ids
        ],
        # EAGLE-3.1's switches, at the top level where vLLM's and SGLang's llama_eagle3 read
        # them (both default them to false; vLLM's speculators reader defaults
        # norm_before_residual to true, so every format states all four)
        **eagle31_fields(arch),
        **parallel_drafting_fields(arch),
        "eagleforge": {"target_model_type": arch.target_model_type},
    }


def eagle31_fields(arch: DraftArchitecture) -> dict[str, bool]:
    """The four norm switches of an EAGLE-3(.1) draft, as its config.json states them."""
    return {
        "norm_before_residual": arch.norm_before_residual,
        "norm_before_fc": arch.norm_before_fc,
        "fc_norm": arch.fc_norm,
        "norm_output": arch.norm_output,
    }


def parallel_drafting_fields(arch: DraftArchitecture) -> dict[str, int]:
    """A parallel-drafting draft's mask token, where vLLM reads it (its ``mask_hidden`` tensor
    is among the weights); nothing for a sequential draft."""
    return {} if arch.mask_token_id is None else {"mask_token_id": arch.mask_token_id}


def export_sglang(draft: Eagle3Draft, out_dir: str | Path) -> Path:
    """Write the draft as an SGLang EAGLE-3 checkpoint directory (into an existing or new dir)."""
    return write_sglang(draft.arch, draft.state_dict(), out_dir)


def write_sglang(
    arch: DraftArchitecture | DFlashArchitecture,
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
) -> Path:
    """``export_sglang`` from the draft's tensors (its state-dict names; the embedding is
    left out)."""
    return write_draft(arch, tensors, out_dir, DraftFormat.sglang)


@dataclass
class Verifier:
    """The target a speculators-format draft names (``speculators_config.verifier``)."""

    name_or_path: str
    architectures: list[str] = field(default_factory=list)


def write_draft(
    arch: DraftArchitecture | DFlashArchitecture,
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    fmt: DraftFormat,
    verifier: Verifier | None = None,
    speculative_tokens: int = 3,
) -> Path:
    """Write a draft directory in ``fmt`` from tensors with eagleforge's names (the embedding,
    if given, is left out). A DFlash draft has one layout, which vLLM and SGLang both load."""
    if isinstance(arch, DFlashArchitecture):
        if fmt != DraftFormat.speculators:
            return write_dflash(arch, tensors, out_dir)
        verifier = verifier or Verifier(name_or_path="")
        return write_dflash(arch, tensors, out_dir, (verifier.name_or_path, verifier.architectures))
    if arch.mask_token_id is not None and fmt == DraftFormat.speculators:
        raise ConfigError(
            "export.format=speculators writes sequential EAGLE-3 drafts; a parallel-drafting "
            "draft (mask_token_id) is exported as format=vllm, which vLLM serves with "
            "parallel_drafting, or format=sglang."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept = {
        _to_format(k, fmt): v.detach().contiguous().cpu()
        for k, v in tensors.items()
        if not k.startswith("embed_tokens")
    }
    save_safetensors(kept, out / "model.safetensors", metadata={"format": "pt"})
    config = draft_config(arch, kept["fc.weight"].dtype, fmt, verifier, speculative_tokens)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def draft_config(
    arch: DraftArchitecture,
    dtype: torch.dtype,
    fmt: DraftFormat,
    verifier: Verifier | None = None,
    speculative_tokens: int = 3,
) -> dict[str, Any]:
    """The ``config.json`` of a draft in ``fmt``."""
    config = sglang_config(arch, dtype)
    if fmt == DraftFormat.sglang:
        return config
    layer_ids = [i + fmt.layer_id_offset for i in arch.aux_layer_ids]
    eagle = {
        "draft_vocab_size": arch.draft_vocab_size,
        "target_hidden_size": arch.target_hidden_size,
        **eagle31_fields(arch),
        "eagle_aux_hidden_state_layer_ids": layer_ids,
    }
    del config["eagle_config"]
    if fmt == DraftFormat.vllm:
        return {**config, "architectures": [VLLM_ARCHITECTURE], **eagle}
    layer = {k: v for k, v in config.items() if k not in eagle and k != "eagleforge"}
    layer["architectures"] = ["LlamaForCausalLM"]
    verifier = verifier or Verifier(name_or_path="")
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        **eagle,
        "torch_dtype": config["torch_dtype"],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier.name_or_path,
                "architectures": verifier.architectures,
            },
        },
        "eagleforge": config["eagleforge"],
    }


def _to_format(name: str, fmt: DraftFormat) -> str:
    return (
        fmt.layer_prefix + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
    )
