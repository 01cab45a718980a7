"""Progress of the long commands (train, prepare, evaluate, regenerate), shown one way by all.

On a terminal, a tqdm bar. Where the output goes to a file (a SLURM log, ``> run.log 2>&1``)
no bar is drawn -- a bar redrawn into a file is one line of hundreds of carriage returns --
and a plain log line says how far the work is every ``LINE_EVERY_S`` seconds instead; the
libraries' own bars (transformers' weight loading, datasets' cache writes, the Hub's
downloads) are off there too (``quiet_library_bars``, called by each command's ``main``).

    with Progress(len(rows), "regenerate", "conv") as bar:
        bar.update(len(chunk))
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from tqdm.auto import tqdm

log = logging.getLogger("eagleforge.progress")

# Seconds between two plain progress lines where no bar is drawn.
LINE_EVERY_S = 60.0

_LINE = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%) in {elapsed}, {rate_fmt}, {remaining} left{postfix}"
_LINE_NO_TOTAL = "{desc}: {n_fmt} {unit} in {elapsed}, {rate_fmt}{postfix}"


def on_terminal() -> bool:
    """Whether a bar reaches a person: tqdm draws on stderr, which must be a terminal."""
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def quiet_library_bars() -> None:
    """Off a terminal, the progress bars of transformers, the Hub and datasets are off: they
    redraw with carriage returns into whatever file the output goes to."""
    if on_terminal():
        return
    import datasets
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the Hub's bars too
    datasets.disable_progress_bars()


class Progress:
    """One task's progress (see the module docstring). ``shown=False`` hides it everywhere
    (``trainer.progress_bar=false``, ranks other than 0); ``lines=False`` draws the bar but
    writes no plain lines off a terminal, for a caller that logs lines of its own (train's
    metric lines)."""

    def __init__(
        self,
        total: float | None,
        desc: str,
        unit: str,
        *,
        initial: float = 0,
        unit_scale: bool = False,
        shown: bool = True,
        lines: bool = True,
    ) -> None:
        drawn = shown and on_terminal()
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit=unit,
            unit_scale=unit_scale,
            disable=not drawn,
            dynamic_ncols=True,
        )
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.n = self.initial = initial
        self.every_s = LINE_EVERY_S
        self._lines = shown and lines and not drawn
        self._postfix: dict[str, Any] = {}
        self._start = self._last_line = time.monotonic()

    def update(self, n: float = 1) -> None:
        self.n += n
        self.bar.update(n)
        now = time.monotonic()
        if self._lines and now - self._last_line >= self.every_s:
            self._last_line = now
            log.info("%s", self.line(now - self._start))

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self._postfix = values
        self.bar.set_postfix(refresh=refresh, **values)

    def line(self, elapsed_s: float) -> str:
        """The plain line: ``capture train: 656/1.98k tok (33%) in 00:12, 53.3tok/s, 00:24
        left, tok_s=3.1``."""
        postfix = ", ".join(f"{key}={value}" for key, value in self._postfix.items())
        text = tqdm.format_meter(
            self.n,
            self.total,
            elapsed_s,
            prefix=self.desc,
            unit=self.unit,
            unit_scale=self.unit_scale,
            initial=self.initial,
            postfix=postfix or None,
            bar_format=_LINE if self.total else _LINE_NO_TOTAL,
        )
        return " ".join(text.split())  # tqdm pads the rate for a bar's fixed width

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
