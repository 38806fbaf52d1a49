"""Conversations with an opened model (runtime/ opens it), and the per-reply settings.

No terminal code here: chat and one-shot generation both go through a `ChatHistory`: `Conversation` for a
pair loaded here, which keeps the engine's caches between turns so a new turn only prefills its new tokens,
and remote.RemoteConversation for a server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_cli import settings as S
from dflash_cli.engine.errors import DFlashError
from dflash_cli.engine.output_format import OutputFormat
from dflash_cli.engine.text import THINK_TAGS, ThinkingMarkers


class TranscriptError(DFlashError):
    """A saved chat transcript cannot be read."""


@dataclass
class GenerationSettings:
    """Per-reply settings; chat changes them with /set."""

    max_tokens: int = S.DEFAULT_MAX_TOKENS
    temperature: float = S.DEFAULT_TEMPERATURE
    top_p: float = S.DEFAULT_TOP_P
    top_k: int = S.DEFAULT_TOP_K
    seed: int | None = None
    block_size: int | None = None  # None: the drafter's trained size
    think: bool | None = None  # None: the chat template's default
    chat_template: bool = True
    max_context: int | None = None  # None: the target's context length
    output_format: OutputFormat | None = None  # --format/--schema/--grammar/--regex: what every reply keeps to

    def engine_kwargs(self) -> dict[str, Any]:
        return dict(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, block_size=self.block_size, max_context=self.max_context,
                    output_format=self.output_format)

    @property
    def thinking(self) -> bool | None:
        """The thinking mode to ask the template for: a structured reply starts at its first token, so a
        format turns thinking off unless it was asked for (ui/opening.py refuses the two together)."""
        return False if self.output_format is not None and self.think is None else self.think


@dataclass
class ChatHistory:
    """The messages of a chat, whatever answers them (the local engine, or a remote one in runtime/remote.py):
    asking, regenerating, keeping a reply cut short, and the transcript file."""

    runtime: Any
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    interrupted: bool = False  # the last reply was cut short (and kept)
    cached_before: int = 0  # tokens the caches held before the last reply
    # None: the model has no reasoning sections; else whether the prompt of the last reply opened one
    reply_in_thinking: bool | None = None
    reply_markers: ThinkingMarkers = THINK_TAGS  # how the last reply marks its reasoning

    def ask(self, text: str, settings: Any) -> Iterator[Any]:
        """Adds a user message and streams the reply (engine Steps); the reply joins the conversation."""
        self.messages.append({"role": "user", "content": text})
        return self._respond(settings)

    def regenerate(self, settings: Any) -> Iterator[Any]:
        """Drops the last reply and answers the last user message again; with a fixed seed it moves to the
        next seed (settings.seed += 1), since the same seed would give the same reply."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages:
            raise TranscriptError("nothing to regenerate yet")
        if settings.seed is not None and settings.temperature > 0:
            settings.seed += 1
        return self._respond(settings)

    def _respond(self, settings: Any) -> Iterator[Any]:
        raise NotImplementedError

    def save(self, path: Path, settings: Any) -> None:
        """Writes the transcript, with what answered it (each kind of chat says what)."""
        raise NotImplementedError

    def _kept(self, steps: Iterator[Any]) -> Iterator[Any]:
        """Yields the reply's Steps; the reply joins the messages even when cut short (Ctrl-C, a broken
        stream)."""
        parts: list[str] = []
        self.interrupted = True
        try:
            for step in steps:
                parts.append(step.text)
                yield step
            self.interrupted = False
        finally:
            self.messages.append({"role": "assistant", "content": "".join(parts)})

    def clear(self) -> None:
        self.messages.clear()

    def _write(self, path: Path, source: dict[str, Any], settings: dict[str, Any]) -> None:
        data = {"format": "dflash-cli chat", "version": 1, **source, "system": self.system, "settings": settings,
                "messages": self.messages}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        tmp.replace(path)  # never leave a half-written transcript

    def load(self, path: Path) -> dict[str, Any]:
        """Replaces the conversation with a saved transcript; returns its saved settings."""
        try:
            data = json.loads(Path(path).read_text())
            messages = data["messages"]
            ok = isinstance(messages, list) and all(
                isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
                and isinstance(m.get("content"), str) for m in messages)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise TranscriptError(f"cannot read transcript {path}: {e}") from None
        if not ok:
            raise TranscriptError(f"{path} is not a dflash-cli transcript (bad 'messages')")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        self.system = data.get("system")
        return data.get("settings") or {}


@dataclass
class Conversation(ChatHistory):
    """A chat answered by the local engine, plus the engine state that caches it."""

    runtime: Any  # a LocalRuntime: runtime/local.py imports this module, so it is not named here

    def __post_init__(self) -> None:
        from dflash_cli.engine.state import DecodeState

        self.state = DecodeState(self.runtime.target, self.runtime.drafter)

    def prompt_ids(self, settings: GenerationSettings) -> list[int]:
        from dflash_cli.engine.text import encode_prompt

        return encode_prompt(self.runtime.tokenizer, self.messages, chat_template=settings.chat_template,
                             enable_thinking=settings.thinking, system=self.system)

    def _respond(self, settings: GenerationSettings) -> Iterator[Any]:
        """Builds the prompt now (so reply_in_thinking is known before the first Step), then streams."""
        from dflash_cli.engine.text import opens_thinking, thinking_markers

        prompt = self.prompt_ids(settings)
        tokenizer = self.runtime.tokenizer
        markers = thinking_markers(tokenizer)
        self.reply_markers = markers or THINK_TAGS
        self.reply_in_thinking = opens_thinking(tokenizer, prompt, markers) if markers else None
        return self._kept(self._generate(prompt, settings))

    def _generate(self, prompt: list[int], settings: GenerationSettings) -> Iterator[Any]:
        from dflash_cli.engine.generate import stream_generate

        self.cached_before = len(self.state.tokens)
        yield from stream_generate(self.runtime.target, self.runtime.drafter, prompt,
                                   tokenizer=self.runtime.tokenizer, state=self.state, **settings.engine_kwargs())

    def clear(self) -> None:
        super().clear()
        self.state.reset()

    def save(self, path: Path, settings: GenerationSettings) -> None:
        self._write(path, {"model": str(self.runtime.target_dir),
                           "drafter": str(self.runtime.drafter_dir) if self.runtime.drafter_dir else None},
                    asdict(settings))
