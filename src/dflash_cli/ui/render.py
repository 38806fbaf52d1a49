"""All terminal output: generated text on stdout; status, statistics, warnings and errors on stderr.

Streaming text goes out as plain writes (no rich Live: it would buffer stdout and hide long replies). The
live status line sits in a reserved bottom row when stdout and stderr share a terminal, or on its own
line of stderr when stdout is redirected. Nothing but generated text ever reaches stdout, and no escape
code reaches a stream that is not a terminal unless --color always.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from dflash_cli.ui.stats_text import NOT_REPORTED

if TYPE_CHECKING:
    from dflash_cli.engine.text import ThinkingMarkers

DRAFT_STYLE = "\x1b[36m"  # cyan: proposed by the drafter and accepted by the target
DIM, BOLD, RED, YELLOW, RESET = "\x1b[2m", "\x1b[1m", "\x1b[31m", "\x1b[33m", "\x1b[0m"


class OutputClosed(Exception):
    """stdout was closed by its reader (`| head`): stop generating quietly."""


def output_failed(error: OSError) -> Exception:
    """A failed write to stdout (a full disk, an I/O error) as a one-line error; stdout is pointed at
    /dev/null first, so the flush at exit does not fail a second time."""
    from dflash_cli.engine.errors import DFlashError

    silence_stdout()
    reason = (error.strerror or str(error)).lower()
    return DFlashError(f"cannot write the output: {reason}", hint="free some space or write it elsewhere"
                       if error.errno == errno.ENOSPC else None)


def silence_stdout() -> None:
    """Point stdout at /dev/null: after `| head` closed the pipe, or after a write failed."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def isatty(stream: Any) -> bool:
    """Whether `stream` is a terminal; False for streams without isatty and for closed ones."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def use_color(mode: str, stream: TextIO) -> bool:
    """--color auto|always|never. auto: a terminal, NO_COLOR unset, TERM not dumb (FORCE_COLOR ignored)."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    return isatty(stream) and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


def visible_controls(text: str) -> str:
    """`text` with each control character replaced by its Unicode control picture (ESC -> \u241b) or, for
    DEL and C1 controls, U+FFFD: what a terminal shows instead of obeying."""
    return _CONTROLS.sub(lambda m: chr(0x2400 + ord(m.group())) if m.group() < "\x20" else "\ufffd", text)


class Output:
    """The one place that writes to stdout and stderr."""

    def __init__(self, color: str = "auto", *, provenance: bool = True, stdout: TextIO | None = None,
                 stderr: TextIO | None = None):
        self.out = stdout or sys.stdout
        self.err = stderr or sys.stderr
        self.out_tty, self.err_tty = isatty(self.out), isatty(self.err)
        self.color_out = use_color(color, self.out)
        self.color_err = use_color(color, self.err)
        self.provenance = provenance and self.color_out
        self._last_char = "\n"
        self._column = 0  # terminal cells since the last newline of the streamed text
        self._status: StatusLine | None = None
        self.hide_thinking = False  # --hide-thinking: print only the answer of a reply
        self._thinking: Any = None  # the reply's ThinkingSplitter, between begin_reply and end_text

    # -- stdout: generated text only ------------------------------------------------------------
    def text(self, step: Any) -> None:
        """Writes one Step's text, coloured by provenance when enabled, and flushes. On a terminal, control
        characters in the text (escape sequences, BEL, carriage returns) are shown, not obeyed: model text,
        local or remote, must not recolour the terminal, move its cursor or set its clipboard."""
        if not step.text:
            return
        if self._thinking is not None:
            return self._thinking_text(step)
        shown = visible_controls if self.out_tty else str
        if self.provenance:
            chunks = [f"{DRAFT_STYLE}{shown(p)}{RESET}" if drafted and p else shown(p)
                      for p, drafted in zip(step.pieces, step.from_draft)]
            self._write_out("".join(chunks), step.text[-1])
        else:
            self._write_out(shown(step.text), step.text[-1])

    def end_text(self) -> None:
        """Ends the reply on a fresh line, so prompts and files never run into the text."""
        if self._thinking is not None:
            segments, self._thinking = self._thinking.flush(), None
            self._write_segments([(thinking, s, False) for thinking, s in segments])
        if self._last_char != "\n":
            self._write_out("\n", "\n")

    # -- replies with reasoning (<think> ... </think>, Gemma 4's channel) ------------------------------
    def begin_reply(self, in_thinking: bool | None, markers: ThinkingMarkers | None = None) -> None:
        """Before a reply's first Step: None for a model without reasoning sections (its text goes out as
        is), else whether the prompt opened one; `markers` (engine.text.ThinkingMarkers; default <think>
        tags) how the reasoning is marked. The reasoning is then dimmed on a colour terminal, plain
        elsewhere, and left out with hide_thinking."""
        from dflash_cli.engine.text import THINK_TAGS
        from dflash_cli.engine.thinking import ThinkingSplitter

        wanted = in_thinking is not None and (self.hide_thinking or self.color_out)
        self._thinking = ThinkingSplitter(bool(in_thinking), markers or THINK_TAGS) if wanted else None

    def _thinking_text(self, step: Any) -> None:
        segments = [(thinking, s, drafted) for piece, drafted in zip(step.pieces, step.from_draft)
                    for thinking, s in self._thinking.feed(piece)]
        self._write_segments(segments)

    def _write_segments(self, segments: list[tuple[bool, str, bool]]) -> None:
        """(is_thinking, text, drafted) segments: dimmed or dropped reasoning, provenance colours kept."""
        chunks = []
        for thinking, s, drafted in segments:
            if not s or (thinking and self.hide_thinking):
                continue
            s = visible_controls(s) if self.out_tty else s
            style = (DRAFT_STYLE if drafted and self.provenance else "") + (DIM if thinking and self.color_out else "")
            chunks.append((f"{style}{s}{RESET}" if style else s, s[-1]))
        if chunks:
            self._write_out("".join(c for c, _ in chunks), chunks[-1][1])

    def _write_out(self, s: str, last: str) -> None:
        # Bookkeeping first: a Ctrl-C landing inside the write must still end the reply with a newline.
        self._last_char = last
        self._track_column(s)
        self.write_out(s)
        if self._status is not None:
            self._status.refresh()

    def write_out(self, s: str) -> None:
        """Writes to stdout and flushes: a closed pipe raises OutputClosed, any other failure one error."""
        try:
            self.out.write(s)
            self.out.flush()
        except BrokenPipeError:
            raise OutputClosed from None
        except OSError as e:
            raise output_failed(e) from None

    def _track_column(self, s: str) -> None:
        from rich.cells import cell_len

        tail = s.rsplit("\n", 1)
        self._column = (0 if len(tail) == 2 else self._column) + cell_len(_strip_ansi(tail[-1]))

    def _at_pending_wrap(self) -> bool:
        """True when the text exactly filled the last line: the terminal has not wrapped yet, and saving
        and restoring the cursor (as the status redraw does) would cancel the wrap and lose a character."""
        width = terminal_size(self.out).columns
        return self._column > 0 and self._column % width == 0

    # -- stderr: everything else ------------------------------------------------------------------
    def _style(self, s: str, style: str) -> str:
        return f"{style}{s}{RESET}" if self.color_err and style else s

    def info(self, message: str, *, dim: bool = True) -> None:
        self._err_line(self._style(message, DIM if dim else ""))

    def warn(self, message: str) -> None:
        self._err_line(self._style("warning: ", YELLOW) + message)

    def error(self, message: str, hint: str | None = None) -> None:
        self._err_line(self._style("Error: ", RED + BOLD) + message)
        if hint:
            self._err_line(self._style("Hint: ", BOLD) + hint)

    def _err_line(self, line: str) -> None:
        # a message must not fail: a stdout that cannot be flushed is reported by the next write_out
        def clear_status() -> None:
            if self._status is not None:
                self._status.clear()

        for flush in (clear_status, self.out.flush):
            try:
                flush()
            except (OSError, ValueError):
                pass
        try:
            self.err.write(line + "\n")
            self.err.flush()
        except (OSError, ValueError):
            pass

    def legend(self) -> None:
        if self.provenance:
            self._err_line(f"{DIM}colours:{RESET} {DRAFT_STYLE}drafted and accepted{RESET}{DIM} · "
                           f"{RESET}from the target{DIM} (--no-provenance turns this off){RESET}")

    def spinner(self, message: str):
        """A spinner on stderr while loading (a plain context manager elsewhere)."""
        if not self.err_tty:
            import contextlib

            return contextlib.nullcontext()
        from rich.console import Console

        return Console(file=self.err, force_terminal=self.color_err or None).status(message)

    def status_line(self) -> StatusLine | None:
        """A live one-line status on the terminal, or None when stderr is not one."""
        if not self.err_tty:
            return None
        reserve = self.out_tty and _same_terminal(self.out, self.err)
        self._status = StatusLine(self.err, self.out, reserve_row=reserve, color=self.color_err,
                                  hold=self._at_pending_wrap)
        return self._status

    def until_first(self, steps: Iterable[Any], message: str) -> Iterator[Any]:
        """`steps`, with `message` and the seconds waited on the status line until the first Step comes (a
        remote engine's queue and prefill), cleared before it is printed; as they are without a status line."""
        ticker = _Ticker(self._status, message) if self._status is not None else None
        try:
            for step in steps:
                if ticker is not None:
                    ticker.stop()
                    ticker = None
                yield step
        finally:
            if ticker is not None:
                ticker.stop()
            close = getattr(steps, "close", None)
            if close is not None:  # closing this closes the reply too (its bookkeeping runs now)
                close()

    def close_status(self) -> None:
        if self._status is not None:
            self._status.close()
            self._status = None


def _strip_ansi(s: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", s)


def terminal_size(stream: TextIO) -> os.terminal_size:
    """The size of the terminal `stream` is on. Asked of the terminal itself: escape codes that place the
    cursor need its real size, and $LINES/$COLUMNS (which shutil prefers) may be stale."""
    try:
        return os.get_terminal_size(stream.fileno())
    except (OSError, AttributeError, ValueError):
        return shutil.get_terminal_size()


def _fit(line: str, width: int) -> str:
    """The line cut to `width` cells: a status line that wrapped would be redrawn one row too low."""
    from rich.cells import cell_len, set_cell_size

    plain = _strip_ansi(line)
    return line if cell_len(plain) <= width else set_cell_size(plain, max(width, 0)).rstrip()


def _same_terminal(a: TextIO, b: TextIO) -> bool:
    try:
        return os.ttyname(a.fileno()) == os.ttyname(b.fileno())
    except (OSError, AttributeError, ValueError):
        return False


def status_text(stats: Any, speculative: bool, color: bool = False) -> str:
    if not getattr(stats, "acceptance_reported", True):  # a remote engine without speculative counters
        return "  ".join([f"{stats.decode_tokens_per_second:6.1f} tok/s", f"{stats.generated_tokens} tok",
                          NOT_REPORTED])
    if stats.counted_decode_tokens is not None and not stats.steps:  # a remote reply: its counters come at the end
        return "  ".join(["◌ remote", f"{stats.decode_tokens_per_second:6.1f} tok/s", f"{stats.generated_tokens} tok"])
    marker = "● spec on" if speculative else "○ spec off"
    if color:
        marker = f"{DRAFT_STYLE if speculative else DIM}{marker}{RESET}"
    parts = [marker, f"{stats.decode_tokens_per_second:6.1f} tok/s", f"{stats.generated_tokens} tok"]
    if speculative and stats.steps:
        parts.insert(2, f"τ {stats.acceptance_length:.2f}")
        if stats.drafted:
            parts.insert(3, f"draft {stats.draft_acceptance:.0%}")
        if stats.adaptive:
            parts.insert(4, "drafting paused" if stats.last_block == 1 else f"block {stats.last_block}")
    return "  ".join(parts)


class StatusLine:
    """A status line that does not disturb the streamed text.

    With stdout on the same terminal, the bottom row is reserved with a scroll region (DECSTBM) and the
    text scrolls above it; otherwise the line is redrawn in place on stderr.
    """

    def __init__(self, err: TextIO, out: TextIO, *, reserve_row: bool, color: bool,
                 hold: Callable[[], bool] = lambda: False):
        self.err, self.out, self.reserve, self.color, self.hold = err, out, reserve_row, color, hold
        self.rows = terminal_size(err).lines
        self.reserve = self.reserve and self.rows >= 3
        self._line = ""
        self._last = 0.0
        if self.reserve:  # make room, then confine scrolling to the rows above the last one
            self._raw(f"\n\x1b7\x1b[1;{self.rows - 1}r\x1b8\x1b[1A")

    def _raw(self, s: str) -> None:
        try:
            self.out.flush()
            self.err.write(s)
            self.err.flush()
        except (OSError, ValueError):
            pass

    def update(self, line: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.1:  # at most 10 redraws a second
            self._line = line
            return
        self._line, self._last = line, now
        self.refresh()

    def refresh(self) -> None:
        if not self._line or (self.reserve and self.hold()):
            return
        line = _fit(self._line, terminal_size(self.err).columns - 1)
        if self.reserve:
            self._raw(f"\x1b7\x1b[{self.rows};1H\x1b[2K{line}\x1b8")
        else:
            self._raw(f"\r\x1b[2K{line}")

    def blank(self) -> None:
        """Clears the line and forgets it: nothing is redrawn until the next update."""
        self.clear()
        self._line = ""

    def clear(self) -> None:
        if self.reserve:
            self._raw(f"\x1b7\x1b[{self.rows};1H\x1b[2K\x1b8")
        elif self._line:
            self._raw("\r\x1b[2K")

    def close(self) -> None:
        self.clear()
        if self.reserve:
            self._raw(f"\x1b7\x1b[1;{self.rows}r\x1b8")
        self._line = ""


WAIT_SHOWN_AFTER = 0.3  # seconds: a quick answer does not flash a line


class _Ticker:
    """A thread that shows `◌ message · Ns` on a status line until stop(), which blanks the line. The main
    thread is blocked on the network meanwhile, so the two never write at once."""

    def __init__(self, status: StatusLine, message: str):
        self.status, self.message = status, message
        self.started = time.monotonic()
        self._stopped = threading.Event()
        self._shown = False
        self._thread = threading.Thread(target=self._run, name="dflash-wait-status", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = WAIT_SHOWN_AFTER
        while not self._stopped.wait(delay):
            self._shown = True
            self.status.update(f"◌ {self.message} · {time.monotonic() - self.started:.0f}s", force=True)
            delay = 0.5

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        if self._shown:
            self.status.blank()
