"""A draft of any family: which layout holds it, and reading, writing and checking it through
that layout (``export --check``). ``LAYOUTS`` is the one registry: each layout recognises its
own drafts (``formats.layout``), so a new family adds its layout's line here and this module's
dispatch stays as it is. A path no layout recognises is refused in one line naming what it
holds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagleforge.draft.config import DraftFamily
from eagleforge.draft.family import AnyArchitecture
from eagleforge.errors import CheckpointError, ConfigError
from eagleforge.files import checksum_problem, unreadable_reason
from eagleforge.formats.dflash import DFLASH_LAYOUT
from eagleforge.formats.eagle3 import EAGLE3_LAYOUT, PEAGLE_LAYOUT
from eagleforge.formats.gguf import (
    DFLASH_GGUF_ARCHITECTURE,
    GGUFLayout,
    gguf_architecture,
    gguf_path,
    holds_gguf,
)
from eagleforge.formats.kinds import GGUF_ARCHITECTURE, DraftFormat, Verifier
from eagleforge.formats.layout import DraftLayout, Found, article

LAYOUTS: tuple[DraftLayout, ...] = (
    EAGLE3_LAYOUT,
    PEAGLE_LAYOUT,
    DFLASH_LAYOUT,
    GGUFLayout(GGUF_ARCHITECTURE, EAGLE3_LAYOUT),
    GGUFLayout(DFLASH_GGUF_ARCHITECTURE, DFLASH_LAYOUT),
)


def layouts_of(family: DraftFamily) -> tuple[DraftLayout, ...]:
    """The layouts a family's drafts are written in."""
    return tuple(layout for layout in LAYOUTS if layout.family == family)


def _found(path: Path) -> Found | str:
    """What ``path`` shows of its kind, or why nothing of it reads (to follow "PATH: ")."""
    if holds_gguf(path):
        file = gguf_path(path)
        try:
            return Found(path, gguf=True, gguf_architecture=gguf_architecture(file))
        except CheckpointError as e:
            reason = str(e).removeprefix(f"{file}: ")
            return reason if file == path else f"{file.name}: {reason}"
    if not path.is_dir():
        if path.exists():
            return (
                "not a directory (a draft is a directory with config.json and model.safetensors, "
                "or a .gguf file)"
            )
        return "no such directory"
    config_path = path / "config.json"
    if not config_path.is_file():
        return Found(path)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        return f"config.json is unreadable ({unreadable_reason(e)})"
    if not isinstance(config, dict):
        return f"config.json holds a {type(config).__name__}, not a JSON object"
    return Found(path, config=config)


def _identify(path: str | Path) -> tuple[DraftLayout, Found] | str:
    """The layout that recognises ``path`` and what it found there; else the one reason it is
    not a draft eagleforge reads (to follow "PATH: ")."""
    path = Path(path)
    found = _found(path)
    recognised = []
    if isinstance(found, Found):
        recognised = [layout for layout in LAYOUTS if layout.recognises(found)]
        if len(recognised) == 1:
            return recognised[0], found
    # a torn or missing file of a training checkpoint: its checksums say which, and what to do
    corrupt = checksum_problem(path) if path.is_dir() else None
    if corrupt is not None:
        return f"{corrupt}, so its files are corrupt (use an earlier checkpoint)"
    if isinstance(found, str):
        return found
    if recognised:  # each layout's own drafts are recognised by it alone: a test keeps it so
        both = " and as ".join(layout.signature for layout in recognised)
        return f"{found.describe()} reads as {both}; please report this"
    reads = ", ".join(layout.signature for layout in LAYOUTS)
    return f"not a draft eagleforge reads: {found.describe()}; eagleforge reads {reads}"


def read_draft(
    path: str | Path,
) -> tuple[DraftFormat, AnyArchitecture, dict[str, torch.Tensor]]:
    """A draft of any family in any layout: its format, architecture and tensors (eagleforge
    names). A DFlash draft reads as vllm (the layout vLLM and SGLang load) or speculators."""
    layout, found = _readable(path)
    try:
        return layout.read(found)
    except (KeyError, TypeError) as e:
        raise _config_error(path, layout, e) from None


def load_draft_dir(
    path: str | Path,
) -> tuple[AnyArchitecture, dict[str, torch.Tensor]]:
    """A draft directory's architecture and tensors (``read_draft`` without the format)."""
    _, arch, tensors = read_draft(path)
    return arch, tensors


def read_architecture(path: str | Path) -> AnyArchitecture:
    """The architecture of a draft of any family, from its config.json alone (a GGUF draft:
    from its file)."""
    layout, found = _readable(path)
    try:
        return layout.architecture_of(found)
    except (KeyError, TypeError) as e:
        raise _config_error(path, layout, e) from None


def _readable(path: str | Path) -> tuple[DraftLayout, Found]:
    """The layout that recognises ``path`` and what it found there; CheckpointError naming
    what keeps it from being read."""
    identified = _identify(path)
    if isinstance(identified, str):
        raise CheckpointError(f"{path}: {identified}")
    return identified


def _config_error(path: str | Path, layout: DraftLayout, error: Exception) -> CheckpointError:
    """A config.json that is recognised but lacks or mistypes a field the architecture needs
    (read before checked, as evaluate reads its draft's taps)."""
    missing = f"no {error}" if isinstance(error, KeyError) else unreadable_reason(error)
    return CheckpointError(
        f"{path}: config.json of {article(layout.title)} draft that does not read ({missing}); "
        f"python -m eagleforge.export --check {path} lists its problems"
    )


def layout_for(arch: AnyArchitecture, fmt: DraftFormat) -> DraftLayout:
    """The layout that writes a draft of ``arch`` in ``fmt``; ConfigError naming the formats
    and engines that take the draft where none does."""
    owners = [layout for layout in LAYOUTS if layout.owns(arch)]
    for layout in owners:
        if fmt in layout.writes:
            return layout
    if not owners:
        raise ConfigError(f"no draft layout holds a {type(arch).__name__}; please report this.")
    ways = " or ".join(
        " or ".join(f"format={f.value}" for f in layout.writes) + f" (served by {layout.served_by})"
        for layout in owners
    )
    raise ConfigError(
        f"export.format={fmt.value}: {fmt.engine} does not serve {owners[0].title} drafts; "
        f"export it as {ways}."
    )


def family_holding(arch: object) -> DraftFamily:
    """The family of a draft's architecture: that of the layouts that hold it."""
    families = {layout.family for layout in LAYOUTS if layout.owns(arch)}
    if len(families) != 1:
        raise ConfigError(
            f"{len(families)} draft families hold a {type(arch).__name__}; please report this."
        )
    return families.pop()


def write_draft(
    arch: AnyArchitecture,
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    fmt: DraftFormat,
    verifier: Verifier | None = None,
    speculative_tokens: int = 3,
    target_gguf: Path | None = None,
) -> Path:
    """Write a draft in ``fmt`` from tensors with eagleforge's names (the embedding, if given,
    is left out). A DFlash draft has one layout, which vLLM and SGLang both load, and proposes
    its whole block (``speculative_tokens`` is EAGLE-3's). A GGUF draft carries the tokenizer
    of ``target_gguf``, the target llama.cpp serves it beside."""
    layout = layout_for(arch, fmt)
    return layout.write(
        arch, tensors, Path(out_dir), fmt, verifier, speculative_tokens, target_gguf
    )


def check_draft(path: str | Path, target_num_layers: int | None = None) -> list[str]:
    """Every problem that would make a draft of any family (from any tool) load wrongly or
    accept poorly; an empty list when there is none."""
    identified = _identify(path)
    if isinstance(identified, str):
        return [f"{path}: {identified}"]
    layout, found = identified
    return layout.check(found, target_num_layers)


def load_checked_draft(
    path: str | Path, target_num_layers: int
) -> tuple[AnyArchitecture, dict[str, torch.Tensor]]:
    """``load_draft_dir`` once ``check_draft`` finds no problem; ConfigError listing every
    problem."""
    identified = _identify(path)
    if isinstance(identified, str):
        raise ConfigError(f"{path}: {identified}.")
    layout, found = identified
    return layout.load_checked(found, target_num_layers)


def family_problem(path: str | Path, family: DraftFamily) -> str | None:
    """What is wrong with taking ``path`` for a draft of ``family``: a draft of another family
    (its tensors would not fit, name by name), named with the ``draft=`` that takes it, or a
    path that holds no draft eagleforge reads. None when it is of ``family``."""
    identified = _identify(path)
    if isinstance(identified, str):
        return identified
    layout, _ = identified
    if layout.family == family:
        return None
    wanted = layouts_of(family)[0].title
    return (
        f"{article(layout.title)} draft, this run trains draft={family.value}; use "
        f"draft={layout.family.value}, or give {article(wanted)} draft"
    )
