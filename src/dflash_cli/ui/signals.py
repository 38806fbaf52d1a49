"""SIGTERM and SIGHUP are handled like Ctrl-C: the same clean stop, then exit 128 + the signal number.

The handler raises `Terminated`, a KeyboardInterrupt, so every place that already stops cleanly on
Ctrl-C (a reply keeps its text and ends with a newline, the status line is cleared, prompt_toolkit
restores the terminal) does the same here; `exit_code` then gives 143 (SIGTERM) or 129 (SIGHUP)
instead of 130.
"""

from __future__ import annotations

import signal

EXIT_INTERRUPTED = 130
received: int | None = None


class Terminated(KeyboardInterrupt):
    """The process was asked to stop by SIGTERM or SIGHUP."""


def _handler(signum: int, frame) -> None:
    global received
    if received is not None:  # already stopping: a second signal must not interrupt the clean-up
        return
    received = signum
    raise Terminated(signum)


def install() -> None:
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, _handler)


def exit_code(code: int = EXIT_INTERRUPTED) -> int:
    """`code`, or 128 + the signal number once SIGTERM or SIGHUP arrived."""
    return 128 + received if received is not None else code
