"""A remote engine: an OpenAI-compatible server (vLLM, SGLang) whose streamed reply becomes engine Steps.

`--engine URL` swaps the local Runtime and Conversation for the RemoteRuntime and RemoteConversation here;
the terminal layer consumes the same Steps and GenerationStats either way. The server streams text, not
tokens, so each Step carries the text of one chunk (no token ids, no per-token provenance).

Acceptance statistics (what the server reports, and nothing else) are read in remote_stats.py.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dflash_cli.conversation import ChatHistory
from dflash_cli.engine.errors import DFlashError, InvalidSettingError
from dflash_cli.engine.response import Step
from dflash_cli.runtime.remote_stats import Counters, counter_delta, find_meta_info, parse_spec_counters

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 600.0  # a long prompt's prefill on a busy server; Ctrl-C ends a wait sooner
MODELS_TIMEOUT = 30.0  # listing the models is instant on a live server: a hung one is said within this
METRICS_TIMEOUT = 2.0  # the statistics give up quickly, and are not asked for again after a failure
# a timeout given (--timeout, DFLASH_TIMEOUT) replaces READ_TIMEOUT and MODELS_TIMEOUT, and caps CONNECT_TIMEOUT
TIMEOUT_HINT = "raise --timeout (DFLASH_TIMEOUT) for a long prompt on a busy server"


class RemoteError(DFlashError):
    """The engine server cannot be reached, refused the request, or broke off the stream."""


def engine_url(url: str) -> str:
    """The server's root URL (http(s)://host:port[/prefix]), without a trailing /v1; a bad one is a usage error
    (an unparseable host, a port outside 1..65535), named without its credentials."""
    from urllib.parse import urlsplit

    text = url.strip().rstrip("/")
    hint = "for example --engine http://localhost:8000"
    if not re.match(r"^https?://[^/\s]+", text):
        raise InvalidSettingError(f"--engine {redact_url(url)!r} is not an http:// or https:// URL", hint=hint)
    try:
        port = urlsplit(text).port  # parses the host too: "http://[::1" fails here
    except ValueError as e:
        raise InvalidSettingError(f"--engine {redact_url(url)!r} is not a valid URL ({e})", hint=hint) from None
    if port == 0:
        raise InvalidSettingError(f"--engine {redact_url(url)!r}: port 0 is not a server's port", hint=hint)
    return text[:-3] if text.endswith("/v1") else text


def redact_url(url: str) -> str:
    """`url` with the password (and a lone user token) of its user-info replaced by ***, for printing and saving."""
    return re.sub(r"^(\s*https?://)([^/@\s]*)@", lambda m: f"{m.group(1)}{_redacted(m.group(2))}@", url)


def _redacted(userinfo: str) -> str:
    user, sep, _ = userinfo.partition(":")
    return f"{user}:***" if sep else "***"


def check_api_key(api_key: str) -> None:
    """An API key an HTTP header can carry (printable ASCII); the key itself is never printed."""
    if not (api_key.isascii() and api_key.isprintable()):
        raise InvalidSettingError("DFLASH_API_KEY holds characters an HTTP header cannot carry "
                                  "(non-ASCII, a newline or another control character)",
                                  hint="set the key again without them (it is not printed here)")


def _message(response: Any) -> str:
    """The error message in an OpenAI-style error body ({"error": {"message"}} or {"message"}), else the text."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0][:200] if response.text.strip() else ""
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if data.get("message"):
            return str(data["message"])
        if data.get("detail"):
            return str(data["detail"])
    return ""


def status_error(url: str, response: Any, model: str | None = None, models: list[str] | None = None) -> DFlashError:
    """One clear error for an HTTP error status of the server."""
    code, message = response.status_code, _message(response)
    said = f": {message}" if message else ""
    if code in (401, 403):
        what = "Unauthorized" if code == 401 else "Forbidden"
        return RemoteError(f"the engine at {url} refused the request ({code} {what})" + said,
                           hint="set DFLASH_API_KEY to the server's API key (vLLM/SGLang --api-key)")
    if code == 404:
        if model is not None:
            known = f"it serves: {', '.join(models)}" if models else "list them with: curl URL/v1/models"
            return InvalidSettingError(f"the engine at {url} has no model {model!r}" + said,
                                       hint=f"pick one with -m; {known}")
        return RemoteError(f"the engine at {url} has no OpenAI-compatible API (404 at {response.request.url.path})",
                           hint="--engine takes the server's root URL, such as http://localhost:8000")
    if code == 429:
        wait = response.headers.get("retry-after")
        return RemoteError(f"the engine at {url} is busy (429 Too Many Requests)" + said,
                           hint=f"try again in {wait} seconds (the server's Retry-After)" if wait
                           else "try again in a moment")
    if code >= 500:
        return RemoteError(f"the engine at {url} failed ({code} {response.reason_phrase})" + said,
                           hint="the server's log has the cause")
    if code == 400:
        return InvalidSettingError(f"the engine at {url} rejected the request (400)" + said)
    return RemoteError(f"the engine at {url} answered {code} {response.reason_phrase}" + said)


def transport_error(url: str, error: Exception, *, streaming: bool = False,
                    timeout: Any = None) -> RemoteError:
    """One clear error for a failed connection or request; `timeout` (an httpx2.Timeout) names the wait."""
    import httpx2

    if isinstance(error, httpx2.ConnectError):
        return RemoteError(f"cannot connect to the engine at {url}: {_reason(error)}",
                           hint="is the server running there? check --engine (or DFLASH_ENGINE)")
    if isinstance(error, httpx2.ConnectTimeout):
        within = f" within {seconds(timeout.connect)}" if timeout is not None else ""
        return RemoteError(f"cannot connect to the engine at {url}: no answer{within}",
                           hint="is the server running there, and reachable (a firewall, a VPN)?")
    if isinstance(error, httpx2.TimeoutException):
        within = f"within {seconds(timeout.read)}" if timeout is not None else "in time"
        return RemoteError(f"the engine at {url} did not answer {within} ({type(error).__name__})",
                           hint=f"the server may be overloaded (see its log); {TIMEOUT_HINT}")
    if streaming:
        return RemoteError(f"the engine at {url} cut the stream off before the reply ended ({_reason(error)})",
                           hint="the server's log has the cause; the text received so far was kept")
    return RemoteError(f"the connection to the engine at {url} failed: {_reason(error)}")


def seconds(value: float) -> str:
    return f"{value:g} s"


def _reason(error: Exception) -> str:
    text = str(error).strip()
    if "refused" in text.lower():
        return "connection refused"
    return text.splitlines()[0] if text else type(error).__name__


# -- the runtime and the conversation -------------------------------------------------------------------



_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

class RemoteRuntime:
    """An engine server, answering in the place of a loaded pair (the Runtime protocol of runtime/__init__.py)."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, transport: Any = None,
                 timeout: float | None = None):
        """`timeout`: seconds to wait for the server (its model list, each part of a reply, the first token
        included), in the place of READ_TIMEOUT and MODELS_TIMEOUT; None keeps those."""
        import httpx2

        connect_to = engine_url(url)
        self.url = redact_url(connect_to)  # what is printed and saved: never the password
        if api_key:
            check_api_key(api_key)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if timeout is not None and not 0 < timeout < float("inf"):
            raise InvalidSettingError(f"--timeout {timeout!r} is not a number of seconds above 0",
                                      hint=f"for example --timeout {READ_TIMEOUT:g}")
        read = READ_TIMEOUT if timeout is None else timeout
        self.timeout = httpx2.Timeout(read, connect=min(CONNECT_TIMEOUT, read))
        self.models_timeout = MODELS_TIMEOUT if timeout is None else timeout
        self.client = httpx2.Client(base_url=connect_to, headers=headers, transport=transport, timeout=self.timeout)
        self.metrics_failed = False
        started = time.perf_counter()
        self.models = self._models()
        self.model = model or self._only_model()
        self.load_seconds = time.perf_counter() - started

    # -- the Runtime protocol (runtime/__init__.py) --------------------------------------------------------------
    @property
    def speculative(self) -> bool:
        return True  # the server decides; the statistics say what it reported

    @property
    def marks_drafted(self) -> bool:
        return False  # a server's stream does not say which tokens were drafted

    @property
    def model_name(self) -> str:
        return self.model

    @property
    def drafter_name(self) -> str | None:
        return None  # the server's own

    @property
    def forward(self) -> str:
        return f"remote engine {self.url}"

    @property
    def trained_block_size(self) -> int | None:
        return None  # the server's own drafter

    @property
    def first_token_wait(self) -> str | None:
        return "waiting for the engine's first token (Ctrl-C stops)"  # its queue and prefill can take long

    def ready_line(self) -> str:
        return f"{self.model} on the engine at {self.url}"

    def banner(self) -> str:
        return self.ready_line()

    def supports_thinking(self) -> bool | None:
        return None  # the server applies its own chat template

    def thinking_mode(self, think: bool | None) -> bool | None:
        return None

    def trained_thinking(self) -> tuple[str, bool] | None:
        return None

    def check_block_size(self, block_size: int | None) -> None:
        if block_size is not None:
            raise InvalidSettingError("the block size is the engine's to choose: it runs its own drafter",
                                      hint="set it where the server starts (serve-cmd --block-size)")

    def _models(self) -> list[str]:
        import httpx2

        try:
            wait = httpx2.Timeout(self.models_timeout, connect=self.timeout.connect)
            response = self.client.get("/v1/models", timeout=wait)
        except httpx2.ConnectTimeout as e:
            raise transport_error(self.url, e, timeout=self.timeout) from None
        except httpx2.TimeoutException:
            raise RemoteError(f"the engine at {self.url} did not list its models within "
                              f"{seconds(self.models_timeout)}",
                              hint="the server may still be starting or be hung (see its log); "
                                   "a slow one needs a higher --timeout (DFLASH_TIMEOUT)") from None
        except httpx2.TransportError as e:
            raise transport_error(self.url, e, timeout=self.timeout) from None
        if response.status_code != 200:
            raise status_error(self.url, response)
        try:
            ids = [m["id"] for m in response.json()["data"]]
            if not all(isinstance(i, str) for i in ids):
                raise TypeError("model ids are not strings")
            return ids
        except (ValueError, KeyError, TypeError):
            raise RemoteError(f"the engine at {self.url} sent a /v1/models answer that is not OpenAI's format",
                              hint="--engine takes an OpenAI-compatible server (vLLM, SGLang)") from None

    def _only_model(self) -> str:
        if len(self.models) == 1:
            return self.models[0]
        raise InvalidSettingError(f"the engine at {self.url} serves {len(self.models)} models: pick one with -m",
                                  hint=f"models: {', '.join(self.models)}" if self.models else None)

    def spec_counters(self) -> dict[str, Any]:
        """vLLM's spec_decode counters now ({} when the server has no /metrics or exports none)."""
        import httpx2

        if self.metrics_failed:
            return {}
        try:
            response = self.client.get("/metrics", timeout=METRICS_TIMEOUT)
        except httpx2.HTTPError:
            self.metrics_failed = True  # a hung /metrics would add its timeout to every reply
            return {}
        return parse_spec_counters(response.text) if response.status_code == 200 else {}

    def conversation(self, system: str | None = None) -> RemoteConversation:
        return RemoteConversation(self, system=system)

    def info(self) -> dict[str, Any]:
        return {"engine": self.url, "model": self.model, "models served": ", ".join(self.models)}

    def close(self) -> None:
        self.client.close()

    def stream_chat(self, messages: list[dict[str, str]], settings: Any) -> Iterator[Step]:
        """Streams one reply to `messages` as Steps; the last one carries finish_reason and the final stats."""
        import httpx2

        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True},
                                "max_tokens": settings.max_tokens, "temperature": settings.temperature,
                                "top_p": settings.top_p}
        if settings.top_k:
            body["top_k"] = settings.top_k
        if settings.seed is not None:
            body["seed"] = settings.seed
        if settings.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": settings.thinking}
        if settings.output_format is not None:
            from dflash_cli.engine.output_format import request_fields

            body.update(request_fields(settings.output_format))
        before = self.spec_counters()
        counters = Counters(time.perf_counter())
        done = False
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise status_error(self.url, response, self.model,
                                       self.models if response.status_code == 404 else None)
                kind = response.headers.get("content-type", "")
                if "json" in kind and "event-stream" not in kind:
                    raise RemoteError(f"the engine at {self.url} answered with one JSON object, not a stream "
                                      "(it ignored \"stream\": true)",
                                      hint="--engine needs a server that streams (OpenAI's server-sent events)")
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue  # SSE comments, event names, the blank lines between events
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    step = self._chunk(data, counters)
                    if step is not None:
                        yield step
        except httpx2.TransportError as e:
            raise transport_error(self.url, e, streaming=True, timeout=self.timeout) from None
        if not done and counters.finish_reason is None:
            raise RemoteError(f"the engine at {self.url} cut the stream off before the reply ended "
                              f"({counters.chunks} chunk(s) received)",
                              hint="the server's log has the cause; the text received so far was kept")
        if counters.meta is None and counters.request_spec is None:  # the server-wide counters, as a fallback
            counters.metrics = counter_delta(before, self.spec_counters())
        stats = counters.stats()
        yield Step(tokens=(), text="", pieces=(), drafted=stats.drafted, accepted=stats.accepted, from_draft=(),
                   draft_seconds=0.0, verify_seconds=0.0, stats=stats, finish_reason=stats.finish_reason)

    def _field(self, chunk_field: str, value: Any, *kinds: type, optional: bool = True) -> Any:
        """`value` when it is one of `kinds` (None too when optional; bools are not numbers), else a one-line
        RemoteError naming the field."""
        if (value is None and optional) or (isinstance(value, kinds) and not isinstance(value, bool)):
            return value
        shown = repr(value)[:40]
        wanted = " or ".join(k.__name__ for k in kinds)
        raise RemoteError(f"the engine at {self.url} sent a stream chunk whose {chunk_field} is {shown}, not {wanted}",
                          hint="the server is not speaking OpenAI's streaming format; the text so far was kept")

    def _request_spec(self, holder: dict[str, Any]) -> dict[str, Any] | None:
        """This request's own speculative statistics, `metrics.speculative_decoding` of the final chunk or of its
        usage (dflash-cli serve sends both; vLLM with per-request metrics the first), checked field by field;
        None when the server sends none."""
        where = "usage.metrics" if "prompt_tokens" in holder else "metrics"
        metrics = self._field(where, holder.get("metrics"), dict)
        spec = self._field(f"{where}.speculative_decoding", (metrics or {}).get("speculative_decoding"), dict)
        if spec is None:
            return None
        for key in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "block_size",
                    "num_spec_tokens"):
            self._field(f"{where}.speculative_decoding.{key}", spec.get(key), int)
        for key in ("num_accepted_tokens_per_pos", "acceptance_histogram"):
            for n in self._field(f"{where}.speculative_decoding.{key}", spec.get(key), list) or []:
                self._field(f"{where}.speculative_decoding.{key}[i]", n, int, optional=False)
        return spec

    def _reasoning(self, delta: dict[str, Any]) -> str:
        """The reasoning a server's reasoning parser sends apart: `reasoning` (vLLM 0.11 and later) or
        `reasoning_content` (older vLLM, SGLang)."""
        for name in ("reasoning", "reasoning_content"):
            value = self._field(f"choices[i].delta.{name}", delta.get(name), str)
            if value:
                return value
        return ""

    def _chunk(self, data: str, counters: Counters) -> Step | None:
        try:
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise RemoteError(f"the engine at {self.url} sent a malformed stream chunk ({e}): {data[:80]!r}",
                              hint="the server is not speaking OpenAI's streaming format") from None
        if "error" in chunk:  # an error in the middle of a stream
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise RemoteError(f"the engine at {self.url} failed mid-reply: {message}",
                              hint="the server's log has the cause; the text received so far was kept")
        usage = self._field("usage", chunk.get("usage"), dict)
        if usage is not None:
            prompt = self._field("usage.prompt_tokens", usage.get("prompt_tokens"), int)
            counters.prompt_tokens = prompt or counters.prompt_tokens
            completion = self._field("usage.completion_tokens", usage.get("completion_tokens"), int)
            if completion is not None:
                counters.completion_tokens = completion
            counters.request_spec = self._request_spec(usage) or counters.request_spec
        if usage is not None or chunk.get("choices") == []:  # the final chunk: vLLM puts them at the top level
            counters.request_spec = self._request_spec(chunk) or counters.request_spec
        meta = find_meta_info(chunk)
        if meta is not None:
            for key, value in meta.items():
                if key.startswith("spec_") and not isinstance(value, dict):
                    self._field(f"meta_info.{key}", value, int, float)
            counters.meta = meta
        text = ""
        for choice in self._field("choices", chunk.get("choices"), list) or []:
            self._field("choices[i]", choice, dict, optional=False)
            delta = self._field("choices[i].delta", choice.get("delta"), dict) or {}
            content = self._field("choices[i].delta.content", delta.get("content"), str) or ""
            text += _with_reasoning(counters, self._reasoning(delta), content)
            finish = self._field("choices[i].finish_reason", choice.get("finish_reason"), str)
            if finish:
                counters.finish_reason = finish
        if not text:
            return None
        now = time.perf_counter()
        counters.first_at = counters.first_at or now
        counters.last_at = now
        counters.chunks += 1
        stats = counters.stats(final=False)
        return Step(tokens=(), text=text, pieces=(text,), drafted=0, accepted=0, from_draft=(False,),
                    draft_seconds=0.0, verify_seconds=0.0, stats=stats)


def _with_reasoning(counters: Counters, reasoning: str, content: str) -> str:
    """The text of one delta: reasoning sent apart goes back between <think> tags, as the model wrote it, so
    it is shown, hidden and split like a local model's. A lone UTF-16 surrogate (JSON "\\ud800" with no
    pair) cannot be printed or saved: U+FFFD instead."""
    text = ""
    if reasoning:
        if not counters.reasoning:
            text += "<think>" if reasoning.startswith("\n") else "<think>\n"
            counters.reasoning = True
        text += reasoning
    if content and counters.reasoning:
        text += "</think>" if content.startswith("\n") else "</think>\n\n"
        counters.reasoning = False
    return _LONE_SURROGATE.sub("\ufffd", text + content)


@dataclass
class RemoteConversation(ChatHistory):
    """A chat answered by a remote engine (the server applies its own chat template)."""

    runtime: RemoteRuntime

    def _respond(self, settings: Any) -> Iterator[Step]:
        # The server's chat template is not known here: a reply that opens with <think> (Qwen3, DeepSeek-R1
        # without the server's reasoning parser) is told apart as for a local model, anything else is answer.
        self.reply_in_thinking = False
        sent = ([{"role": "system", "content": self.system}] if self.system else []) + list(self.messages)
        return self._kept(self.runtime.stream_chat(sent, settings))

    def save(self, path: Any, settings: Any) -> None:
        from pathlib import Path

        self._write(Path(path), {"model": self.runtime.model, "engine": self.runtime.url, "drafter": None},
                    vars(settings))
