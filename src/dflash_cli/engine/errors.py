"""Typed engine errors. The UI maps each to a one-line message, a hint and an exit code."""

from __future__ import annotations

from collections.abc import Callable


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


class SettingError(InvalidSettingError):
    """A bad --device, --device-map or --max-memory value, or a bad combination of them.

    The message is a template in which {device}, {device_map} and {max_memory} stand for the settings at fault,
    the first of `settings` being the one to fix. Raised, it reads with the flags' names (`flag_message`
    instead, where given: the words a flag has always had). The command line, which alone knows where each
    value came from, renders it naming the flag, the DFLASH_* variable or the config file's line
    (ui/common.py, setting_message).
    """

    def __init__(self, template: str, hint: str | None = None, *, settings: tuple[str, ...],
                 flag_message: str | None = None):
        self.template, self.settings = template, settings
        super().__init__(flag_message or self.render(lambda key, _first: "--" + key.replace("_", "-")), hint)

    def render(self, label: Callable[[str, bool], str]) -> str:
        """The message with each setting named by `label(key, is_the_one_to_fix)`."""
        out = self.template
        for key in self.settings:
            out = out.replace("{" + key + "}", label(key, key == self.settings[0]), 1)  # not in the values quoted
        return out


class CacheTakenError(DFlashError):
    """A reply was still decoding when another conversation used the same loaded model's caches."""


class RollbackError(RuntimeError):
    """A cache was asked for a state it cannot return to: a bug in the caller, not a user error."""
