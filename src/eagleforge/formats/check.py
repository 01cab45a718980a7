"""The draft inspector: every problem that would make a draft directory from any tool load
wrongly or accept poorly (``python -m eagleforge.export --check DIR``), and loading a draft
only once it has none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagleforge.draft.config import DraftFamily
from eagleforge.draft.dflash import DFlashArchitecture
from eagleforge.draft.model import DraftArchitecture
from eagleforge.errors import ConfigError
from eagleforge.files import checksum_problem, unreadable_reason
from eagleforge.formats.dflash import check_dflash, is_dflash, read_dflash
from eagleforge.formats.kinds import DraftFormat
from eagleforge.formats.read import (
    architecture_of,
    aux_layer_ids_of,
    detect_format,
    eagle31_switches,
    from_format,
    llama_fields,
)


def check_draft(path: str | Path, target_num_layers: int | None = None) -> list[str]:
    """Every problem that would make an EAGLE-3 draft directory in any of the three formats, or
    a DFlash draft directory (from any tool), load wrongly or accept poorly; an empty list when
    there is none."""
    if _is_dflash_dir(Path(path)):
        return check_dflash(path, target_num_layers)
    return _inspect(Path(path), target_num_layers)[0]


def _is_dflash_dir(path: Path) -> bool:
    try:
        return is_dflash(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return False  # _inspect names the problem


FAMILY_NAMES = {
    DraftFamily.eagle3: "an EAGLE-3",
    DraftFamily.dflash: "a DFlash",
    DraftFamily.peagle: "a P-EAGLE",
}


def family_in(config: dict[str, Any]) -> DraftFamily:
    """The family a draft directory's config.json describes."""
    if is_dflash(config):
        return DraftFamily.dflash
    # a parallel-drafting EAGLE-3 draft names the token of its placeholder slots
    return DraftFamily.peagle if config.get("mask_token_id") is not None else DraftFamily.eagle3


def family_problem(path: str | Path, family: DraftFamily) -> str | None:
    """What is wrong when a draft directory holds the other family's draft than ``family``
    (its tensors would not fit, name by name): which family it is and the ``draft=`` that
    takes it. None when it is of ``family``, or unreadable (``check_draft`` names that)."""
    try:
        found = family_in(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return None
    if found == family:
        return None
    return (
        f"{FAMILY_NAMES[found]} draft, this run trains draft={family.value}; use "
        f"draft={found.value}, or give {FAMILY_NAMES[family]} draft"
    )


def load_checked_draft(
    path: str | Path, target_num_layers: int
) -> tuple[DraftArchitecture | DFlashArchitecture, dict[str, torch.Tensor]]:
    """``load_draft_dir`` after ``check_draft`` (reading the weights once for EAGLE-3);
    ConfigError listing every problem."""
    if _is_dflash_dir(Path(path)):
        problems = check_dflash(path, target_num_layers)
        if problems:
            raise ConfigError(f"{path}: not a usable DFlash draft: {'; '.join(problems)}.")
        return read_dflash(path)
    problems, config, tensors = _inspect(Path(path), target_num_layers)
    if problems:
        raise ConfigError(
            f"{path}: not a usable EAGLE-3 draft: {'; '.join(problems)}. Export it again with "
            "the tool that trained it, or train one with eagleforge for this target."
        )
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
