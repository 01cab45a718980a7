"""Checkpoint formats that serving engines load.

SGLang (``LlamaForCausalLMEagle3``): ``config.json`` with Llama fields plus ``draft_vocab_size``,
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``, and
``model.safetensors`` holding ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
``d2t`` and ``t2d`` -- no embedding (the engine shares the target's).

Layer ids: eagleforge numbers aux layers by output-of-layer, 0-based (layer 1 = the output of
the second decoder layer). SGLang's ``eagle_aux_hidden_state_layer_ids`` uses the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagleforge.draft.model import DraftArchitecture, Eagle3Draft

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(arch.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "eagleforge": {"target_model_type": arch.target_model_type},
    }


def export_sglang(draft: Eagle3Draft, out_dir: str | Path) -> Path:
    """Write the draft as an SGLang EAGLE-3 checkpoint directory (into an existing or new dir)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in draft.trainable_state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = sglang_config(draft.arch, draft.fc.weight.dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_sglang(path: str | Path) -> tuple[DraftArchitecture, dict[str, torch.Tensor]]:
    """Read an SGLang EAGLE-3 directory back: the architecture and its tensors."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    arch = DraftArchitecture(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config.get("rope_theta", 10000.0),
        max_position_embeddings=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        aux_layer_ids=list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        rope_scaling=config.get("rope_scaling"),
        hidden_act=config.get("hidden_act", "silu"),
        attention_bias=config.get("attention_bias", False),
        target_model_type=config.get("eagleforge", {}).get("target_model_type", "llama"),
    )
    return arch, load_file(str(path / "model.safetensors"))
