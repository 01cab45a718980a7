"""A seeded tiny run's loss trace matches the one kept in tests/golden/ (catches numeric drift).

Regenerate after an intended numeric change with:
    EAGLEFORGE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/integration/test_golden_trace.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagleforge.config import compose_config
from eagleforge.train import run
from helpers.runs import tiny_run_overrides

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny_loss_trace.txt"


@pytest.mark.integration
def test_tiny_loss_trace_matches_golden(tmp_path: Path) -> None:
    overrides = tiny_run_overrides(
        tmp_path,
        "data.max_num_samples=60",
        "data.num_eval_samples=0",
        "data.max_length=64",
        "data.max_tokens_per_batch=128",
        "trainer.max_num_steps=8",
        "optimizer.lr=3e-3",
        "optimizer.warmup_ratio=0.25",
        "draft.ttt_length=3",
        "seed=7",
    )
    losses = run(compose_config(overrides)).train_losses
    if os.environ.get("EAGLEFORGE_UPDATE_GOLDEN"):
        GOLDEN.write_text("".join(f"{loss:.8f}\n" for loss in losses))
    expected = [float(line) for line in GOLDEN.read_text().split()]
    assert losses == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert losses[-1] < losses[0]
