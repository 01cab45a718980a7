"""Paths as users type them: an override Hydra cannot lex ends in one line showing the
quoting that works, and every command eagleforge prints can be pasted back into a shell."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from eagleforge.config import check_cli_overrides
from eagleforge.draft.config import DraftFamily
from eagleforge.families import FAMILIES
from eagleforge.tracking import sync_hint

pytestmark = pytest.mark.unit

TYPED = "output_root=/data/runs/dir with spaces/ünï"  # what the shell hands over


def test_an_unreadable_override_shows_the_quoting_to_use(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        check_cli_overrides(["+model=tiny", "-m", TYPED, "data=chitchat"])
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: Hydra cannot read the override {shlex.quote(TYPED)}")
    suggested = line.rsplit(": ", 1)[1]
    (as_the_shell_passes_it,) = shlex.split(suggested)
    (override,) = OverridesParser.create().parse_overrides([as_the_shell_passes_it])
    assert override.value() == "/data/runs/dir with spaces/ünï"


def test_readable_overrides_and_flags_pass() -> None:
    check_cli_overrides(
        ["+model=tiny", "-m", "optimizer.lr=1e-4,3e-4", "eval.sweep=[1/1/2, 3/1/4]",
         'output_root="/data/runs/dir with spaces/ünï"', "--cfg", "job"]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("prepare.compress=fp9", "prepare.compress=fp9: expected one of none, fp8."),
        ("trainer.compute_dtype=auto,bf16", "trainer.compute_dtype=bf16: expected one of auto, "
                                            "float32, bfloat16."),
        ("+model.dtype=half", "model.dtype=half: expected one of auto, float32, bfloat16, "
                              "float16."),
    ],
)  # fmt: skip
def test_a_value_a_setting_does_not_take_is_one_line_naming_its_choices(
    capsys: pytest.CaptureFixture[str], override: str, said: str
) -> None:
    """Hydra prints six lines of its merge for these, exit 1; the setting and its choices
    instead, exit 2, as for every other bad value (each of a sweep's values too)."""
    with pytest.raises(SystemExit) as stopped:
        check_cli_overrides(["+model=tiny", "-m", override])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"error: {said}\n"
    check_cli_overrides(["prepare.compress=fp8", "trainer.compute_dtype=auto,bfloat16",
                         "draft.attention=sdpa", "model.dtype=float16"])  # fmt: skip


def test_printed_commands_paste_back_whole(tmp_path: Path) -> None:
    spool = tmp_path / "dir with spaces" / "ünï"
    assert shlex.split(sync_hint(spool))[-1] == str(spool)


def test_the_mlflow_ui_line_pastes_back_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from eagleforge.tracking import TrackerConfig, build_tracker
    from eagleforge.train import print_summary
    from eagleforge.trainer import TrainResult

    root = tmp_path / "dir with spaces" / "ünï"
    tracker = build_tracker(TrackerConfig(), root, "run", output_dir=root / "run")
    try:
        print_summary(TrainResult(step=1), tracker, FAMILIES[DraftFamily.eagle3])
    finally:
        tracker.close()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("browse the run: ")
    command = shlex.split(line.removeprefix("browse the run: "))
    assert command == ["mlflow", "ui", "--backend-store-uri", f"sqlite:///{root}/mlflow.db"]
