"""User-facing errors: one sentence naming the input (file and line, or config field) and what to do.

Entry points catch these and print them without a traceback; anything else is a bug.
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

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


class ResumeRefused(ConfigError):
    """A resume that would change what defines the run (``checkpoint.resume_changes``,
    ``check_identity``): refused before anything of the run is touched."""


class Stopped(SystemExit):
    """A stop signal (SIGTERM: SLURM's preemption, scancel, kill; SIGHUP: a closed terminal)
    ended a command that has no step to finish (``engine.server.stop_on_signals`` raises it in
    the main thread). On its way out every ``with`` and ``finally`` runs -- engines stop, the
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
