"""What a draft layout is to ``formats.directory``'s dispatch: the ``DraftLayout`` protocol, and
``Found``, what a draft path shows of its kind before any layout reads it.

A layout lives beside the code that writes, reads and checks it (``eagle3``: EAGLE-3's and
P-EAGLE's directories; ``dflash``; ``gguf``: llama.cpp's file of either) and holds the drafts of
one family; ``directory.LAYOUTS`` is the one registry the dispatch iterates. A layout
recognises a draft by its own marks, never as the one left over: a directory no layout
recognises is refused, naming what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from eagleforge.draft.config import DraftFamily
from eagleforge.draft.family import AnyArchitecture
from eagleforge.errors import ConfigError
from eagleforge.formats.kinds import DraftFormat, Verifier


@dataclass(frozen=True)
class Found:
    """What a draft path shows of its kind: its directory's ``config.json``, or its GGUF file's
    ``general.architecture``; neither when it has none."""

    path: Path
    config: dict[str, Any] | None = None
    gguf: bool = False  # a GGUF file, or a directory with draft.gguf
    gguf_architecture: str | None = None

    def describe(self) -> str:
        """What was found, as a refusal names it."""
        if self.gguf:
            if self.gguf_architecture is None:
                return "a GGUF file without general.architecture"
            return f"a GGUF file of general.architecture {self.gguf_architecture!r}"
        if self.config is None:
            return "no config.json and no .gguf file"
        shown = ["architectures", "model_type"]
        if "speculators_model_type" in self.config:
            shown.append("speculators_model_type")
        return "config.json with " + ", ".join(f"{k} {self.config.get(k)!r}" for k in shown)


class DraftLayout(Protocol):
    """One way a draft of one family is laid out on disk, and everything the dispatch asks of
    it."""

    family: DraftFamily  # the family of every draft it holds
    title: str  # "EAGLE-3": in messages ("a usable EAGLE-3 draft")
    # what it recognises, for the refusal of a draft no layout reads
    signature: str
    served_by: str  # the engines that serve what it writes: "SGLang and vLLM"
    # the export formats it writes, each to the format it reads back as (DFlash's one
    # directory serves SGLang and vLLM alike: sglang reads back as vllm)
    writes: dict[DraftFormat, DraftFormat]

    def recognises(self, found: Found) -> bool:
        """Whether ``found`` is a draft of this layout, by this layout's own marks."""
        ...

    def owns(self, arch: object) -> bool:
        """Whether a draft of architecture ``arch`` is this layout's family's."""
        ...

    def read(self, found: Found) -> tuple[DraftFormat, AnyArchitecture, dict[str, torch.Tensor]]:
        """Its format, architecture and tensors (eagleforge's names); CheckpointError naming
        the file that does not read."""
        ...

    def architecture_of(self, found: Found) -> AnyArchitecture:
        """Its architecture, without its weights where the layout allows."""
        ...

    def check(self, found: Found, target_num_layers: int | None) -> list[str]:
        """Every problem that would make it load wrongly or accept poorly."""
        ...

    def load_checked(
        self, found: Found, target_num_layers: int
    ) -> tuple[AnyArchitecture, dict[str, torch.Tensor]]:
        """Its architecture and tensors once ``check`` finds no problem; ConfigError listing
        every problem."""
        ...

    def write(
        self,
        arch: Any,
        tensors: dict[str, torch.Tensor],
        out_dir: Path,
        fmt: DraftFormat,
        verifier: Verifier | None,
        speculative_tokens: int,
        target_gguf: Path | None,
    ) -> Path:
        """Write a draft of ``arch`` in ``fmt`` (one of ``writes``) from tensors with
        eagleforge's names."""
        ...


def article(title: str) -> str:
    """``title`` with its indefinite article: "an EAGLE-3", "a DFlash"."""
    return f"{'an' if title[:1] in 'AEIOU' else 'a'} {title}"


def unusable(path: Path, title: str, problems: list[str]) -> ConfigError:
    """The refusal of a draft whose check found ``problems``: each named, and what to do."""
    return ConfigError(
        f"{path}: not a usable {title} draft: {'; '.join(problems)}. Export it again with the "
        "tool that trained it, or train one with eagleforge for this target."
    )
