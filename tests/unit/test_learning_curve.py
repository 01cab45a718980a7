"""A training run's learning curve is a picture worth opening: eval τ_sim and every acc_i by
step, the real-τ points on the τ axis, the run in the title, τ from 1 and accuracy from 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagleforge.config import compose_config, to_typed
from eagleforge.speculative.report import learning_curve_figure, plot_learning_curve
from eagleforge.train import run_title

pytestmark = pytest.mark.unit

EVALS = {
    0: {"eval/tau_sim": 1.04, "eval/acc_0": 0.04, "eval/acc_1": 0.01, "eval/acc_2": 0.02},
    60: {"eval/tau_sim": 1.39, "eval/acc_0": 0.30, "eval/acc_1": 0.22, "eval/acc_2": 0.18},
    120: {"eval/tau_sim": 1.46, "eval/acc_0": 0.34, "eval/acc_1": 0.27, "eval/acc_2": 0.23},
}


def test_the_figure_shows_tau_and_every_position() -> None:
    import matplotlib.pyplot as plt

    fig = learning_curve_figure(EVALS, {60: 1.30, 120: 1.41}, "run: smollm2 on jsonl")
    try:
        top, bottom = fig.axes
        assert fig._suptitle.get_text() == "run: smollm2 on jsonl"
        tau_sim, real = top.get_lines()
        assert list(tau_sim.get_xdata()) == [0, 60, 120]
        assert list(real.get_ydata()) == [1.30, 1.41]
        assert top.get_ylim()[0] == 1.0 and top.get_ylim()[1] > 1.46
        assert [line.get_label() for line in bottom.get_lines()] == ["acc_0", "acc_1", "acc_2"]
        assert bottom.get_ylim()[0] == 0.0 and 0.34 < bottom.get_ylim()[1] <= 1.0
        assert bottom.get_ylabel() == "eval accuracy by TTT position"
    finally:
        plt.close(fig)


def test_a_dflash_runs_curve_names_block_slots_and_wraps_a_long_title() -> None:
    import matplotlib.pyplot as plt

    title = "run: smollm2 on jsonl (outputs/quality/magpie.jsonl), DFlash 2 layers, block 8, " * 2
    fig = learning_curve_figure(EVALS, {}, title, "block slot (acc_0: slot 1)")
    try:
        assert fig.axes[1].get_ylabel() == "eval accuracy by block slot (acc_0: slot 1)"
        lines = fig._suptitle.get_text().splitlines()
        assert len(lines) > 1 and all(len(line) <= 90 for line in lines)
    finally:
        plt.close(fig)


def test_a_run_without_real_tau_still_gets_its_curve(tmp_path: Path) -> None:
    path = plot_learning_curve(EVALS, {}, "run", tmp_path / "tau_by_step.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_title_names_the_run_and_its_data(tmp_path: Path) -> None:
    config = to_typed(
        compose_config(["+model=tiny", "data=chitchat", "loss=lk_lambda", f"output_dir={tmp_path}"])
    )
    title = run_title(config, tmp_path / "my-run")
    assert title.startswith("my-run: tiny on chitchat, TTT ") and "loss lk_lambda" in title
