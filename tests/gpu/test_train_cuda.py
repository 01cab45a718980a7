"""The same end-to-end run on CUDA: bf16 target, bf16 autocast draft with fp32 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from eagleforge.train import run

pytestmark = pytest.mark.gpu


def test_tiny_run_on_cuda(tmp_path: Path) -> None:
    overrides = [
        "+model=tiny", "data=chitchat", "data.max_num_samples=80", "data.num_eval_samples=6",
        "data.max_length=96", "trainer.batch_size=2", "trainer.max_num_steps=4",
        "trainer.progress_bar=false", "parallel.device=cuda", "tracker=console",
        f"output_root={tmp_path}", f"output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    result = run(compose_config(overrides))
    assert result.step == 4
    assert all(torch.isfinite(torch.tensor(result.train_losses)))
    assert result.final_eval["eval/tau_sim"] >= 1.0
