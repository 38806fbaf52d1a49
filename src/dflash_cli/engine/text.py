"""Text helpers: streaming detokenisation and prompt encoding."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


class StreamDecoder:
    """Incrementally turn generated token ids into printable text.

    Uses the prefix/read offset scheme of vLLM and TGI: each step decodes only a
    short window, ``ids[prefix:read]`` (already emitted, kept as context so that
    leading-space and byte-level merges render correctly) and ``ids[prefix:]``,
    and emits the difference. Text whose tail decodes to U+FFFD (an incomplete
    UTF-8 sequence) is held back until more ids arrive or :meth:`flush` is called.

    Skipping special tokens keeps those in `keep` (default: the model's reasoning markers where its vocabulary
    makes them special tokens, Gemma 4's `<|channel>` and `<channel|>`), so that the reasoning can still be
    told apart from the answer in the text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True,
                 keep: Collection[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._added = added_tokens(tokenizer)
        keep = special_marker_ids(tokenizer, self._added) if keep is None else keep
        # special ids shown although skip_special_tokens (empty: the tokenizer's own skipping will do)
        self._keep = frozenset(keep) if skip_special_tokens else frozenset()
        self._named = frozenset(tokenizer.all_special_ids) if self._keep else frozenset()
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this index have been emitted
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    @property
    def token_ids(self) -> list[int]:
        """All ids added so far (a copy)."""
        return list(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the newly printable text (possibly "")."""
        self._ids.extend(int(t) for t in token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._step(final=True)

    def _decode(self, ids: list[int]) -> str:
        # decode() of one id list is a str (transformers annotates it str | list[str], for batches too)
        if self._keep:
            return cast(str, self._tokenizer.decode([i for i in ids if i in self._keep or not self._special(i)],
                                                    skip_special_tokens=False))
        return cast(str, self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens))

    def _special(self, token_id: int) -> bool:
        """Whether decoding with skip_special_tokens leaves the id out: an added token marked special (what a
        fast tokenizer skips) or one of the tokenizer's named special tokens (what a Python one skips)."""
        token = self._added.get(token_id)
        return token_id in self._named or (token is not None and bool(token.special))

    def _step(self, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._chunks.append(delta)
        return delta


def added_tokens(tokenizer: PreTrainedTokenizerBase) -> Mapping[int, Any]:
    """{id: AddedToken} of the tokenizer's added tokens ({} for a tokenizer without them)."""
    return getattr(tokenizer, "added_tokens_decoder", None) or {}


def added_token_id(tokenizer: PreTrainedTokenizerBase, content: str, added: Mapping[int, Any] | None = None
                   ) -> int | None:
    """The id of the added token spelled `content`, or None (a look-up, not a scan: a vocabulary can hold
    thousands of added tokens). `added`: added_tokens(tokenizer), when the caller has it."""
    added = added_tokens(tokenizer) if added is None else added
    if not added:
        return None
    token_id = tokenizer.convert_tokens_to_ids(content)
    if not isinstance(token_id, int):  # no such token, and no unknown token
        return None
    token = added.get(token_id)
    return token_id if token is not None and token.content == content else None


def special_marker_ids(tokenizer: PreTrainedTokenizerBase, added: Mapping[int, Any] | None = None) -> set[int]:
    """The ids of the model's reasoning markers that are special tokens (decoding would skip them)."""
    added = added_tokens(tokenizer) if added is None else added
    markers = thinking_markers(tokenizer, added)
    ids = [added_token_id(tokenizer, t, added) for t in markers.tokens] if markers is not None else []
    return {i for i in ids if i is not None and added[i].special}


def chat_template_of(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's chat template(s) as one string ("" when it has none)."""
    template: Any = getattr(tokenizer, "chat_template", None)
    if not template:
        return ""
    if isinstance(template, Mapping):  # named templates
        return "\n".join(str(t) for t in template.values())
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return "\n".join(str(t.get("template", "")) if isinstance(t, Mapping) else str(t) for t in template)
    return str(template)


def supports_thinking(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the chat template reacts to an ``enable_thinking`` flag."""
    return "enable_thinking" in chat_template_of(tokenizer)


@dataclass(frozen=True)
class ThinkingMarkers:
    """How a model's reply marks its reasoning, as its text decodes: `open` starts the reasoning, `close` ends
    it and the answer follows."""

    open: str
    close: str

    @property
    def tokens(self) -> tuple[str, str]:
        """The vocabulary entries that spell the markers: the open marker up to its first `>`, the close."""
        return self.open[: self.open.index(">") + 1], self.close


THINK_TAGS = ThinkingMarkers("<think>", "</think>")  # Qwen3, Qwen3.5, Qwen3.6, DeepSeek-R1
GEMMA_CHANNEL = ThinkingMarkers("<|channel>thought\n", "<channel|>")  # Gemma 4 (special tokens in its vocabulary)
KNOWN_MARKERS = (THINK_TAGS, GEMMA_CHANNEL)


def thinking_markers(tokenizer: PreTrainedTokenizerBase, added: Mapping[int, Any] | None = None
                     ) -> ThinkingMarkers | None:
    """The reasoning markers the model writes: the first known family whose close marker is in its chat
    template or its vocabulary's added tokens; None for a model without reasoning sections. `added`:
    added_tokens(tokenizer), when the caller has it."""
    template = chat_template_of(tokenizer)
    added = added_tokens(tokenizer) if added is None else added
    return next((m for m in KNOWN_MARKERS if m.close in template or added_token_id(tokenizer, m.close, added)
                 is not None), None)


def opens_thinking(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[int],
                   markers: ThinkingMarkers | None = None) -> bool:
    """True when the prompt ends inside an open reasoning section (the template opened it): the reply starts
    in it. `markers`: the model's (default: found by thinking_markers). A prompt that ends with an empty,
    closed section (`<think>\\n\\n</think>`, Gemma 4's `<|channel>thought\\n<channel|>`) is not inside one."""
    markers = markers or thinking_markers(tokenizer)
    if markers is None:
        return False
    tail = cast(str, tokenizer.decode(list(prompt[-16:]), skip_special_tokens=False))  # one id list: a str
    return tail.rstrip().endswith(markers.open.rstrip())


def thinking_default(tokenizer: PreTrainedTokenizerBase) -> bool | None:
    """Whether the chat template thinks when `enable_thinking` is not given (None: no switch, or unclear),
    found by rendering a one-message chat with the flag unset, on and off."""
    if not supports_thinking(tokenizer):
        return None
    chat = [{"role": "user", "content": "hi"}]

    def render(**kwargs: Any) -> str | None:
        try:
            # tokenize=False renders one chat as a str (the annotation covers every mode)
            return cast(str, tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                                           **kwargs))
        except Exception:  # a template that fails here fails later with a clear error
            return None

    unset, on, off = render(), render(enable_thinking=True), render(enable_thinking=False)
    if unset is None or on == off:
        return None
    return True if unset == on else False if unset == off else None


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]] | str,
    *,
    chat_template: bool = True,
    enable_thinking: bool | None = None,
    system: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Turn a chat (or a plain string) into prompt token ids (`tools`: OpenAI's tool list, for templates
    that render one).

    With a chat template (and ``chat_template``), the template is rendered with
    ``add_generation_prompt=True`` and the text encoded without adding special
    tokens, as ``apply_chat_template`` itself does (the template supplies BOS
    if the model wants one). Otherwise the plain text ("role: content" lines for
    a chat) is encoded with the tokenizer's default special tokens.
    """
    chat = [{"role": "user", "content": messages}] if isinstance(messages, str) else [dict(m) for m in messages]
    if system is not None:
        chat = [{"role": "system", "content": system}, *chat]

    if chat_template and chat_template_of(tokenizer):
        kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        if tools:
            kwargs["tools"] = tools

        def render(messages: list[dict[str, str]]) -> str:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            if not isinstance(text, str):
                raise TypeError(f"chat template rendered to {type(text).__name__}, expected str")
            return text

        specials = _special_texts(tokenizer)
        if specials:
            answered = _without_marked_reasoning(tokenizer, chat)
            if any(s in str(m.get("content", "")) for m in answered for s in specials):
                return _encode_keeping_text(tokenizer, answered, render, specials)
        rendered = render(chat)
        return _as_ids(tokenizer.encode(rendered, add_special_tokens=False))

    if isinstance(messages, str):
        text = messages if system is None else f"{system}\n\n{messages}"
    else:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in chat)
    return _as_ids(tokenizer.encode(text, split_special_tokens=True))  # typed control tokens stay text


def _special_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The texts of the tokenizer's special added tokens, longest first."""
    return sorted((t.content for t in added_tokens(tokenizer).values() if t.special and t.content),
                  key=len, reverse=True)


def _without_marked_reasoning(tokenizer: PreTrainedTokenizerBase, chat: list[dict[str, str]]
                              ) -> list[dict[str, str]]:
    """The chat with the reasoning sections of the model's replies taken out, where its markers are special
    tokens (Gemma 4's `<|channel>thought ... <channel|>`): the template drops them from earlier turns too, and
    what is left of a reply is checked for control text like any message (a marker without its pair is)."""
    markers = thinking_markers(tokenizer)
    if markers is None or not special_marker_ids(tokenizer):
        return chat
    opened, closed = markers.tokens
    section = re.compile(re.escape(opened) + ".*?" + re.escape(closed), re.DOTALL)
    return [dict(m, content=section.sub("", m["content"])) if m.get("role") == "assistant"
            and isinstance(m.get("content"), str) else m for m in chat]


def _encode_keeping_text(tokenizer, chat, render, specials: list[str]) -> list[int]:
    """The chat's prompt ids with every special token's text typed in a message encoded as plain text, never
    as the control token (a forged turn boundary). Contents are encoded literally where the pieces of the
    rendered template can be told apart, also after trimming them (a template that trims contents); else
    the typed control texts are broken up by a word joiner (U+2060) before rendering."""
    trimmed = [dict(m, content=str(m.get("content", "")).strip()) for m in chat]
    for attempt in (chat, trimmed):
        literal = _encode_contents_literally(tokenizer, attempt, render(attempt), render)
        if literal is not None:
            return literal

    def defuse(text: str) -> str:
        for s in specials:
            text = text.replace(s, s[0] + "\u2060" + s[1:])
        return text

    defused = [dict(m, content=defuse(str(m.get("content", "")))) for m in chat]
    return _as_ids(tokenizer.encode(render(defused), add_special_tokens=False))


_MARK = re.compile("\ue000(\\d+)\ue001")


def _encode_contents_literally(tokenizer, chat, rendered: str, render) -> list[int] | None:
    """Encodes the template's own text normally but message contents as plain text, so that a user who
    types `<|im_end|>` gets those characters, not the control token. None when the template transforms
    contents (trims them, say) and the pieces cannot be told apart."""
    parts = _MARK.split(render([dict(m, content=f"\ue000{i}\ue001") for i, m in enumerate(chat)]))
    contents = [str(m.get("content", "")) for m in chat]
    if "".join(contents[int(p)] if k % 2 else p for k, p in enumerate(parts)) != rendered:
        return None
    ids: list[int] = []
    for k, piece in enumerate(parts):
        if k % 2:
            ids += _as_ids(tokenizer.encode(contents[int(piece)], add_special_tokens=False,
                                            split_special_tokens=True))
        elif piece:
            ids += _as_ids(tokenizer.encode(piece, add_special_tokens=False))
    return ids


def _as_ids(encoded: Any) -> list[int]:
    """Coerce an encode/apply_chat_template result into a plain ``list[int]``."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        if len(encoded) != 1:
            raise ValueError("expected a single sequence of token ids")
        encoded = encoded[0]
    return [int(i) for i in encoded]
