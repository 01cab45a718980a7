"""User-facing errors: one sentence naming the input (file and line, or config field) and what to do.

Entry points catch these and print them without a traceback; anything else is a bug.
"""


class EagleForgeError(Exception):
    """Base class of errors caused by the user's input rather than by a bug."""


class ConfigError(EagleForgeError, ValueError):
    """A config value is invalid; the message names the field and the allowed values."""


class DataError(EagleForgeError, ValueError):
    """An input data file is unreadable or malformed; the message names the file and line."""
