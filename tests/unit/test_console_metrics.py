"""What a run's metrics look like on the console and in its log file: one short line per log
interval on the console (step, loss, acc_0, τ_sim, tokens/s, lr, memory), every metric in
<run dir>/train.log, whichever tracker logs them."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagleforge.tracking import ConsoleTracker, MLflowTracker, console_line

pytestmark = pytest.mark.unit


def train_metrics(num_positions: int) -> dict[str, float]:
    """What the trainer logs every log interval, with ``num_positions`` per-position metrics
    (TTT positions of EAGLE-3, block slots of DFlash)."""
    metrics = {"train/loss": 2.3456}
    for name, value in (("loss", 0.5), ("acc", 0.25), ("alpha", 0.3), ("num_counted", 100.0)):
        metrics.update({f"train/{name}_{i}": value for i in range(num_positions)})
    metrics.update(
        {
            "train/tau_sim": 1.5123,
            "train/lr": 3e-3,
            "train/grad_norm": 1.25,
            "train/tokens_per_s": 1234.4,
            "train/peak_mem_mib": 1536.0,
            "train/epoch": 0.0,
        }
    )
    return metrics


SHORT = "step 5 train: loss 2.346  acc_0 0.250  τ_sim 1.512  tok/s 1,234  lr 3.00e-03  mem 1.50 GiB"


@pytest.mark.parametrize("num_positions", [4, 15], ids=["eagle3-ttt", "dflash-slots"])
def test_the_console_line_holds_the_numbers_a_person_watches(num_positions: int) -> None:
    assert console_line(train_metrics(num_positions), step=5) == SHORT


def test_eval_lines_are_short_too() -> None:
    during_training = {"eval/loss": 2.5, "eval/acc_0": 0.4, "eval/acc_1": 0.3,
                       "eval/alpha_0": 0.5, "eval/tau_sim": 1.61, "eval/num_counted_0": 9.0}  # fmt: skip
    assert console_line(during_training, 75) == "step 75 eval: loss 2.5  acc_0 0.400  τ_sim 1.610"
    evaluated = {"eval/gsm8k/tau": 1.209, "eval/gsm8k/tokens_per_s": 24.7,
                 "eval/gsm8k/accept_pos_1": 0.21, "eval/gsm8k/speedup": 1.031}  # fmt: skip
    assert console_line(evaluated, 150) == "step 150 eval/gsm8k: τ 1.209  speedup 1.03x  tok/s 24.7"
    # nothing a person watches (the data report, logged at step 0): no console line
    assert console_line({"data/rows": 200.0, "data/kept": 106.0}, 0) is None


@pytest.fixture
def console_and_file(tmp_path: Path) -> Iterator[tuple[io.StringIO, Path]]:
    """The root logger as Hydra sets it up: a console handler and <run dir>/train.log."""
    console, log_file = io.StringIO(), tmp_path / "train.log"
    handlers = [logging.StreamHandler(console), logging.FileHandler(log_file)]
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    for handler in handlers:
        root.addHandler(handler)
    try:
        yield console, log_file
    finally:
        root.setLevel(level)
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()


def test_the_console_gets_the_short_line_and_the_log_file_every_metric(
    tmp_path: Path, console_and_file: tuple[io.StringIO, Path]
) -> None:
    console, log_file = console_and_file
    metrics = train_metrics(4)
    mlflow = MLflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "lines", "run", tmp_path / "a")
    for tracker in (ConsoleTracker(), mlflow):
        tracker.log_metrics(metrics, step=5)
    mlflow.close()
    assert console.getvalue().splitlines() == [SHORT, SHORT]
    logged = [line for line in log_file.read_text().splitlines() if line.startswith("step 5")]
    full = "step 5 " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
    assert logged == [full, full]
    assert "train/alpha_3=0.3" in full and "train/grad_norm=1.25" in full


def test_the_console_line_does_not_land_inside_the_progress_bar(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A bar drawn on the console is cleared before the line and drawn again after it, as
    tqdm.write does: the line starts a console line of its own."""
    from tqdm.auto import tqdm

    handler = logging.StreamHandler(sys.stdout)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        with tqdm(total=10, desc="train", file=sys.stdout, mininterval=0) as bar:
            bar.update(5)
            ConsoleTracker().log_metrics(train_metrics(4), step=5)
            bar.update(1)
    finally:
        root.setLevel(level)
        root.removeHandler(handler)
    out = capsys.readouterr().out
    before, line, after = out.partition(SHORT + "\n")
    assert line, out
    assert before.endswith("\r"), repr(before[-80:])  # the bar was cleared back to column 0
    assert "5/10" in before and "6/10" in after
