"""A reply's reasoning told apart from its answer, for display, --json and `serve`'s reasoning_content.

Pure text, no terminal code. The model's markers (engine.text.ThinkingMarkers) say where the reasoning starts
and ends: `<think> ... </think>` (Qwen3, Qwen3.5, Qwen3.6; the default) or `<|channel>thought\\n ... <channel|>`
(Gemma 4). A reply is in one of two shapes: it opens its own reasoning (Qwen3 and Gemma 4 with thinking on),
or the chat template already opened it in the prompt and only the close marker comes (Qwen3.5, Qwen3.6),
which the caller says with `inside=True`. The open marker is recognised only at the start of a reply and only
the first close marker ends the reasoning, so an answer that talks about the markers is left alone.
ReasoningStream turns the splitter's thinking segments into streamed reasoning_content deltas.
"""

from __future__ import annotations

from dflash_cli.engine.text import THINK_TAGS, ThinkingMarkers

_START, _THINKING, _GAP, _ANSWER = range(4)


class ThinkingSplitter:
    """Splits streamed text into (is_thinking, text) segments.

    Thinking segments carry the markers and the blank lines after the close marker (the reply's own text,
    so showing every segment prints exactly what was generated); answer segments carry the rest. Text that
    may be the start of a marker split across chunks is held back until the next chunk or `flush()`.
    """

    def __init__(self, inside: bool = False, markers: ThinkingMarkers = THINK_TAGS) -> None:
        self.markers = markers
        self._state = _THINKING if inside else _START
        self._held = ""
        self.saw_thinking = inside

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self._held += text
        opening, closing = self.markers.open, self.markers.close
        out: list[tuple[bool, str]] = []
        while self._held:
            if self._state == _START:
                body = self._held.lstrip()
                if not body or (opening.startswith(body) and body != opening):
                    break  # whitespace, or a prefix of the open marker: undecided
                if body.startswith(opening):
                    cut = len(self._held) - len(body) + len(opening)
                    self._emit(out, True, cut)
                    self._state, self.saw_thinking = _THINKING, True
                else:
                    self._state = _ANSWER
            elif self._state == _THINKING:
                end = self._held.find(closing)
                if end >= 0:
                    self._emit(out, True, end + len(closing))
                    self._state = _GAP
                else:
                    self._emit(out, True, len(self._held) - _partial_tag(self._held, closing))
                    break
            elif self._state == _GAP:
                body = self._held.lstrip()
                self._emit(out, True, len(self._held) - len(body))
                if body:
                    self._state = _ANSWER
            else:
                self._emit(out, False, len(self._held))
        return out

    def flush(self) -> list[tuple[bool, str]]:
        """The held-back text, at the end of the reply."""
        out: list[tuple[bool, str]] = []
        self._emit(out, self._state in (_THINKING, _GAP), len(self._held))
        return out

    def _emit(self, out: list[tuple[bool, str]], thinking: bool, n: int) -> None:
        if n > 0:
            out.append((thinking, self._held[:n]))
        self._held = self._held[n:]


def _partial_tag(text: str, closing: str) -> int:
    """Length of the longest end of `text` that could begin the close marker."""
    for n in range(min(len(closing) - 1, len(text)), 0, -1):
        if closing.startswith(text[-n:]):
            return n
    return 0


def split_reply(text: str, inside: bool = False, markers: ThinkingMarkers = THINK_TAGS) -> tuple[str | None, str]:
    """(reasoning without its markers and surrounding newlines, or None when there was none; the answer)."""
    splitter = ThinkingSplitter(inside, markers)
    segments = splitter.feed(text) + splitter.flush()
    if not splitter.saw_thinking:
        return None, text
    thinking = "".join(s for is_thinking, s in segments if is_thinking).strip()
    opening = markers.open.rstrip()  # the reasoning's own whitespace is stripped below
    if thinking.startswith(opening):
        thinking = thinking[len(opening):]
    if thinking.endswith(markers.close):
        thinking = thinking[:-len(markers.close)]
    return thinking.strip("\n"), "".join(s for is_thinking, s in segments if not is_thinking)


class ReasoningStream:
    """ThinkingSplitter's thinking segments (which carry the open and close markers, <think> and </think>
    say, and the blank lines around them) as reasoning_content deltas whose concatenation is split_reply's
    reasoning: the markers and the newlines next to them left out, trailing whitespace held back until more
    reasoning follows."""

    def __init__(self, markers: ThinkingMarkers = THINK_TAGS) -> None:
        self.started = self.closed = False
        self.held = ""
        self.opening, self.closing = markers.open.rstrip(), markers.close

    def feed(self, piece: str) -> str:
        if self.closed:
            return ""  # the blank lines after the close marker
        final = self.closing in piece
        if final:
            piece, self.closed = piece[: piece.index(self.closing)], True
        if not self.started:
            stripped = piece.lstrip()
            if stripped.startswith(self.opening):
                stripped = stripped[len(self.opening):].lstrip("\n")
            piece = stripped
            if not piece:
                return ""
            self.started = True
        text, self.held = self.held + piece, ""
        if final:
            return text.rstrip("\n")
        body = text.rstrip()
        self.held = text[len(body):]
        return body
