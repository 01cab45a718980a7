"""Training checkpoints: one directory per save, written under a temporary name, then renamed.

A checkpoint directory is also an SGLang draft directory (``config.json`` +
``model.safetensors``, see ``formats/``), plus ``training_state.pt`` (optimizer state keyed by
parameter name, scheduler, every rank's RNG states, step, epoch and data position; plain
tensors and containers only, loadable with ``torch.load(weights_only=True)``) and
``config.yaml``, the resolved run config, ``run.json``, the checkpoint format's version and
the run's identity (the target's weights, the training data) with the changes made on resume,
and ``checksums.json``, the sha256 of each of those files. The state is whole, not sharded: a
run resumes on any number of ranks. A checkpoint that lacks one of its files or whose files do
not match their checksums is damaged (a disk or copy error, a file deleted after the save):
``newest_checkpoint`` passes over it, with a warning, to the one before.

Every section and field of the config either may change on resume (``RESUMABLE``) or defines the
run (``DEFINES_RUN``; docs/training.md#resuming); ``resume_changes`` refuses a difference in one
that defines it, naming the fields, and ``check_identity`` refuses another target or other
data. Each refusal of a resume -- a changed run, another target or data, a damaged checkpoint
or one of a newer format -- is a ``ResumeRefused``, raised before anything of the run is
touched.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagleforge.atomic import atomic_directory, is_disk_full
from eagleforge.draft.family import AnyArchitecture, AnyDraft, TrainingModule
from eagleforge.errors import CheckpointError, CheckpointRefused, ResumeSettingRefused
from eagleforge.files import CHECKSUMS, checksum_problem, record_checksums, unreadable_reason
from eagleforge.formats.directory import load_draft_dir, write_draft
from eagleforge.formats.kinds import DraftFormat
from eagleforge.optim import continue_schedule
from eagleforge.parallel.dist import World
from eagleforge.parallel.fsdp import (
    full_draft_state,
    load_draft_state,
    load_optimizer_state,
    optimizer_state,
)

TRAINING_STATE = "training_state.pt"
RUN_RECORD = "run.json"
CHECKPOINT_FORMAT = "eagleforge-checkpoint"
# 1: run.json (format, version, identity, changes) beside the tensors; checkpoints without it
# were written before versioning (read as version 0: unverified identity).
CHECKPOINT_VERSION = 1
# Every checkpoint holds these (run.json and checksums.json since version 1).
CHECKPOINT_FILES = ("config.json", "model.safetensors", TRAINING_STATE, "config.yaml")

# Every section and field of the root config is named in one of the two lists below (a unit
# test keeps it so), each by its flattened key or the prefix of a section; the longest name
# that covers a key decides it, so a section that defines the run may name its resumable fields
# here. A key neither names is refused. The fields a resumed run may change take effect from
# the step it resumes at; paths may point elsewhere because what they point to is checked by
# content (``check_identity``).
RESUMABLE = (
    # the schedule: lr at step s is always lr x lr_multiplier(s, run length) (optim.py)
    "optimizer.lr",
    "optimizer.warmup_ratio",
    "optimizer.schedule",
    "optimizer.min_lr_ratio",
    "optimizer.max_grad_norm",
    "optimizer.muon.lr_ratio",  # the Muon group's peak lr
    # the run's length and cadences
    "trainer.max_num_steps",
    "trainer.num_epochs",
    "trainer.log_every_n_steps",
    "trainer.eval_every_n_steps",
    "trainer.eval_at_start",
    "trainer.save_every_n_steps",
    "trainer.keep_last_n",
    "trainer.eval_tau_every_n_steps",
    "trainer.eval_tau_prompts",
    "trainer.progress_bar",
    "trainer.compute_dtype",
    "trainer.resume",
    # where and how it runs and logs, not what it trains (the same math)
    "draft.attention",
    "draft.compile",
    "draft.recompute_mlp",
    "loss.kernel",
    "parallel",
    "target",
    "vllm",
    "tracker",
    "profile",
    "eval",
    "llamacpp",  # the llama.cpp judge, as vllm
    # paths, checked by content
    "model.path",
    "data.path",
    "data.eval_path",
    "data.features",
    "data.verify_features",
    "data.num_proc",
    "output_root",
    "output_dir",
    "cache_dir",
    # the other commands' sections: training never reads them
    "inspect",
    "prepare",
    "export",
    "regenerate",
    "serve_target",
)

# What defines the run: the target, the data, the draft, its loss, the optimizer's kind and
# state, the batch and the seed; a resume that changes any of these is refused.
DEFINES_RUN = ("model", "data", "draft", "loss", "optimizer", "trainer", "seed")

log = logging.getLogger(__name__)


def resumable(key: str) -> bool:
    """Whether the flattened config field ``key`` may change on resume: the longest name of
    ``RESUMABLE`` and ``DEFINES_RUN`` that covers it is resumable (none: it is not)."""
    covering = [name for name in (*RESUMABLE, *DEFINES_RUN) if covers(name, key)]
    return bool(covering) and max(covering, key=len) in RESUMABLE


def covers(name: str, key: str) -> bool:
    """Whether ``name`` (a flattened key, or a section's prefix) is ``key`` or a section
    holding it."""
    return key == name or key.startswith(name + ".")


def resume_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any], checkpoint: Path
) -> dict[str, tuple[Any, Any]]:
    """The fields (flattened config keys) in which ``current`` differs from the checkpoint's
    ``saved`` config, as {key: (saved, current)}; all of them resumable, else
    ResumeSettingRefused naming every one that is not. A field one of the two configs lacks
    (added or removed by another eagleforge version) is not compared."""
    differ = {
        key: (saved[key], value)
        for key, value in current.items()
        if key in saved and saved[key] != value
    }
    refused = [
        f"{key}: {old!r} -> {new!r}" for key, (old, new) in differ.items() if not resumable(key)
    ]
    if refused:
        raise ResumeSettingRefused(
            f"{checkpoint} was trained with other settings ({'; '.join(refused)}); a resumed run "
            "keeps what defines it (docs/training.md#resuming): put them back, or start a new "
            "run (another hydra.run.dir, or trainer.resume=never)."
        )
    return {key: change for key, change in differ.items() if resumable(key)}


class NewerCheckpoint(CheckpointRefused):
    """A checkpoint written by a newer eagleforge (its run.json's ``version``)."""

    def __init__(self, version: int, message: str) -> None:
        super().__init__(message)
        self.version = version


def read_run_record(checkpoint: str | Path) -> dict[str, Any]:
    """A checkpoint's ``run.json`` (empty for one written before versioning); CheckpointRefused
    for an unreadable one, and for one written by a newer, incompatible eagleforge."""
    path = Path(checkpoint) / RUN_RECORD
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointRefused(
            f"{path}: unreadable ({type(e).__name__}: {e}); delete the checkpoint to resume "
            "from the one before, or start a new run in another directory (another hydra.run.dir)."
        ) from None
    version = record.get("version") if isinstance(record, dict) else None
    if (
        not isinstance(record, dict)
        or record.get("format") != CHECKPOINT_FORMAT
        or not isinstance(version, int)
    ):
        raise CheckpointRefused(
            f"{path}: not an {CHECKPOINT_FORMAT} record; delete the checkpoint to resume from "
            "the one before, or start a new run in another directory (another hydra.run.dir)."
        )
    if version > CHECKPOINT_VERSION:
        raise NewerCheckpoint(
            version,
            f"{checkpoint}: written by a newer eagleforge (checkpoint format v{version}; this "
            f"one reads up to v{CHECKPOINT_VERSION}); resume it with that version, or start a "
            "new run in another directory (another hydra.run.dir): a new run in this one would "
            "write over it.",
        )
    return record


# What each identity field is, for the message that refuses another one.
IDENTITY_NAMES = {
    "target_weights": "the target's weights (model.*)",
    "data": "the training data (data.*: its rows, template, tokenizer or split)",
}


def check_identity(checkpoint: Path, identity: Mapping[str, str]) -> None:
    """ResumeSettingRefused unless the run's identity (``run_identity``: the target's weights, the
    training data) is the checkpoint's. One written before versioning has none: unverified."""
    saved = read_run_record(checkpoint).get("identity")
    if not isinstance(saved, dict):
        log.info(
            "%s records no run identity (older eagleforge): target and data unverified", checkpoint
        )
        return
    differ = [IDENTITY_NAMES.get(k, k) for k, v in identity.items() if k in saved and saved[k] != v]
    if differ:
        raise ResumeSettingRefused(
            f"{checkpoint} was trained on other inputs: {'; '.join(differ)} differ from this "
            "run's; resume with the target and data it was trained on, or start a new run "
            "(another hydra.run.dir, or trainer.resume=never)."
        )


def run_record(
    identity: Mapping[str, str],
    changes: list[dict[str, Any]],
    precision: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """The ``run.json`` of a checkpoint: format, version, the run's identity, the changes
    made on resume ({"step": s, "changes": {key: [old, new]}}, oldest first) and the
    precision each dtype setting resolved to on the machine that saved it ({setting: {asked,
    dtype, why}}, precision.py)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "identity": dict(identity),
        "changes": list(changes),
        "precision": {k: dict(v) for k, v in (precision or {}).items()},
    }


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with a checkpoint directory: a file missing, or not matching its
    checksum; None when nothing is."""
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        return f"no {', '.join(missing)}"
    return checksum_problem(path)


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
    record: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint at ``checkpoint_dir``; a crash mid-way leaves only a .tmp dir.
    ``history``: the run's evaluations so far (``read_history``), which a resumed run keeps;
    ``record``: its ``run.json`` (``run_record``).

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
        lambda: _write(final, module.draft.arch, tensors, state, config_yaml, record),
        CheckpointError(f"{final}: rank 0 could not write the checkpoint (see its log)."),
    )
    return final


def _write(
    final: Path,
    arch: AnyArchitecture,
    tensors: dict[str, torch.Tensor],
    state: dict[str, Any],
    config_yaml: str,
    record: dict[str, Any] | None,
) -> None:
    try:
        with atomic_directory(final, replace=True, durable=True) as tmp:
            write_draft(arch, tensors, tmp, DraftFormat.sglang)
            torch.save(state, tmp / TRAINING_STATE)
            (tmp / "config.yaml").write_text(config_yaml)
            record = record or run_record({}, [])
            (tmp / RUN_RECORD).write_text(json.dumps(record, indent=2) + "\n")
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
    """The directory ``trainer.resume=<resume>`` names; ResumeSettingRefused unless it is a
    training checkpoint (its files and checksums are checked where it is resumed from)."""
    path = Path(resume)
    if not path.is_dir():
        raise ResumeSettingRefused(
            f"trainer.resume={resume}: no such directory; give a checkpoints/step_* directory, "
            "auto or never."
        )
    if not (path / TRAINING_STATE).is_file() and not (path / "config.yaml").is_file():
        raise ResumeSettingRefused(
            f"trainer.resume={resume}: not a training checkpoint (no {TRAINING_STATE}); give a "
            "checkpoints/step_* directory, auto or never."
        )
    return path


STEP_DIR = re.compile(r"step_\d+")


def step_dirs(output_dir: str | Path) -> list[Path]:
    """A run's ``checkpoints/step_*`` directories, oldest first (not the hidden temporary ones
    of an interrupted save)."""
    root = Path(output_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if p.is_dir() and STEP_DIR.fullmatch(p.name))


def refuse_writing_over_newer(output_dir: str | Path) -> None:
    """CheckpointRefused where a run directory that a new run (trainer.resume=never) would
    write its checkpoints into holds one written by a newer eagleforge: this version cannot
    resume it, and must not replace or rotate it away."""
    for path in step_dirs(output_dir):
        try:
            read_run_record(path)
        except NewerCheckpoint as newer:
            raise CheckpointRefused(
                f"trainer.resume=never: {path} was written by a newer eagleforge "
                f"(checkpoint format v{newer.version}) and a new run here would write over it; "
                "start the new run in another directory (another hydra.run.dir)."
            ) from None
        except CheckpointRefused:
            continue  # damaged: not a newer one


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete and intact ``checkpoints/step_*`` of a run. The hidden temporary
    directories of an interrupted save are not checkpoints, and are ignored; a damaged one
    (``checkpoint_problem``: a file missing or not matching its checksum) is passed over with
    a warning -- the run saves that step anew when it gets there. Raises CheckpointRefused when
    every checkpoint is damaged, rather than starting the run over, and for one written by a
    newer eagleforge, rather than going back before it."""
    root = Path(output_dir) / "checkpoints"
    damaged = []
    for path in reversed(step_dirs(output_dir)):
        if (path / TRAINING_STATE).is_file() and not (path / CHECKSUMS).is_file():
            log.info("%s has no %s (older eagleforge): loaded unverified", path, CHECKSUMS)
        problem = checkpoint_problem(path)
        if problem is None:
            read_run_record(path)  # a newer format stops here
            return path
        log.warning(
            "%s is damaged (%s): passed over for the checkpoint before it; the run saves this "
            "step anew when it gets there (copy it away first to keep it)",
            path,
            problem,
        )
        damaged.append(f"{path.name}: {problem}")
    if damaged:
        raise CheckpointRefused(
            f"{root}: every checkpoint is damaged ({'; '.join(damaged)}); restore one from a "
            "copy, or delete them (or set trainer.resume=never) to start over."
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


def _read_state(path: Path, error: type[CheckpointError] = CheckpointError) -> dict[str, Any]:
    try:
        # memory-mapped: reading the progress alone does not load the optimizer state
        return torch.load(path / TRAINING_STATE, weights_only=True, map_location="cpu", mmap=True)
    except Exception as e:  # torch raises many types on bad files
        raise error(
            f"{path}: unreadable checkpoint ({TRAINING_STATE}: {unreadable_reason(e)}); delete "
            "it to resume from the one before, or start a new run in another directory (another "
            "hydra.run.dir)."
        ) from None


def read_history(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The evaluations a checkpoint's run had made (``save_checkpoint``'s ``history``); empty
    for checkpoints saved before it was kept."""
    return dict(_read_state(Path(checkpoint_dir)).get("history") or {})


def read_progress(checkpoint_dir: str | Path) -> dict[str, int]:
    """A checkpoint's progress (step, epoch, data position, data shards, run length). Read
    where a resume is decided, before anything of the run is touched: CheckpointRefused for an
    unreadable state."""
    state = _read_state(Path(checkpoint_dir), CheckpointRefused)
    return {k: int(v) for k, v in state["progress"].items()}


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
    ``train.resume_from``). The full state loads into any number of ranks. The schedule is
    this run's (``continue_schedule``): the lr of the next step is what its config gives at
    that step, whatever the saved run used."""
    path = Path(checkpoint_dir)
    state = _read_state(path)
    try:
        _, tensors = load_draft_dir(path)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises many types on bad files
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({unreadable_reason(e)}); delete it to resume from "
            "the one before, or start a new run in another directory (another hydra.run.dir)."
        ) from None
    check_draft_weights(module.draft, tensors, path)
    load_draft_state(module, tensors)
    peak_lrs = list(scheduler.base_lrs)  # this run's config: the saved ones may differ
    load_optimizer_state(module, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    continue_schedule(scheduler, peak_lrs)
    rngs = state["rng"]
    set_rng_state(rngs[world.rank] if world.rank < len(rngs) else rngs[0])
    return {k: int(v) for k, v in state["progress"].items()}
