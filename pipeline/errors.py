"""Named, one-line errors for user mistakes: every error class of the project lives here.

Every error a user can cause (bad file, bad config value, a stop request) is a `PipelineError`; the
stage runner prints its message on one line and exits with its `exit_code` instead of showing a
traceback, and records the run's `status` (`failed`, or `killed` for a stop request) in its tracker.
"""

from __future__ import annotations


class PipelineError(Exception):
    """A user-facing error: the message names the file or key, expected vs found, and the fix."""

    exit_code: int = 2
    status: str = "failed"  # how the stage's run ends: failed | killed


class ConfigError(PipelineError):
    """A config value is of the wrong type or out of range."""


class UnknownKeyError(ConfigError):
    """A key the schema does not have (a typo, or `-S +key=...`)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


class GGUFError(PipelineError):
    """A GGUF file is missing, malformed, or not what the stage expects."""


class DataError(PipelineError):
    """A corpus or packed-data file is missing or malformed."""


class ChatTemplateError(PipelineError):
    """A chat template is missing, malformed, refused by the sandbox, or raised an error itself."""


class AdapterError(PipelineError):
    """An adapter does not fit the model it is applied to (names, shapes, rank)."""


class CheckpointError(PipelineError):
    """A checkpoint is missing, corrupt, or from a different configuration."""


class NonFiniteError(PipelineError):
    """A step produced a NaN/inf loss or gradient; the run stops before applying it."""


class TrainingInterrupted(PipelineError):
    """SIGINT/SIGTERM: the step finished, a checkpoint was written, the run stops (exit 128 + signal)."""

    status = "killed"

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def one_line(e: object, width: int = 200) -> str:
    """A library's message (often multi-line) squeezed into our one line, for `problem`'s found part."""
    return " ".join(str(e).split())[:width]


def problem(where: str, expected: str, found: str, fix: str) -> str:
    """Format the standard one-line message: where, expected, found, fix."""
    return f"{where}: expected {expected}, found {found}; fix: {fix}"
