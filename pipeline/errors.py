"""Named, one-line errors for user mistakes.

Every error a user can cause (bad file, bad config value) is a `PipelineError`; the stage runner
prints its message on one line and exits non-zero instead of showing a traceback.
"""

from __future__ import annotations


class PipelineError(Exception):
    """A user-facing error: the message names the file or key, expected vs found, and the fix."""


class ConfigError(PipelineError):
    """A config value is of the wrong type or out of range."""


class GGUFError(PipelineError):
    """A GGUF file is missing, malformed, or not what the stage expects."""


class DataError(PipelineError):
    """A corpus or packed-data file is missing or malformed."""


def one_line(e: object, width: int = 200) -> str:
    """A library's message (often multi-line) squeezed into our one line, for `problem`'s found part."""
    return " ".join(str(e).split())[:width]


def problem(where: str, expected: str, found: str, fix: str) -> str:
    """Format the standard one-line message: where, expected, found, fix."""
    return f"{where}: expected {expected}, found {found}; fix: {fix}"
