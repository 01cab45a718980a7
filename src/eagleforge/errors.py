"""User-facing errors: one sentence naming the input (file and line, or config field) and what to do.

Entry points catch these and print them without a traceback; anything else is a bug.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class EagleForgeError(Exception):
    """Base class of errors caused by the user's input rather than by a bug."""


class ConfigError(EagleForgeError, ValueError):
    """A config value is invalid; the message names the field and the allowed values."""


class DataError(EagleForgeError, ValueError):
    """An input data file is unreadable or malformed; the message names the file and line."""


class CheckpointError(EagleForgeError, ValueError):
    """A checkpoint is unreadable or does not fit the run; the message names its directory."""


class InputsStopped(EagleForgeError):
    """What feeds the run stopped for good in the middle of it (every producer of the target's
    states given up): the trainer saves the steps it trained before it stops on this."""


class ResumeRefused(EagleForgeError, ValueError):
    """A resume refused before anything of the run is touched: the entry point leaves the run
    directory's ``.hydra/`` and its MLflow run as they were. Raised as one of the two kinds
    below, so that each still reads as the config or the checkpoint being at fault."""


class ResumeSettingRefused(ResumeRefused, ConfigError):
    """The run's config or inputs differ from the checkpoint's in what defines the run
    (``checkpoint.resume_changes``, ``check_identity``), or ``trainer.resume`` names no
    usable checkpoint."""


class CheckpointRefused(ResumeRefused, CheckpointError):
    """The checkpoint a run would resume from is damaged, unreadable, or of a newer format."""


class InterruptedAtTheEnd(KeyboardInterrupt):
    """Ctrl-C that arrived while a finished command wrote its run's end to MLflow (held until
    the write was whole, then handed on): the work is done and saved, and only the record says
    the run was stopped (KILLED), so the command must not say that its work was lost."""


class Stopped(SystemExit):
    """A stop signal (SIGTERM: SLURM's preemption, scancel, kill; SIGHUP: a closed terminal)
    ended a command that has no step to finish (``stop_on_signals`` raises it in the main
    thread). On its way out every ``with`` and ``finally`` runs -- engines stop, the
    MLflow run is ended as KILLED -- and, uncaught, it exits with 128 + the signal, as the
    signal itself would have."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def exit_on_user_error(main: Callable[P, R]) -> Callable[P, R]:
    """Entry-point decorator: a user error prints one line and exits with status 2; Ctrl-C
    prints one line and exits with 130 (every writer leaves whole files, and resumes)."""

    @functools.wraps(main)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return main(*args, **kwargs)
        except EagleForgeError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted (Ctrl-C): run the same command again to go on", file=sys.stderr)
            sys.exit(130)

    return wrapper


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While active, SIGTERM and SIGHUP (a ``kill``, a closed terminal) raise ``Stopped`` (a
    SystemExit with status 128 + the signal) in the main thread instead of ending the process
    at once, so every ``with`` and ``finally`` runs: engines stop, files are left whole.
    Handlers someone else installed are left alone."""
    previous: dict[signal.Signals, Any] = {}

    def _exit(signum: int, _frame: object) -> None:
        raise Stopped(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                previous[sig] = signal.signal(sig, _exit)
        except ValueError:  # not the main thread
            break
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stopped_in_one_line(line: Callable[[str], str]) -> Iterator[None]:
    """A command's stop, the same for every command with no step to finish (prepare,
    evaluate, regenerate): SIGTERM and SIGHUP (``stop_on_signals``) and Ctrl-C end the block
    with one line on stderr, ``line(how)`` -- ``how`` is "stopped by SIGTERM" or "interrupted
    (Ctrl-C)"; the line says what stopped, what is safe on disk and what to run to go on --
    and exit status 128 + the signal (143, 130), as the signal itself would have given."""
    try:
        with stop_on_signals():
            yield
    except Stopped as stop:
        print(_stop_text(line, f"stopped by {stop.signal_name}"), file=sys.stderr, flush=True)
        raise
    except KeyboardInterrupt:
        print(_stop_text(line, "interrupted (Ctrl-C)"), file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)


def _stop_text(line: Callable[[str], str], how: str) -> str:
    try:
        return line(how)
    except Exception:  # reading what is on disk failed: the stop still gets its line
        return f"{how}: run the same command again to go on."
