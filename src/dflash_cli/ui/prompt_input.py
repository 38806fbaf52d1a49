"""The text a reply answers: the prompt from arguments, stdin and/or a file, and the system prompt, as UTF-8.

Undecodable bytes (from files, pipes, arguments and environment variables) become U+FFFD, said once.
"""

from __future__ import annotations

from typing import Any

import click

from dflash_cli.ui.render import isatty


def read_prompt(words: tuple[str, ...], file: str | None, stdin: Any, warn=lambda _: None) -> str:
    """stdin (when piped) or -f FILE first, then the instruction from the arguments (ollama and llm agree).

    All three are UTF-8: bytes that are not become U+FFFD, and `warn` is told once."""
    parts, replaced = [], False
    if file is not None:
        try:
            with open(file, "rb") as f:
                data, bad = decode_utf8(f.read())
        except OSError as e:
            raise click.BadParameter(f"cannot read {file}: {e.strerror}", param_hint="-f/--file") from None
        parts.append(data)
        replaced |= bad
    if stdin is not None and not isatty(stdin):
        raw = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read()
        data, bad = decode_utf8(raw)
        if data.strip():
            parts.append(data)
            replaced |= bad
    if words:
        data, bad = decode_utf8(" ".join(words))
        parts.append(data)
        replaced |= bad
    prompt = "\n\n".join(p.rstrip("\n") for p in parts)
    if not prompt.strip():
        raise click.UsageError("no prompt: give it as arguments, pipe it on stdin, or use -f FILE")
    if replaced:
        warn(NOT_UTF8.format(what="the prompt"))
    return prompt


NOT_UTF8 = "{what} is not valid UTF-8: the invalid bytes were replaced with U+FFFD"


def decode_utf8(data: bytes | str) -> tuple[str, bool]:
    """(text, whether something was replaced). A str may hold the surrogate escapes Python gives to
    undecodable bytes in arguments, environment variables and C-locale streams: those become U+FFFD."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
            return data, False
        except UnicodeEncodeError:
            data = data.encode("utf-8", "surrogateescape" if _only_escapes(data) else "replace")
            return data.decode("utf-8", "replace"), True
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace"), True


def _only_escapes(text: str) -> bool:
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in text)


def system_prompt(out: Any, system: str | None) -> str | None:
    """-s/--system (or DFLASH_SYSTEM), with bytes that are not UTF-8 replaced as in the prompt."""
    if system is None:
        return None
    text, replaced = decode_utf8(system)
    if replaced:
        out.warn(NOT_UTF8.format(what="the system prompt"))
    return text
