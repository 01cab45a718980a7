"""A vision-language target end to end: a tiny random Qwen2.5-VL (built offline) trains a
draft on conversations with generated images; the target's M-RoPE positions reach the draft
and the export carries the M-RoPE sections."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from eagleforge.config import compose_config
from eagleforge.draft.model import Eagle3Draft
from eagleforge.train import run

pytestmark = pytest.mark.integration


def write_data(directory: Path) -> Path:
    """Three images of different shapes and four short conversations (one without image)."""
    (directory / "img").mkdir(parents=True)
    for i, size in enumerate([(96, 48), (40, 80), (56, 56)]):
        Image.new("RGB", size, (60 * i, 120, 200)).save(directory / "img" / f"{i}.png")
    rows = [
        {
            "messages": [
                {"role": "user", "content": "What colour is this?", "images": ["img/0.png"]},
                {"role": "assistant", "content": "Mostly blue, a little green."},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "Compare these two pictures."},
                {"from": "gpt", "value": "The first is tall and the second is square."},
            ],
            "images": ["img/1.png", "img/2.png"],
        },
        {
            "messages": [
                {"role": "user", "content": "Say something nice."},
                {"role": "assistant", "content": "You are doing great work today."},
            ]
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "img/2.png"},
                        {"type": "text", "text": "Describe it."},
                    ],
                },
                {"role": "assistant", "content": "A small square picture."},
            ]
        },
    ]
    path = directory / "vlm.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tiny_vl(data: Path, *extra: str) -> list[str]:
    """Overrides for the tiny random Qwen2.5-VL on ``data``, with small images (4 to 16
    image tokens each); shared by the VLM tests of every tier."""
    return ["+model=tiny_vl", "data=vlm", f"data.path={data}", "data.min_pixels=3136",
            "data.max_pixels=12544", *extra]  # fmt: skip


def _train(data: Path, tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    return run(compose_config(tiny_vl(
        data, "data.num_eval_samples=1", "trainer.batch_size=2", "trainer.progress_bar=false",
        "draft.ttt_length=2", "tracker=console", f"output_root={tmp_path}",
        f"output_dir={tmp_path / 'run'}", *extra,
    )))  # fmt: skip


def test_tiny_qwen2_5_vl_trains_with_mrope_positions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_data(tmp_path / "data")
    seen: list[torch.Tensor] = []
    rope = Eagle3Draft.rope

    def spy(self: Eagle3Draft, positions: torch.Tensor, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        seen.append(positions.detach().clone())
        return rope(self, positions, dtype)

    monkeypatch.setattr(Eagle3Draft, "rope", spy)
    result = _train(
        data,
        tmp_path,
        "trainer.max_num_steps=3",
        "trainer.eval_every_n_steps=3",
        "optimizer.lr=1e-3",
    )
    assert result.step == 3 and all(torch.isfinite(torch.tensor(result.train_losses)))
    assert "eval/acc_0" in result.final_eval
    # The draft rotated by the target's 3-D positions: somewhere an image makes the
    # height and width components differ, which text positions never do.
    three_d = [p for p in seen if p.dim() == 3]
    assert three_d and all(p.shape[0] == 3 for p in three_d)
    assert any(not torch.equal(p[1], p[2]) for p in three_d)
    config = json.loads((result.checkpoint / "config.json").read_text())
    assert config["rope_scaling"]["mrope_section"] == [2, 3, 3]


def test_tiny_qwen2_5_vl_measures_real_tau_while_training(tmp_path: Path) -> None:
    """trainer.eval_tau_every_n_steps with a vision-language target: the probe decodes prompts
    with their images (the data file's user turns) at the target's M-RoPE positions."""
    data = write_data(tmp_path / "data")
    result = _train(
        data,
        tmp_path,
        "trainer.max_num_steps=2",
        "trainer.eval_tau_every_n_steps=2",
        "trainer.eval_tau_prompts=2",
        f"eval.prompts={data}",
        "eval.max_new_tokens=8",
    )
    assert set(result.tau_by_step) == {2} and result.tau_by_step[2] >= 1.0
