"""The same end-to-end run on CUDA: bf16 target, bf16 autocast draft with fp32 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from eagleforge.train import run
from helpers.runs import tiny_run_overrides

pytestmark = pytest.mark.gpu


def test_tiny_run_on_cuda(tmp_path: Path) -> None:
    overrides = tiny_run_overrides(tmp_path, "trainer.batch_size=2", "parallel.device=cuda")
    result = run(compose_config(overrides))
    assert result.step == 4
    assert all(torch.isfinite(torch.tensor(result.train_losses)))
    assert result.final_eval["eval/tau_sim"] >= 1.0
