"""A draft directory of any family: which family its ``config.json`` holds, and reading,
writing and checking it through that family's layout module -- ``eagle3`` (EAGLE-3 and
P-EAGLE, three layouts), ``dflash`` (one layout, and speculators') or ``gguf`` (an EAGLE-3 or
DFlash draft for llama.cpp: a GGUF file, alone or as ``DIR/draft.gguf``). The only place in
``formats`` that tells the families apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eagleforge.draft.config import DraftFamily
from eagleforge.draft.dflash import DFlashArchitecture
from eagleforge.draft.family import AnyArchitecture
from eagleforge.errors import CheckpointError, ConfigError
from eagleforge.files import unreadable_reason
from eagleforge.formats.dflash import (
    check_dflash,
    dflash_architecture_of,
    is_dflash,
    is_speculators,
    read_dflash,
    write_dflash,
)
from eagleforge.formats.eagle3 import (
    architecture_of,
    check_eagle3,
    load_checked_eagle3,
    read_eagle3,
    write_eagle3,
)
from eagleforge.formats.gguf import check_gguf, gguf_holds_dflash, holds_gguf, read_gguf, write_gguf
from eagleforge.formats.kinds import DraftFormat, Verifier

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


def _config(path: str | Path) -> dict[str, Any]:
    """A draft directory's config.json; CheckpointError naming it when unreadable."""
    config_path = Path(path) / "config.json"
    try:
        return json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_path}: unreadable ({unreadable_reason(e)})") from None


def _holds_dflash(path: str | Path) -> bool:
    """Whether a directory holds a DFlash draft; False when unreadable (the EAGLE-3 checks name
    what is wrong with it)."""
    try:
        return is_dflash(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def read_draft(
    path: str | Path,
) -> tuple[DraftFormat, AnyArchitecture, dict[str, torch.Tensor]]:
    """A draft directory of either family in any layout: its format, architecture and tensors
    (eagleforge names). A DFlash draft reads as vllm (the layout vLLM and SGLang load) or
    speculators."""
    if holds_gguf(path):
        return (DraftFormat.gguf, *read_gguf(path))
    config = _config(path)
    if is_dflash(config):
        fmt = DraftFormat.speculators if is_speculators(config) else DraftFormat.vllm
        return (fmt, *read_dflash(path))
    return read_eagle3(path)


def load_draft_dir(
    path: str | Path,
) -> tuple[AnyArchitecture, dict[str, torch.Tensor]]:
    """A draft directory's architecture and tensors (``read_draft`` without the format)."""
    _, arch, tensors = read_draft(path)
    return arch, tensors


def read_architecture(path: str | Path) -> AnyArchitecture:
    """The architecture of a draft directory (either family), from its config.json alone (a
    GGUF draft: from its metadata)."""
    if holds_gguf(path):
        return read_gguf(path)[0]
    config = _config(path)
    return dflash_architecture_of(config) if is_dflash(config) else architecture_of(config)


def write_draft(
    arch: AnyArchitecture,
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    fmt: DraftFormat,
    verifier: Verifier | None = None,
    speculative_tokens: int = 3,
    target_gguf: Path | None = None,
) -> Path:
    """Write a draft directory in ``fmt`` from tensors with eagleforge's names (the embedding,
    if given, is left out). A DFlash draft has one layout, which vLLM and SGLang both load,
    and proposes its whole block (``speculative_tokens`` is EAGLE-3's). A GGUF draft carries
    the tokenizer of ``target_gguf``, the target llama.cpp serves it beside."""
    if fmt == DraftFormat.gguf:
        if target_gguf is None:
            raise ConfigError(
                "export.format=gguf needs export.target_gguf: the target's GGUF file, which "
                "llama.cpp serves the draft beside"
            )
        return write_gguf(arch, tensors, out_dir, target_gguf)
    if isinstance(arch, DFlashArchitecture):
        return write_dflash(arch, tensors, out_dir, fmt, verifier)
    return write_eagle3(arch, tensors, out_dir, fmt, verifier, speculative_tokens)


def check_draft(path: str | Path, target_num_layers: int | None = None) -> list[str]:
    """Every problem that would make a draft directory of either family (from any tool) load
    wrongly or accept poorly; an empty list when there is none."""
    if holds_gguf(path):
        return check_gguf(path, target_num_layers)
    if _holds_dflash(path):
        return check_dflash(path, target_num_layers)
    return check_eagle3(path, target_num_layers)


def load_checked_draft(
    path: str | Path, target_num_layers: int
) -> tuple[AnyArchitecture, dict[str, torch.Tensor]]:
    """``load_draft_dir`` once ``check_draft`` finds no problem; ConfigError listing every
    problem."""
    if holds_gguf(path):
        problems = check_gguf(path, target_num_layers)
        if problems:
            raise ConfigError(f"{path}: not a usable GGUF draft: {'; '.join(problems)}.")
        return read_gguf(path)
    if not _holds_dflash(path):
        return load_checked_eagle3(path, target_num_layers)
    problems = check_dflash(path, target_num_layers)
    if problems:
        raise ConfigError(f"{path}: not a usable DFlash draft: {'; '.join(problems)}.")
    return read_dflash(path)


def family_problem(path: str | Path, family: DraftFamily) -> str | None:
    """What is wrong when a draft directory holds the other family's draft than ``family``
    (its tensors would not fit, name by name): which family it is and the ``draft=`` that
    takes it. None when it is of ``family``, or unreadable (``check_draft`` names that)."""
    try:
        if holds_gguf(path):
            found = DraftFamily.dflash if gguf_holds_dflash(path) else DraftFamily.eagle3
        else:
            found = family_in(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return None
    if found == family:
        return None
    return (
        f"{FAMILY_NAMES[found]} draft, this run trains draft={family.value}; use "
        f"draft={found.value}, or give {FAMILY_NAMES[family]} draft"
    )
