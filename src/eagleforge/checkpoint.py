"""Training checkpoints: one directory per save, written under a temporary name, then renamed.

A checkpoint directory is also an SGLang draft directory (``config.json`` +
``model.safetensors``, see ``formats/``), plus ``training_state.pt`` (optimizer state keyed by
parameter name, scheduler, every rank's RNG states, step, epoch and data position; plain
tensors and containers only, loadable with ``torch.load(weights_only=True)``) and
``config.yaml``, the resolved run config, and ``checksums.json``, the sha256 of each of those
files. The state is whole, not sharded: a run resumes on any number of ranks. A checkpoint
whose files do not match their checksums is corrupt (a disk or copy error after the save):
``newest_checkpoint`` passes over it, with a warning, to the one before.
"""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagleforge.atomic import atomic_directory, is_disk_full
from eagleforge.draft.dflash import DFlashArchitecture
from eagleforge.draft.family import AnyDraft, TrainingModule
from eagleforge.draft.model import DraftArchitecture
from eagleforge.errors import CheckpointError, ConfigError
from eagleforge.files import CHECKSUMS, checksum_problem, record_checksums, unreadable_reason
from eagleforge.formats.read import load_sglang
from eagleforge.formats.write import write_sglang
from eagleforge.parallel.dist import World
from eagleforge.parallel.fsdp import (
    full_draft_state,
    load_draft_state,
    load_optimizer_state,
    optimizer_state,
)

TRAINING_STATE = "training_state.pt"

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(np.array(keys, dtype=np.uint32)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():  # this rank's device (another run may see fewer GPUs)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def every_rank_rng_state(world: World) -> list[dict[str, Any]]:
    """Each rank's ``rng_state()``, in rank order (a collective). The states travel as
    torch.save bytes: pickling tensors through all_gather_object breaks on CPU storages."""
    blob = io.BytesIO()
    torch.save(rng_state(), blob)
    return [
        torch.load(io.BytesIO(data), weights_only=True)
        for data in world.gather_objects(blob.getvalue())
    ]


def save_checkpoint(
    checkpoint_dir: str | Path,
    module: TrainingModule,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    progress: dict[str, int],
    config_yaml: str,
    world: World,
    history: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint at ``checkpoint_dir``; a crash mid-way leaves only a .tmp dir.
    ``history``: the run's evaluations so far (``read_history``), which a resumed run keeps.

    Every rank calls it (the sharded state is gathered); rank 0 writes. A write error stops
    every rank with the same CheckpointError.
    """
    final = Path(checkpoint_dir)
    tensors = full_draft_state(module)
    state = {
        "optimizer": optimizer_state(module, optimizer),
        "scheduler": scheduler.state_dict(),
        "rng": every_rank_rng_state(world),
        "progress": dict(progress),
        "history": dict(history or {}),
    }
    world.on_main(
        lambda: _write(final, module.draft.arch, tensors, state, config_yaml),
        CheckpointError(f"{final}: rank 0 could not write the checkpoint (see its log)."),
    )
    return final


def _write(
    final: Path,
    arch: DraftArchitecture | DFlashArchitecture,
    tensors: dict[str, torch.Tensor],
    state: dict[str, Any],
    config_yaml: str,
) -> None:
    try:
        with atomic_directory(final, replace=True, durable=True) as tmp:
            write_sglang(arch, tensors, tmp)
            torch.save(state, tmp / TRAINING_STATE)
            (tmp / "config.yaml").write_text(config_yaml)
            record_checksums(tmp)
    # disk full, quota, permissions -- safetensors and torch.save report them as their own
    # error types: keep what exists, say so
    except Exception as e:
        if is_disk_full(e):
            reason = "no space left on device"
        elif isinstance(e, OSError) and e.strerror:
            reason = e.strerror
        else:
            reason = f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"{final}: could not write the checkpoint ({reason}); the earlier "
            f"checkpoints in {final.parent} are intact. Free space (or fix the directory) and "
            "run the same command again to resume from the last of them."
        ) from None


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["name"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def explicit_checkpoint(resume: str) -> Path:
    """The directory ``trainer.resume=<resume>`` names; ConfigError unless it holds a training
    state (its checksums are checked where it is resumed from)."""
    path = Path(resume)
    if not (path / TRAINING_STATE).is_file():
        raise ConfigError(
            f"trainer.resume={resume}: not a training checkpoint (no {TRAINING_STATE}); give a "
            "checkpoints/step_* directory, auto or never."
        )
    return path


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete and intact ``checkpoints/step_*`` of a run. The hidden temporary
    directories of an interrupted save are not complete, and are ignored; a corrupt
    checkpoint (``checksum_problem``) is passed over with a warning. Raises CheckpointError
    when every checkpoint is corrupt, rather than starting the run over."""
    found = sorted((Path(output_dir) / "checkpoints").glob("step_*/" + TRAINING_STATE))
    corrupt = []
    for path in reversed([state.parent for state in found]):
        if not (path / CHECKSUMS).is_file():  # saved by an older eagleforge
            log.info("%s has no %s: loaded unverified", path, CHECKSUMS)
        problem = checksum_problem(path)
        if problem is None:
            return path
        log.warning("%s is corrupt (%s): passed over for the checkpoint before it", path, problem)
        corrupt.append(f"{path.name}: {problem}")
    if corrupt:
        raise CheckpointError(
            f"{Path(output_dir) / 'checkpoints'}: every checkpoint is corrupt "
            f"({'; '.join(corrupt)}); restore one from a copy, or delete them (or set "
            "trainer.resume=never) to start over."
        )
    return None


def check_draft_weights(draft: AnyDraft, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Raise CheckpointError unless ``tensors`` hold every trained tensor of the draft (all but
    the frozen embedding) in the draft's shapes."""
    own = draft.state_dict()
    wrong = [
        f"{k} {tuple(v.shape)} (draft: {tuple(own[k].shape)})"
        for k, v in tensors.items()
        if k in own and own[k].shape != v.shape
    ]
    missing = [k for k in own if k not in tensors and not k.startswith("embed_tokens")]
    unexpected = [k for k in tensors if k not in own]
    if wrong or missing or unexpected:
        raise CheckpointError(
            f"{path}: does not fit this draft (shapes {wrong}, missing {missing}, unexpected "
            f"{unexpected}); use the model and draft config it was trained with."
        )


def load_draft_weights(draft: AnyDraft, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Every trained tensor of a (one-process) draft, shapes checked."""
    check_draft_weights(draft, tensors, path)
    device = next(draft.parameters()).device
    draft.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=False)


def _read_state(path: Path) -> dict[str, Any]:
    try:
        # memory-mapped: reading the progress alone does not load the optimizer state
        return torch.load(path / TRAINING_STATE, weights_only=True, map_location="cpu", mmap=True)
    except Exception as e:  # torch raises many types on bad files
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({TRAINING_STATE}: {unreadable_reason(e)}); delete "
            "it to resume from the one before, or set trainer.resume=never."
        ) from None


def read_history(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The evaluations a checkpoint's run had made (``save_checkpoint``'s ``history``); empty
    for checkpoints saved before it was kept."""
    return dict(_read_state(Path(checkpoint_dir)).get("history") or {})


def read_progress(checkpoint_dir: str | Path) -> dict[str, int]:
    """A checkpoint's progress (step, epoch, data position, data shards, run length)."""
    return {k: int(v) for k, v in _read_state(Path(checkpoint_dir))["progress"].items()}


def load_checkpoint(
    checkpoint_dir: str | Path,
    module: TrainingModule,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    world: World,
) -> dict[str, int]:
    """Restore draft weights, optimizer, scheduler and RNG states on every rank; returns the
    progress (``Trainer.progress()``). Raises CheckpointError naming a bad checkpoint. The
    checksums were checked when the checkpoint was chosen (``newest_checkpoint``,
    ``train.resume_from``). The full state loads into any number of ranks."""
    path = Path(checkpoint_dir)
    state = _read_state(path)
    try:
        _, tensors = load_sglang(path)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises many types on bad files
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({unreadable_reason(e)}); delete it to resume from "
            "the one before, or set trainer.resume=never."
        ) from None
    check_draft_weights(module.draft, tensors, path)
    load_draft_state(module, tensors)
    load_optimizer_state(module, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rngs = state["rng"]
    set_rng_state(rngs[world.rank] if world.rank < len(rngs) else rngs[0])
    return {k: int(v) for k, v in state["progress"].items()}
