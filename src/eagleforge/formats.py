"""Draft directories that serving engines load: SGLang, vLLM and speculators formats.

Every format is a directory with ``config.json`` and ``model.safetensors`` (no embedding: the
engine shares the target's) holding ``fc.weight``, the decoder layer, ``norm.weight``,
``lm_head.weight``, ``d2t`` and ``t2d``. They differ in names and in the numbering of the aux
layers:

| format | architectures | layer tensors | aux layer ids |
|---|---|---|---|
| ``sglang`` | ``LlamaForCausalLMEagle3`` | ``midlayer.*`` | ``eagle_config.eagle_aux_hidden_state_layer_ids``, output of layer |
| ``vllm`` | ``Eagle3LlamaForCausalLM`` | ``layers.0.*`` | top-level ``eagle_aux_hidden_state_layer_ids``, input of layer (+1) |
| ``speculators`` | ``Eagle3Speculator`` | ``layers.0.*`` | as vllm, plus ``speculators_config`` naming the verifier |

eagleforge numbers aux layers by output-of-layer, 0-based (layer 1 = the output of the second
decoder layer), like SGLang. vLLM collects a layer's *input* (the previous layer's output),
so its numbers are one higher: the same three hidden states are [1, 15, 28] for SGLang and
[2, 16, 29] for vLLM on a 32-layer target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.errors import ConfigError
from eagleforge.files import checksum_problem, save_safetensors

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_ARCHITECTURE = "Eagle3LlamaForCausalLM"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"


class DraftFormat(str, Enum):
    sglang = "sglang"
    vllm = "vllm"
    speculators = "speculators"

    @property
    def architecture(self) -> str:
        return {
            "sglang": SGLANG_ARCHITECTURE,
            "vllm": VLLM_ARCHITECTURE,
            "speculators": SPECULATORS_ARCHITECTURE,
        }[self.value]

    @property
    def layer_prefix(self) -> str:
        """Name prefix of the decoder layer's tensors (eagleforge's own is ``midlayer.``)."""
        return "midlayer." if self == DraftFormat.sglang else "layers.0."

    @property
    def layer_id_offset(self) -> int:
        """Added to eagleforge's (output-of-layer) aux layer ids in this format."""
        return 0 if self == DraftFormat.sglang else 1


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
    return write_draft(arch, tensors, out_dir, DraftFormat.sglang)


@dataclass
class Verifier:
    """The target a speculators-format draft names (``speculators_config.verifier``)."""

    name_or_path: str
    architectures: list[str] = field(default_factory=list)


def write_draft(
    arch: DraftArchitecture,
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    fmt: DraftFormat,
    verifier: Verifier | None = None,
    speculative_tokens: int = 3,
) -> Path:
    """Write a draft directory in ``fmt`` from tensors with eagleforge's names (the embedding,
    if given, is left out)."""
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
        "norm_before_residual": False,  # the residual is the un-normed hidden state
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


class ExportDType(str, Enum):
    keep = "keep"  # the draft's own dtype
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


@dataclass
class ExportConfig:
    """The `export` config section (python -m eagleforge.export)."""

    # The draft to export: a checkpoints/step_* directory or a draft directory in any format.
    draft: str | None = None
    # sglang | vllm | speculators.
    format: DraftFormat = DraftFormat.sglang
    # Where to write it (must not exist yet); null = <draft>-<format> beside the draft.
    output_dir: str | None = None
    # Floating-point dtype of the exported weights.
    dtype: ExportDType = ExportDType.keep
    # speculators: the target's hub id or path; null = the target of the draft's training
    # config.yaml: model.path, or the cache directory of a bundled or random target.
    verifier: str | None = None
    # speculators: the target's architectures (e.g. [LlamaForCausalLM]); [] = those of its
    # config.json (its directory or the Hugging Face cache).
    verifier_architectures: list[str] = field(default_factory=list)
    # speculators: tokens the engine proposes per step by default.
    speculative_tokens: int = 3

    def __post_init__(self) -> None:
        if self.speculative_tokens < 1:
            raise ConfigError(
                f"export.speculative_tokens must be >= 1, got {self.speculative_tokens}."
            )


def detect_format(config: dict[str, Any]) -> DraftFormat:
    """The format a draft's ``config.json`` is written in."""
    if "speculators_model_type" in config:
        return DraftFormat.speculators
    if config.get("architectures") == [VLLM_ARCHITECTURE] or (
        "eagle_aux_hidden_state_layer_ids" in config and "eagle_config" not in config
    ):
        return DraftFormat.vllm
    return DraftFormat.sglang


def _to_format(name: str, fmt: DraftFormat) -> str:
    return (
        fmt.layer_prefix + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
    )


def _from_format(name: str) -> str:
    """eagleforge's name of a tensor in any format (vLLM also accepts ``midlayer.*``)."""
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def read_draft(path: str | Path) -> tuple[DraftFormat, DraftArchitecture, dict[str, torch.Tensor]]:
    """A draft directory in any format: its format, architecture and tensors (eagleforge names)."""
    config = json.loads((Path(path) / "config.json").read_text())
    fmt = detect_format(config)
    tensors = load_file(str(Path(path) / "model.safetensors"))
    return fmt, _architecture(config), {_from_format(k): v for k, v in tensors.items()}


def load_sglang(path: str | Path) -> tuple[DraftArchitecture, dict[str, torch.Tensor]]:
    """Read a draft directory (SGLang, or any format ``read_draft`` knows) back: the
    architecture and its tensors."""
    _, arch, tensors = read_draft(path)
    return arch, tensors


def read_sglang_architecture(path: str | Path) -> DraftArchitecture:
    """The architecture of a draft directory, from its config.json alone."""
    return _architecture(json.loads((Path(path) / "config.json").read_text()))


def _llama_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder-layer fields, wherever the format keeps them."""
    return config.get("transformer_layer_config") or config


def _aux_layer_ids(config: dict[str, Any]) -> Any:
    """The aux layer ids in eagleforge's numbering (output of layer), as the config gives
    them (None or malformed when absent)."""
    fmt = detect_format(config)
    if fmt == DraftFormat.sglang:
        return (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return [i - fmt.layer_id_offset for i in ids]
    return ids


def _architecture(config: dict[str, Any]) -> DraftArchitecture:
    layer = _llama_fields(config)
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
        aux_layer_ids=list(_aux_layer_ids(config)),
        rope_scaling=layer.get("rope_scaling"),
        hidden_act=layer.get("hidden_act", "silu"),
        attention_bias=layer.get("attention_bias", False),
        target_model_type=config.get("eagleforge", {}).get("target_model_type", "llama"),
    )


def check_draft(path: str | Path, target_num_layers: int | None = None) -> list[str]:
    """Every problem that would make an EAGLE-3 draft directory in any of the three formats
    (from any tool) load wrongly or accept poorly; an empty list when there is none."""
    return _inspect(Path(path), target_num_layers)[0]


def load_checked_draft(
    path: str | Path, target_num_layers: int
) -> tuple[DraftArchitecture, dict[str, torch.Tensor]]:
    """``load_sglang`` after ``check_draft`` (reading the weights once); ConfigError listing
    every problem."""
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
    """(problems, config, tensors with eagleforge names) of a draft directory; the last two
    empty when unreadable."""
    problems: list[str] = []
    config_path, weights_path = path / "config.json", path / "model.safetensors"
    if not config_path.is_file():
        return [f"{path}: no config.json"], {}, {}
    corrupt = checksum_problem(path)  # a training checkpoint records its files' digests
    if corrupt is not None:
        return [f"{path}: {corrupt}, so its files are corrupt (use an earlier checkpoint)"], {}, {}
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        return [f"{config_path}: not valid JSON ({e.msg})"], {}, {}
    fmt = detect_format(config)
    if config.get("architectures") != [fmt.architecture]:
        problems.append(
            f"architectures is {config.get('architectures')!r}, a {fmt.value} draft needs "
            f"['{fmt.architecture}'] (a plain LlamaForCausalLM is loaded as a normal model)"
        )
    layer = _llama_fields(config)
    for key in ("hidden_size", "vocab_size", "num_attention_heads"):
        if not isinstance(layer.get(key), int):
            problems.append(f"config.json has no integer '{key}'")
    if not isinstance(config.get("draft_vocab_size"), int):
        problems.append("config.json has no integer 'draft_vocab_size'")
    if layer.get("tie_word_embeddings"):
        problems.append(
            "tie_word_embeddings is true: the draft's lm_head (over the draft vocabulary) must "
            "not be tied to the target's embedding"
        )
    layer_ids = _aux_layer_ids(config)
    where = (
        "eagle_config.eagle_aux_hidden_state_layer_ids"
        if fmt == DraftFormat.sglang
        else "eagle_aux_hidden_state_layer_ids"
    )
    if not (isinstance(layer_ids, list) and len(layer_ids) == 3):
        problems.append(f"{where} must list the 3 target layers the draft reads, got {layer_ids!r}")
    elif target_num_layers is not None:
        # In its own numbering every format names layers 0..N-1 (SGLang their outputs, vLLM
        # their inputs), so the check is on the ids as written.
        shown = [i + fmt.layer_id_offset for i in layer_ids]
        if not all(0 <= i < target_num_layers for i in shown):
            problems.append(
                f"aux layer ids {shown} ({fmt.value} numbering) are outside the target's "
                f"0..{target_num_layers - 1}"
            )
    if not weights_path.is_file():
        return [*problems, f"{path}: no model.safetensors"], config, {}
    tensors = {_from_format(k): v for k, v in load_file(str(weights_path)).items()}
    hidden, draft_vocab = layer.get("hidden_size"), config.get("draft_vocab_size")
    vocab = layer.get("vocab_size")
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
