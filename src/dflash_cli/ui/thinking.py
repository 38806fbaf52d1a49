"""A reply's reasoning (`<think> ... </think>`) told apart from its answer, for display and --json.

Pure text, no terminal code. A reply is in one of two shapes: it opens its own `<think>` (Qwen3 with
thinking on), or the chat template already opened it in the prompt and only `</think>` comes (Qwen3.5,
Qwen3.6), which the caller says with `inside=True`. A `<think>` is recognised only at the start of a reply
and only the first `</think>` ends the reasoning, so an answer that talks about the tags is left alone.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
_START, _THINKING, _GAP, _ANSWER = range(4)


class ThinkingSplitter:
    """Splits streamed text into (is_thinking, text) segments.

    Thinking segments carry the tags and the blank lines after `</think>` (the reply's own text, so
    showing every segment prints exactly what was generated); answer segments carry the rest. Text that
    may be the start of a tag split across chunks is held back until the next chunk or `flush()`.
    """

    def __init__(self, inside: bool = False) -> None:
        self._state = _THINKING if inside else _START
        self._held = ""
        self.saw_thinking = inside

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self._held += text
        out: list[tuple[bool, str]] = []
        while self._held:
            if self._state == _START:
                body = self._held.lstrip()
                if not body or (OPEN.startswith(body) and body != OPEN):
                    break  # whitespace, or a prefix of <think>: undecided
                if body.startswith(OPEN):
                    cut = len(self._held) - len(body) + len(OPEN)
                    self._emit(out, True, cut)
                    self._state, self.saw_thinking = _THINKING, True
                else:
                    self._state = _ANSWER
            elif self._state == _THINKING:
                end = self._held.find(CLOSE)
                if end >= 0:
                    self._emit(out, True, end + len(CLOSE))
                    self._state = _GAP
                else:
                    self._emit(out, True, len(self._held) - _partial_tag(self._held))
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


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that could begin `</think>`."""
    for n in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[-n:]):
            return n
    return 0


def split_reply(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning without its tags and surrounding newlines, or None when there was none; the answer)."""
    splitter = ThinkingSplitter(inside)
    segments = splitter.feed(text) + splitter.flush()
    if not splitter.saw_thinking:
        return None, text
    thinking = "".join(s for is_thinking, s in segments if is_thinking).strip()
    if thinking.startswith(OPEN):
        thinking = thinking[len(OPEN):]
    if thinking.endswith(CLOSE):
        thinking = thinking[:-len(CLOSE)]
    return thinking.strip("\n"), "".join(s for is_thinking, s in segments if not is_thinking)
