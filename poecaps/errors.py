"""Errors that poecaps raises on purpose, each with a message meant for the user.

Scripts print these as one line (`poecaps.cli.main_guard`) instead of a stack trace.
"""


class PoecapsError(Exception):
    """Base class of the errors poecaps raises with a user-facing message."""


class InputError(PoecapsError, ValueError):
    """An argument (array, file, name or hyperparameter) is not what poecaps expects."""


class CheckpointError(PoecapsError):
    """No usable checkpoint, or one written by a different configuration."""


class NonFiniteError(PoecapsError, FloatingPointError):
    """Training produced a NaN or infinity and the guard stopped the run."""
