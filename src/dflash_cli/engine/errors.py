"""Typed engine errors. The UI maps each to a one-line message, a hint and an exit code."""


class DFlashError(Exception):
    """Base class for every error the engine raises on purpose."""

    hint: str | None = None

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class CheckpointError(DFlashError):
    """A model folder is missing, incomplete, malformed, or holds weights in a refused format."""


class IncompatiblePairError(DFlashError):
    """A drafter does not fit the target it was paired with."""


class UnsupportedModelError(DFlashError):
    """The model loads, but the engine cannot run it (for example a cache that cannot be rolled back)."""


class InvalidSettingError(DFlashError):
    """A generation setting is out of range (block size, temperature, top-p, ...)."""


class CacheTakenError(DFlashError):
    """A reply was still decoding when another conversation used the same loaded model's caches."""


class RollbackError(RuntimeError):
    """A cache was asked for a state it cannot return to: a bug in the caller, not a user error."""
