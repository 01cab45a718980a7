"""Every safetensors file eagleforge writes (checkpoints, exports, feature shards, the vocab
cache) gets the mode the umask gives any other file -- safetensors >= 0.8 alone makes them
0600, unreadable to the teammates who can read the rest of the directory."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eagleforge.checkpoint import save_checkpoint
from eagleforge.data.features import write_shard
from eagleforge.data.vocab import cached_vocab_map
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.ttt import TTTModule
from eagleforge.export import export
from eagleforge.formats.config import ExportConfig
from eagleforge.formats.kinds import DraftFormat
from eagleforge.parallel import ParallelDims
from eagleforge.parallel.dist import World
from helpers.drafts import tiny_arch, tiny_draft

pytestmark = pytest.mark.unit


@pytest.fixture(params=[0o022, 0o027])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def mode(path: Path) -> str:
    return oct(stat.S_IMODE(path.stat().st_mode))


def write_every_kind(tmp_path: Path) -> list[Path]:
    """One safetensors file of each kind eagleforge writes; returns their paths."""
    module = TTTModule(tiny_draft(), 2, AttentionBackend.eager)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    world = World(torch.device("cpu"), ParallelDims())
    checkpoint = save_checkpoint(
        tmp_path / "step_00000001", module, optimizer, scheduler, {"step": 1}, "a: 1\n", world
    )
    exported = export(
        ExportConfig(
            draft=str(checkpoint), format=DraftFormat.vllm, output_dir=str(tmp_path / "vllm")
        )
    )
    store = tmp_path / "features"
    store.mkdir()
    hidden = tiny_arch().target_hidden_size
    sample = (0, torch.arange(5), torch.ones(5), torch.randn(5, 3 * hidden), torch.randn(5, hidden))
    write_shard(store, 0, [sample], [])
    vocab_file = tmp_path / "vocab" / "50-20.safetensors"
    cached_vocab_map([([1, 2, 3], [1, 1, 1])], 50, 20, vocab_file)
    return [
        checkpoint / "model.safetensors",
        exported / "model.safetensors",
        store / "shard_00000.safetensors",
        vocab_file,
    ]


def test_safetensors_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    written = write_every_kind(tmp_path)
    expected = oct(0o666 & ~umask)
    modes = {str(path.relative_to(tmp_path)): mode(path) for path in written}
    assert modes == dict.fromkeys(modes, expected)
    # as every other file of a checkpoint
    assert mode(written[0].parent / "config.json") == expected


def test_converted_model_weights_follow_the_umask(tmp_path: Path, umask: int) -> None:
    """The model cache (save_pretrained writes safetensors 0600 too)."""
    from safetensors.torch import save_file

    from eagleforge.targets.source import _atomic_build

    def build(out: Path) -> None:
        (out / "config.json").write_text("{}")
        save_file({"w": torch.zeros(2)}, str(out / "model.safetensors"))

    final = _atomic_build(tmp_path / "models" / "m", build)
    assert mode(final / "model.safetensors") == oct(0o666 & ~umask)
