"""Hydra overrides for the tiny training runs of every tier, and what those runs leave behind.

``tiny_run_overrides(tmp_path, *extra)`` is the tiny random Llama on a few chitchat
conversations, a few steps, console tracking, written under ``tmp_path``; an extra with the
key of a default replaces it (``trainer.max_num_steps=2``, ``+model=smollm2``), any other is
appended. ``train_on_rank`` runs one such config and returns what the tests compare.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagleforge.config import compose_config, to_typed
from eagleforge.prepare import run as prepare
from eagleforge.train import run

TINY_RUN = (
    "+model=tiny",
    "data=chitchat",
    "data.max_num_samples=80",
    "data.num_eval_samples=6",
    "data.max_length=96",
    "trainer.max_num_steps=4",
    "trainer.progress_bar=false",
    "tracker=console",
)

# The two-rank FSDP runs (dist tier on CPU; the gpu tier swaps the device).
FSDP_RUN = (
    "data.max_num_samples=40", "data.num_eval_samples=5", "data.max_length=64",
    "data.max_tokens_per_batch=128", "optimizer.lr=1e-3", "draft.ttt_length=3",
    # Adam's eps well above float noise: a near-zero gradient's update stays near zero
    "optimizer.eps=1e-4", "parallel.device=cpu",
)  # fmt: skip

# Padded batches in a run whose base packs rows: the packed row's budget taken out with the
# packing (a padded run refuses data.max_tokens_per_batch, which it would not read).
PADDED = ("data.packing=false", "~data.max_tokens_per_batch")

# The data of the sequence-parallel runs, captured once into a feature store.
SP_DATA = ("+model=tiny", "data=chitchat", "data.max_num_samples=30", "data.num_eval_samples=4",
           "data.max_length=96")  # fmt: skip


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def with_extras(base: tuple[str, ...] | list[str], *extra: str) -> list[str]:
    """``base`` with each extra in place of the override of the same key, or appended; an
    extra ``~key`` (Hydra's deletion) takes that key's override out of ``base``."""
    merged = list(base)
    for override in extra:
        key = _key(override)
        at = next((i for i, given in enumerate(merged) if _key(given) == key), None)
        if override.startswith("~") and "=" not in override:
            if at is not None:
                del merged[at]
        elif at is not None:
            merged[at] = override
        else:
            merged.append(override)
    return merged


def tiny_run_overrides(tmp_path: Path, *extra: str, name: str | None = "run") -> list[str]:
    """A tiny run writing under ``tmp_path`` into ``tmp_path/name`` (with ``name=None``, into
    the Hydra run directory under ``tmp_path``)."""
    paths = [f"output_root={tmp_path}"] + ([f"output_dir={tmp_path / name}"] if name else [])
    return with_extras([*TINY_RUN, *paths], *extra)


def train_on_rank(rank: int, overrides: list[str]) -> tuple[list[float], dict[str, float], str]:
    """Train with ``overrides`` (in one process, or as one of ``run_ranks``'s ranks)."""
    result = run(compose_config(overrides))
    return result.train_losses, result.final_eval, str(result.checkpoint)


def prepare_store(tmp_path: Path, *overrides: str) -> Path:
    """Capture the target's hidden states for the data of ``overrides`` into tmp_path/features."""
    store = tmp_path / "features"
    prepare(to_typed(compose_config([*overrides, f"prepare.output_dir={store}",
                                     f"output_dir={tmp_path / 'prep'}"])))  # fmt: skip
    return store


def weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(checkpoint) / "model.safetensors"))


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def start_from(checkpoint: Path, run_dir: Path) -> None:
    """Put a copy of ``checkpoint`` in ``run_dir``'s checkpoints, where ``trainer.resume=auto``
    continues from it: a run stopped after that checkpoint."""
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copytree(checkpoint, checkpoints / checkpoint.name)
