"""A vision-language target offline: prepare captures the tiny Qwen2.5-VL's hidden states and
M-RoPE positions for conversations with images, and training from the store equals online
training (padded rows); packed store rows train too, each document with its own positions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.data.features import FeatureDataset
from eagleforge.draft.model import Eagle3Draft
from eagleforge.prepare import run as prepare
from eagleforge.train import run as train
from helpers.vlm import tiny_vl, tiny_vl_run_overrides, write_data

pytestmark = pytest.mark.integration


def _common(data: Path) -> list[str]:
    return tiny_vl(data, "data.num_eval_samples=1")


def _train(data: Path, tmp_path: Path, name: str, *extra: str):  # type: ignore[no-untyped-def]
    overrides = tiny_vl_run_overrides(data, tmp_path, "optimizer.lr=1e-3", *extra, name=name)
    return train(compose_config(overrides))


def test_vlm_store_trains_like_online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_data(tmp_path / "data")
    seen: list[torch.Tensor] = []  # positions the draft rotates by, in call order
    rope = Eagle3Draft.rope

    def spy(self: Eagle3Draft, positions: torch.Tensor, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        seen.append(positions.detach().clone())
        return rope(self, positions, dtype)

    monkeypatch.setattr(Eagle3Draft, "rope", spy)
    store = tmp_path / "features"
    prepare(to_typed(compose_config([
        *_common(data), f"prepare.output_dir={store}", "prepare.samples_per_shard=2",
        f"output_dir={tmp_path / 'prep'}",
    ])))  # fmt: skip
    manifest = json.loads((store / "train" / "manifest.json").read_text())
    assert manifest["mrope"] is True
    samples = FeatureDataset(store / "train", verify_checksums=True)
    positions = [samples[i][4] for i in range(len(samples))]
    assert all(p.shape == (3, len(samples[i][0])) for i, p in enumerate(positions))
    # an image gives its tokens (row, column) positions: the three rows differ somewhere
    assert any(not torch.equal(p[1], p[2]) for p in positions)

    online = _train(data, tmp_path, "online")
    online_positions, seen[:] = list(seen), []
    offline = _train(data, tmp_path, "offline", f"data.features={store}", "data.packing=false")
    torch.testing.assert_close(
        torch.tensor(offline.train_losses), torch.tensor(online.train_losses), rtol=1e-5, atol=1e-6
    )
    # the stored M-RoPE positions reach the draft as the online target's did
    assert len(seen) == len(online_positions) and online_positions[0].dim() == 3
    for got, want in zip(seen, online_positions, strict=True):
        assert torch.equal(got, want)
    seen.clear()
    packed = _train(data, tmp_path, "packed", f"data.features={store}")
    assert all(torch.isfinite(torch.tensor(packed.train_losses)))
    # packed rows: each document restarts its own 3-D positions within the row
    assert all(p.dim() == 3 for p in seen)
    assert any(int((p[0, 0] == 0).sum()) > 1 for p in seen)  # a row of several documents
