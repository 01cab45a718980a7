"""The tiny random Qwen2.5-VL of the VLM tests of every tier: a data file of conversations with
generated images (``write_data``) and the overrides that train on it (``tiny_vl``,
``tiny_vl_run_overrides``)."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from helpers.runs import with_extras


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
    image tokens each)."""
    return ["+model=tiny_vl", "data=vlm", f"data.path={data}", "data.min_pixels=3136",
            "data.max_pixels=12544", *extra]  # fmt: skip


def tiny_vl_run_overrides(data: Path, tmp_path: Path, *extra: str, name: str = "run") -> list[str]:
    """A tiny VLM training run on ``data`` into ``tmp_path/name``; extras replace defaults of
    the same key (see ``helpers.runs.with_extras``)."""
    base = tiny_vl(
        data, "data.num_eval_samples=1", "trainer.batch_size=2", "trainer.max_num_steps=2",
        "trainer.progress_bar=false", "draft.ttt_length=2", "tracker=console",
        f"output_root={tmp_path}", f"output_dir={tmp_path / name}",
    )  # fmt: skip
    return with_extras(base, *extra)
