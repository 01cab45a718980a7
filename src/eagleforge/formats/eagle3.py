"""An EAGLE-3 draft directory in the three layouts engines load (SGLang, vLLM, speculators;
the table in ``eagleforge.formats``) -- writing it, reading it back, and every problem that
would make it load wrongly (``export --check``). A P-EAGLE draft is an EAGLE-3 directory with
``mask_token_id`` in its config and a ``mask_hidden`` tensor (vLLM's ``parallel_drafting``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagleforge.draft.config import DraftFamily
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.errors import CheckpointError, ConfigError
from eagleforge.files import checksum_problem, save_safetensors, unreadable_reason
from eagleforge.formats.kinds import (
    SGLANG_ARCHITECTURE,
    SPECULATORS_ARCHITECTURE,
    VLLM_ARCHITECTURE,
    DraftFormat,
    Verifier,
    dtype_name,
)
from eagleforge.formats.layout import Found, unusable

EAGLE3_ARCHITECTURES = (SGLANG_ARCHITECTURE, VLLM_ARCHITECTURE, SPECULATORS_ARCHITECTURE)
# config.json fields only EAGLE-3-style drafts have: EAGLE's own checkpoints name a plain
# LlamaForCausalLM, and a broken architectures field is to be named by the checks, not taken
# for another model
EAGLE3_CONFIG_MARKS = ("eagle_config", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size")


def holds_eagle3(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` is an EAGLE-3 draft's (P-EAGLE's included), by its own marks:
    speculators' ``eagle3`` type, an EAGLE-3 architecture name, or an EAGLE-3 field."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        return bool(kind == "eagle3")
    architectures = config.get("architectures")
    named = isinstance(architectures, list) and any(
        name in EAGLE3_ARCHITECTURES for name in architectures
    )
    return named or any(key in config for key in EAGLE3_CONFIG_MARKS)


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
    return write_eagle3(draft.arch, draft.state_dict(), out_dir, DraftFormat.sglang)


def write_eagle3(
    arch: DraftArchitecture,
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    fmt: DraftFormat,
    verifier: Verifier | None = None,
    speculative_tokens: int = 3,
) -> Path:
    """Write an EAGLE-3 draft directory in ``fmt`` from tensors with eagleforge's names (the
    embedding, if given, is left out)."""
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


def read_eagle3(path: str | Path) -> tuple[DraftFormat, DraftArchitecture, dict[str, torch.Tensor]]:
    """An EAGLE-3 draft directory in any of the three layouts: its format, architecture and
    tensors (eagleforge names)."""
    config_path, weights_path = Path(path) / "config.json", Path(path) / "model.safetensors"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_path}: unreadable ({unreadable_reason(e)})") from None
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own type, and OSError
        raise CheckpointError(
            f"{weights_path}: unreadable ({unreadable_reason(e)}); export the draft again, or "
            "fetch it again"
        ) from None
    return (
        detect_format(config),
        architecture_of(config),
        {from_format(k): v for k, v in tensors.items()},
    )


def check_eagle3(path: str | Path, target_num_layers: int | None = None) -> list[str]:
    """Every problem that would make an EAGLE-3 draft directory in any of the three layouts
    (from any tool) load wrongly or accept poorly; an empty list when there is none."""
    return _inspect(Path(path), target_num_layers)[0]


def load_checked_eagle3(
    path: str | Path, target_num_layers: int
) -> tuple[DraftArchitecture, dict[str, torch.Tensor]]:
    """An EAGLE-3 draft directory's architecture and tensors once ``check_eagle3`` finds no
    problem (its weights read once); ConfigError listing every problem."""
    problems, config, tensors = _inspect(Path(path), target_num_layers)
    if problems:
        raise unusable(Path(path), "EAGLE-3", problems)
    return architecture_of(config), tensors


def _inspect(
    path: Path, target_num_layers: int | None
) -> tuple[list[str], dict[str, Any], dict[str, torch.Tensor]]:
    """(problems, config, tensors with eagleforge names) of a draft directory; the last two
    empty when unreadable."""
    problems: list[str] = []
    config_path, weights_path = path / "config.json", path / "model.safetensors"
    if not path.is_dir():
        return (
            [
                f"{path}: not a directory (a draft is a directory with config.json and "
                "model.safetensors)"
                if path.exists()
                else f"{path}: no such directory"
            ],
            {},
            {},
        )
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
    layer = llama_fields(config)
    # every field architecture_of reads without a default
    for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size"):  # fmt: skip
        if not isinstance(layer.get(key), int):
            problems.append(f"config.json has no integer '{key}'")
    if not isinstance(layer.get("rms_norm_eps"), (int, float)):
        problems.append("config.json has no number 'rms_norm_eps'")
    if not isinstance(config.get("draft_vocab_size"), int):
        problems.append("config.json has no integer 'draft_vocab_size'")
    if layer.get("tie_word_embeddings"):
        problems.append(
            "tie_word_embeddings is true: the draft's lm_head (over the draft vocabulary) must "
            "not be tied to the target's embedding"
        )
    layer_ids = aux_layer_ids_of(config)
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
    if fmt == DraftFormat.sglang and "eagle_aux_hidden_state_layer_ids" in config:
        problems += _vllm_ids_problem(config, layer_ids)
    if not weights_path.is_file():
        return [*problems, f"{path}: no model.safetensors"], config, {}
    try:
        tensors = {from_format(k): v for k, v in load_file(str(weights_path)).items()}
    except Exception as e:  # safetensors raises its own type, and OSError
        return [*problems, f"{weights_path}: unreadable ({unreadable_reason(e)})"], config, {}
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
    problems += _norm_problems(config, tensors)
    problems += _mask_hidden_problems(config, tensors)
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


def _norm_problems(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[str]:
    """EAGLE-3.1's norms of fc's input: each switch needs its tensors, and tensors without
    their switch are dropped by the engines (the draft would run without a norm it was
    trained with)."""
    switches = eagle31_switches(config)
    width = config.get("target_hidden_size") or llama_fields(config).get("hidden_size")
    problems = []
    if switches["fc_norm"] and switches["norm_before_fc"]:
        problems.append(
            "fc_norm and norm_before_fc are both true: the engines would apply both norms, "
            "a draft is trained with one of them"
        )
    expected = {
        "input_norm.weight": (switches["norm_before_fc"], "norm_before_fc", 3),
        **{f"fc_norm.{i}.weight": (switches["fc_norm"], "fc_norm", 1) for i in range(3)},
    }
    for name, (needed, switch, multiple) in expected.items():
        tensor = tensors.get(name)
        if needed and tensor is None:
            problems.append(f"{switch} is true but there is no {name}")
        elif not needed and tensor is not None:
            problems.append(
                f"{name} is in the weights but {switch} is false: the engines drop it and run "
                "the draft without a norm it was trained with"
            )
        elif (
            tensor is not None
            and isinstance(width, int)
            and tuple(tensor.shape) != (multiple * width,)
        ):
            problems.append(
                f"{name} has shape {tuple(tensor.shape)}, expected ({multiple * width},)"
            )
    return problems


def _mask_hidden_problems(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[str]:
    """A parallel-drafting draft (``mask_token_id``) needs its ``mask_hidden`` features, one
    per aux state width; vLLM refuses it without them and drops them from a sequential one."""
    mask_hidden, mask_id = tensors.get("mask_hidden"), config.get("mask_token_id")
    width = config.get("target_hidden_size") or llama_fields(config).get("hidden_size")
    if mask_id is None:
        if mask_hidden is None:
            return []
        return ["mask_hidden is in the weights but config.json has no mask_token_id"]
    problems = []
    if not isinstance(mask_id, int) or not 0 <= mask_id < llama_fields(config).get("vocab_size", 0):
        problems.append(f"mask_token_id {mask_id!r} is not a token id of the target vocabulary")
    if mask_hidden is None:
        problems.append("mask_token_id is set (parallel drafting) but there is no mask_hidden")
    elif isinstance(width, int) and mask_hidden.numel() != 3 * width:
        problems.append(
            f"mask_hidden has shape {tuple(mask_hidden.shape)}, expected (1, 1, {3 * width})"
        )
    return problems


def _vllm_ids_problem(config: dict[str, Any], layer_ids: Any) -> list[str]:
    """An SGLang draft's top-level ids are the ones vLLM reads (input of layer): they must
    name the layers of eagle_config's (output of layer), one higher."""
    top = config["eagle_aux_hidden_state_layer_ids"]
    if not isinstance(layer_ids, list):
        return []
    expected = [i + DraftFormat.vllm.layer_id_offset for i in layer_ids]
    if top != expected:
        return [
            f"top-level eagle_aux_hidden_state_layer_ids {top!r} (what vLLM reads, input of "
            f"layer) do not name the layers of eagle_config's {layer_ids!r} (output of layer, "
            f"what SGLang reads): vLLM would tap other layers than SGLang; expected {expected}"
        ]
    return []


class Eagle3Layout:
    """EAGLE-3's directory in its three layouts; with ``parallel``, P-EAGLE's: the same with
    ``mask_token_id`` in config.json and ``mask_hidden`` among the weights (no speculators
    layout: that format's ``peagle`` type is not written here)."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self.family = DraftFamily.peagle if parallel else DraftFamily.eagle3
        self.title = "P-EAGLE" if parallel else "EAGLE-3"
        names = ", ".join(EAGLE3_ARCHITECTURES[:-1]) + f" or {EAGLE3_ARCHITECTURES[-1]}"
        self.signature = (
            "P-EAGLE (an EAGLE-3 config.json with mask_token_id)"
            if parallel
            else f"EAGLE-3 (architectures {names})"
        )
        self.served_by = "vLLM, with parallel_drafting" if parallel else "SGLang and vLLM"
        kept = (DraftFormat.sglang, DraftFormat.vllm)
        self.writes = {f: f for f in (kept if parallel else (*kept, DraftFormat.speculators))}

    def recognises(self, found: Found) -> bool:
        config = found.config
        return (
            config is not None
            and holds_eagle3(config)
            and (config.get("mask_token_id") is not None) == self.parallel
        )

    def owns(self, arch: object) -> bool:
        return isinstance(arch, DraftArchitecture) and (
            (arch.mask_token_id is not None) == self.parallel
        )

    def read(self, found: Found) -> tuple[DraftFormat, DraftArchitecture, dict[str, torch.Tensor]]:
        return read_eagle3(found.path)

    def architecture_of(self, found: Found) -> DraftArchitecture:
        assert found.config is not None  # recognised by it
        return architecture_of(found.config)

    def check(self, found: Found, target_num_layers: int | None) -> list[str]:
        return check_eagle3(found.path, target_num_layers)

    def load_checked(
        self, found: Found, target_num_layers: int
    ) -> tuple[DraftArchitecture, dict[str, torch.Tensor]]:
        return load_checked_eagle3(found.path, target_num_layers)

    def write(
        self,
        arch: DraftArchitecture,
        tensors: dict[str, torch.Tensor],
        out_dir: Path,
        fmt: DraftFormat,
        verifier: Verifier | None,
        speculative_tokens: int,
        target_gguf: Path | None,
    ) -> Path:
        return write_eagle3(arch, tensors, out_dir, fmt, verifier, speculative_tokens)


EAGLE3_LAYOUT = Eagle3Layout(parallel=False)
PEAGLE_LAYOUT = Eagle3Layout(parallel=True)
