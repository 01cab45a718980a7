"""A vision-language target on CUDA (the CPU/fp32 twin is tests/integration/test_vlm_train.py):
the tiny random Qwen2.5-VL in bf16, its vision tower fed the collated images, trains a draft
rotated by the target's M-RoPE positions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from eagleforge.train import run

pytest.importorskip("PIL", reason="needs Pillow for the test images")
from helpers.vlm import tiny_vl_run_overrides, write_data  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_tiny_qwen2_5_vl_trains_on_cuda(tmp_path: Path) -> None:
    data = write_data(tmp_path / "data")
    overrides = tiny_vl_run_overrides(
        data, tmp_path, "trainer.max_num_steps=3", "trainer.eval_every_n_steps=3",
        "parallel.device=cuda",
    )  # fmt: skip
    result = run(compose_config(overrides))
    assert result.step == 3 and all(torch.isfinite(torch.tensor(result.train_losses)))
    config = json.loads((result.checkpoint / "config.json").read_text())
    assert config["rope_scaling"]["mrope_section"] == [2, 3, 3]
