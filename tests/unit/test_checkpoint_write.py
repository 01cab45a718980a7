"""A checkpoint write that fails in any library (not only with an OSError) stops with one
CheckpointError and leaves the earlier checkpoints and no torn directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import eagleforge.checkpoint as checkpoint_module
from eagleforge.checkpoint import save_checkpoint
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.ttt import TTTModule
from eagleforge.errors import CheckpointError
from eagleforge.parallel import ParallelDims
from eagleforge.parallel.dist import World
from helpers.drafts import tiny_draft

pytestmark = pytest.mark.unit


def test_a_library_error_mid_write_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = TTTModule(tiny_draft(), 2, AttentionBackend.eager)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    world = World(torch.device("cpu"), ParallelDims())
    args = (module, optimizer, scheduler, {"step": 1}, "a: 1\n", world)
    first = save_checkpoint(tmp_path / "step_00000001", *args)

    def file_too_large(*_: object, **__: object) -> None:
        raise RuntimeError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(checkpoint_module, "write_draft", file_too_large)
    with pytest.raises(CheckpointError, match=r"step_00000002: could not write .*File too large"):
        save_checkpoint(tmp_path / "step_00000002", *args)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
