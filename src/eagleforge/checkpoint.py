"""Training checkpoints: one directory per save, written under a temporary name, then renamed.

A checkpoint directory is also an SGLang draft directory (``config.json`` +
``model.safetensors``, see ``formats.py``), plus ``training_state.pt`` (optimizer, scheduler,
RNG states, step, epoch and data position; plain tensors and containers only, loadable with
``torch.load(weights_only=True)``) and ``config.yaml``, the resolved run config.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagleforge.draft.model import Eagle3Draft
from eagleforge.formats import export_sglang

TRAINING_STATE = "training_state.pt"


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
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(
    checkpoint_dir: str | Path,
    draft: Eagle3Draft,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    progress: dict[str, int],
    config_yaml: str,
) -> Path:
    """Write a complete checkpoint at ``checkpoint_dir``; a crash mid-way leaves only a .tmp dir."""
    final = Path(checkpoint_dir)
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    export_sglang(draft, tmp)
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "progress": dict(progress),
        },
        tmp / TRAINING_STATE,
    )
    (tmp / "config.yaml").write_text(config_yaml)
    for file in tmp.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():  # replacing (checkpoints/best): the old one stays whole until swapped
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    return final
