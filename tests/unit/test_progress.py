"""Progress, one way for every command: a bar on a terminal; in a file (a SLURM log, output
redirected) no bar redraws -- plain log lines every LINE_EVERY_S seconds instead -- and the
libraries' own bars are off."""

from __future__ import annotations

import io
import logging
import os
import pty
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import patch

import pytest

from eagleforge import progress
from eagleforge.progress import Progress, quiet_library_bars

pytestmark = pytest.mark.unit


@contextmanager
def terminal() -> Iterator[None]:
    """stderr on a pseudo-terminal, as at a person's shell. Set inside the test itself:
    pytest's capture puts its own stderr back between a fixture and the test."""
    primary, secondary = pty.openpty()
    with open(secondary, "w") as stream, patch.object(sys, "stderr", stream):
        yield
    os.close(primary)


def test_in_a_file_no_bar_is_drawn_and_plain_lines_say_how_far(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    file = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", file)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    with (
        caplog.at_level(logging.INFO, "eagleforge.progress"),
        Progress(8, "capture train", "tok", initial=2) as bar,
    ):
        bar.set_postfix(tok_s="3.5", refresh=False)
        bar.update(2)
        bar.update(4)
    assert file.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "\r" not in "".join(lines)
    assert lines[0].startswith("capture train: 4/8 tok (50%) in 00:00, ")
    assert lines[1].startswith("capture train: 8/8 tok (100%) in 00:00, ")
    assert lines[1].endswith(", 00:00 left, tok_s=3.5")


def test_lines_come_once_per_interval_and_not_for_a_caller_with_its_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO, "eagleforge.progress"):
        with Progress(100, "regenerate", "conv") as slow:
            for _ in range(100):
                slow.update()  # well within LINE_EVERY_S of the start
        monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
        with (
            Progress(None, "train", "step", lines=False) as train,
            Progress(5, "hidden", "step", shown=False) as hidden,
        ):
            train.update()
            hidden.update()
    assert caplog.records == []


def test_on_a_terminal_the_bar_is_drawn_and_no_lines(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    with terminal(), caplog.at_level(logging.INFO, "eagleforge.progress"):
        with Progress(4, "evaluate step_00000004", "prompt") as bar:
            assert not bar.bar.disable
            bar.update(4)
        with Progress(4, "train", "step", shown=False) as hidden:  # trainer.progress_bar=false
            assert hidden.bar.disable
    assert caplog.records == []


def test_off_a_terminal_the_libraries_bars_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    from transformers.utils import logging as transformers_logging

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert transformers_logging.is_progress_bar_enabled()
    try:
        quiet_library_bars()
        assert not transformers_logging.is_progress_bar_enabled()
        assert not datasets.is_progress_bar_enabled()
    finally:  # this process's other tests keep theirs
        transformers_logging.enable_progress_bar()
        datasets.enable_progress_bars()


def test_on_a_terminal_the_libraries_keep_their_bars() -> None:
    from transformers.utils import logging as transformers_logging

    with terminal():
        quiet_library_bars()
    assert transformers_logging.is_progress_bar_enabled()
