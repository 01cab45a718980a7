"""What a draft family is to the rest of eagleforge: the ``Family`` protocol, the inputs a
family builds its draft from, and the steps every family shares (checking which settings it
reads, starting from another draft's weights).

A family owns its draft module, training module and batch (``draft/``), its decoder
(``speculative/``) and its layouts on disk (``formats/``, whose registry, keyed by the family,
recognises and writes them); the builder, the entry points and the judge reach them only
through ``eagleforge.families.family_for`` / ``family_of``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from eagleforge.checkpoint import load_draft_weights
from eagleforge.data.vocab import VocabMap
from eagleforge.draft.config import DraftConfig, DraftFamily, config_text
from eagleforge.draft.family import AnyBatch, AnyDraft, TrainingModule
from eagleforge.draft.loss import LossConfig
from eagleforge.errors import ConfigError
from eagleforge.formats.config import DraftFormat
from eagleforge.formats.directory import check_draft, family_problem, load_draft_dir
from eagleforge.parallel.usp import SequenceParallel
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import SpeculativeDecoder
from eagleforge.targets.base import TargetBackend
from eagleforge.targets.hf import HFTarget

log = logging.getLogger(__name__)

MakeBatch = Callable[[dict[str, torch.Tensor], bool], AnyBatch]  # (collated batch, train)


@dataclass
class DraftInputs:
    """What a draft is built from: the target (its config, taps, embedding, lm_head), the run's
    tokenizer and settings, and the data's vocabulary map (computed only when asked for)."""

    target: TargetBackend
    target_name: str  # target.backend, for messages
    tokenizer: Any
    vocab_map: Callable[[int, int], VocabMap]  # (target vocab, draft vocab) -> map, cached
    mask_token_id: int | None  # model.mask_token_id: an unused row of the target's embedding
    max_length: int  # data.max_length
    seed: int
    device: torch.device
    draft_init: Path | None  # model.draft_init: start from this draft's weights


class Family(Protocol):
    """One draft family, everything the rest of eagleforge asks of it."""

    name: DraftFamily
    title: str  # "EAGLE-3": in run titles and messages
    # llama-server's --spec-type for this family's GGUF drafts; None: llama.cpp serves none
    llamacpp_type: str | None
    # what position i of the per-position metrics (loss_i, acc_i) is
    positions: str
    # the ``draft.*`` settings it reads (a section by its prefix, ``draft.dflash``), and
    # whether it reads the ``loss`` section
    reads: tuple[str, ...]
    reads_loss: bool
    docs: str  # the docs page of its settings
    # the fields of its section a model file may fit to its target
    # (``model.draft_defaults.<section>.<field>``, interpolated by conf/draft/<family>.yaml)
    model_defaults: tuple[str, ...]

    def describe(self, draft: DraftConfig, loss: LossConfig) -> str:
        """The draft in a run title: its shape and loss."""
        ...

    def build(self, cfg: DraftConfig, inputs: DraftInputs) -> AnyDraft:
        """A new draft for the target, initialised (from ``inputs.draft_init`` when given),
        on ``inputs.device``."""
        ...

    def load(
        self,
        arch: Any,
        tensors: dict[str, torch.Tensor],
        target: HFTarget,
        path: Path,
        device: torch.device,
    ) -> AnyDraft:
        """A trained draft read from ``path``, with what it takes of the target, on
        ``device``, in eval mode."""
        ...

    def training_module(
        self,
        draft: AnyDraft,
        cfg: DraftConfig,
        loss: LossConfig,
        device: torch.device,
        sp: SequenceParallel,
    ) -> TrainingModule:
        """The draft with its training pass (not yet sharded)."""
        ...

    def batches(
        self,
        draft: AnyDraft,
        cfg: DraftConfig,
        target: TargetBackend,
        sp: SequenceParallel,
        seed: int,
        teacher_chunk_size: int | None,
    ) -> MakeBatch:
        """What turns a collated batch into the training module's batch."""
        ...

    def loss_weights(self, cfg: DraftConfig, device: torch.device) -> torch.Tensor:
        """The loss weight of each position."""
        ...

    def decoder(
        self, target: HFTarget, draft: AnyDraft, settings: DecodeSettings, eos_ids: set[int]
    ) -> SpeculativeDecoder:
        """Our speculative decoder with this draft."""
        ...

    def proposals(self, arch: Any, num_draft_tokens: int) -> int:
        """The tokens one round drafts for a chain of ``num_draft_tokens`` (what an engine
        is asked for: a block draft proposes at most its block less one)."""
        ...

    def vllm_method(self, arch: Any, num_draft_tokens: int) -> dict[str, Any]:
        """vLLM's speculative config for a chain of ``num_draft_tokens`` (no ``model``)."""
        ...

    def serve_hint(self, out: Path, fmt: DraftFormat, arch: Any) -> str:
        """The command that serves the exported draft at ``out``."""
        ...


def not_applying(family: Family, draft: DraftConfig, loss: LossConfig) -> list[str]:
    """The settings set away from their defaults that ``family`` never reads, as typed."""
    ignored = [
        f"{key}={value}"
        for key, value in draft.changed_fields().items()
        if not any(key == r or key.startswith(r + ".") for r in family.reads)
    ]
    if not family.reads_loss:
        default = LossConfig()
        ignored += [
            f"loss.{f.name}={config_text(getattr(loss, f.name))}"
            for f in dataclasses.fields(LossConfig)
            if getattr(loss, f.name) != getattr(default, f.name)
        ]
    return ignored


def init_from(draft: AnyDraft, family: DraftFamily, path: Path, target_num_layers: int) -> None:
    """Fine-tune: the draft's weights (and vocab map) from a checkpoint or a draft exported in
    any format (by any tool), checked first."""
    mismatch = family_problem(path, family)
    if mismatch is not None:
        raise ConfigError(f"model.draft_init={path}: {mismatch}.")
    problems = check_draft(path, target_num_layers)
    if problems:
        raise ConfigError(
            f"model.draft_init={path}: not a usable draft directory: {'; '.join(problems)}; "
            "give a checkpoints/step_* directory or a draft exported for this target."
        )
    _, tensors = load_draft_dir(path)
    load_draft_weights(draft, tensors, path)
    log.info("draft initialised from %s", path)


def num_target_layers(target_config: Any) -> int:
    text = (
        target_config.get_text_config()
        if hasattr(target_config, "get_text_config")
        else target_config
    )
    return int(text.num_hidden_layers)
