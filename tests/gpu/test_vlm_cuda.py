"""A vision-language target on CUDA (the CPU/fp32 twin is tests/integration/test_vlm_train.py):
the tiny random Qwen2.5-VL in bf16, its vision tower fed the collated images, trains a draft
rotated by the target's M-RoPE positions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from eagleforge.train import run

pytest.importorskip("PIL", reason="needs Pillow for the test images")
sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from test_vlm_train import tiny_vl, write_data  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_tiny_qwen2_5_vl_trains_on_cuda(tmp_path: Path) -> None:
    data = write_data(tmp_path / "data")
    overrides = [
        *tiny_vl(data), "data.num_eval_samples=1", "trainer.batch_size=2",
        "trainer.max_num_steps=3", "trainer.eval_every_n_steps=3", "trainer.progress_bar=false",
        "draft.ttt_length=2", "parallel.device=cuda", "tracker=console",
        f"output_root={tmp_path}", f"output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    result = run(compose_config(overrides))
    assert result.step == 3 and all(torch.isfinite(torch.tensor(result.train_losses)))
    config = json.loads((result.checkpoint / "config.json").read_text())
    assert config["rope_scaling"]["mrope_section"] == [2, 3, 3]
