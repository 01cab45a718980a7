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
from eagleforge.errors import ConfigError

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
    return write_sglang(draft.arch, draft.state_dict(), out_dir)


def write_sglang(
    arch: DraftArchitecture, tensors: dict[str, torch.Tensor], out_dir: str | Path
) -> Path:
    """``export_sglang`` from the draft's tensors (its state-dict names; the embedding is
    left out)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept = {
        k: v.detach().contiguous().cpu()
        for k, v in tensors.items()
        if not k.startswith("embed_tokens")
    }
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = sglang_config(arch, kept["fc.weight"].dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_sglang(path: str | Path) -> tuple[DraftArchitecture, dict[str, torch.Tensor]]:
    """Read an SGLang EAGLE-3 directory back: the architecture and its tensors."""
    return read_sglang_architecture(path), load_file(str(Path(path) / "model.safetensors"))


def read_sglang_architecture(path: str | Path) -> DraftArchitecture:
    """The architecture of an SGLang EAGLE-3 directory, from its config.json alone."""
    return _architecture(json.loads((Path(path) / "config.json").read_text()))


def _architecture(config: dict[str, Any]) -> DraftArchitecture:
    return DraftArchitecture(
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


def check_sglang_draft(path: str | Path, target_num_layers: int | None = None) -> list[str]:
    """Every problem that would make an SGLang EAGLE-3 draft directory (from any tool) load
    wrongly or accept poorly; an empty list when there is none."""
    return _inspect(Path(path), target_num_layers)[0]


def load_checked_sglang(
    path: str | Path, target_num_layers: int
) -> tuple[DraftArchitecture, dict[str, torch.Tensor]]:
    """``load_sglang`` after ``check_sglang_draft`` (reading the weights once); ConfigError
    listing every problem."""
    problems, config, tensors = _inspect(Path(path), target_num_layers)
    if problems:
        raise ConfigError(
            f"{path}: not a usable EAGLE-3 draft: {'; '.join(problems)}. Export it again with "
            "the tool that trained it, or train one with eagleforge for this target."
        )
    return _architecture(config), tensors


def _inspect(
    path: Path, target_num_layers: int | None
) -> tuple[list[str], dict[str, Any], dict[str, torch.Tensor]]:
    """(problems, config, tensors) of a draft directory; the last two empty when unreadable."""
    problems: list[str] = []
    config_path, weights_path = path / "config.json", path / "model.safetensors"
    if not config_path.is_file():
        return [f"{path}: no config.json"], {}, {}
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        return [f"{config_path}: not valid JSON ({e.msg})"], {}, {}
    if config.get("architectures") != [SGLANG_ARCHITECTURE]:
        problems.append(
            f"architectures is {config.get('architectures')!r}, SGLang needs "
            f"['{SGLANG_ARCHITECTURE}'] (a plain LlamaForCausalLM is loaded as a normal model)"
        )
    for key in ("hidden_size", "vocab_size", "draft_vocab_size", "num_attention_heads"):
        if not isinstance(config.get(key), int):
            problems.append(f"config.json has no integer '{key}'")
    if config.get("tie_word_embeddings"):
        problems.append(
            "tie_word_embeddings is true: the draft's lm_head (over the draft vocabulary) must "
            "not be tied to the target's embedding"
        )
    layer_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(layer_ids, list) and len(layer_ids) == 3):
        problems.append(
            "eagle_config.eagle_aux_hidden_state_layer_ids must list the 3 target layers the "
            f"draft reads, got {layer_ids!r}"
        )
    elif target_num_layers is not None and not all(0 <= i < target_num_layers for i in layer_ids):
        problems.append(
            f"aux layer ids {layer_ids} are outside the target's 0..{target_num_layers - 1}"
        )
    if not weights_path.is_file():
        return [*problems, f"{path}: no model.safetensors"], config, {}
    tensors = load_file(str(weights_path))
    hidden, draft_vocab = config.get("hidden_size"), config.get("draft_vocab_size")
    vocab = config.get("vocab_size")
    head = tensors.get("lm_head.weight")
    if head is None:
        problems.append("no lm_head.weight: the engine would use an untrained head (τ = 1)")
    elif tuple(head.shape) != (draft_vocab, hidden):
        problems.append(
            f"lm_head.weight has shape {tuple(head.shape)}, expected (draft_vocab_size "
            f"{draft_vocab}, hidden_size {hidden})"
        )
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None or t2d is None:
        problems.append(
            "no d2t/t2d vocab map: draft ids would be read as target ids (acceptance collapses)"
        )
    else:
        if tuple(d2t.shape) != (draft_vocab,) or d2t.dtype != torch.int64:
            problems.append(
                f"d2t must be int64 [{draft_vocab}], got {d2t.dtype} {tuple(d2t.shape)}"
            )
        elif tuple(t2d.shape) != (vocab,) or t2d.dtype != torch.bool:
            problems.append(f"t2d must be bool [{vocab}], got {t2d.dtype} {tuple(t2d.shape)}")
        else:
            target_ids = torch.arange(len(d2t)) + d2t
            if bool(((target_ids < 0) | (target_ids >= len(t2d))).any()):
                problems.append("d2t maps draft ids outside the target vocabulary")
            elif not bool(t2d[target_ids].all()) or int(t2d.sum()) != len(d2t):
                problems.append("d2t and t2d disagree on which target ids are in the draft vocab")
    floats = {v.dtype for v in tensors.values() if v.is_floating_point()}
    if len(floats) > 1:
        problems.append(f"weights mix dtypes {sorted(str(d) for d in floats)}")
    declared = config.get("torch_dtype")
    if declared and len(floats) == 1 and str(next(iter(floats))) != f"torch.{declared}":
        problems.append(f"config says torch_dtype {declared}, the weights are {next(iter(floats))}")
    return problems, config, tensors
