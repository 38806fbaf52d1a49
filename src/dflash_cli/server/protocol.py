"""OpenAI-style requests checked and turned into engine settings, and the response bodies `serve` sends.

Every refusal is an `ApiError` that becomes an OpenAI error object, `{"error": {"message", "type", "param",
"code"}}`, with its HTTP status. The statistics of a reply go in `usage.metrics.speculative_decoding` with
vLLM's per-request field names (see README, "Using it from other programs").
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from dflash_cli.conversation import GenerationSettings
from dflash_cli.engine.output_format import (
    OutputFormat,
    OutputFormatError,
    json_format,
    regex_format,
    schema_format,
)
from dflash_cli.engine.response import FINISH_STOP, GenerationStats
from dflash_cli.server.tools import ToolError, ToolRequest, parse_tools

UNSUPPORTED = ("functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
               "suffix", "echo", "best_of")
ROLES = ("system", "developer", "user", "assistant", "tool")
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # refused unless neutral


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    chat: bool
    messages: list[dict[str, str]] | None
    prompt: str | list[int] | None
    settings: GenerationSettings  # the server's defaults with what the request sets
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    tools: ToolRequest | None = None


def _number(body: dict, name: str, low: float, high: float, default: Any, *, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (not integer and not math.isfinite(value)):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}", param=name)
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low:g} and {high:g}, got {value}", param=name)
    return value


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        if message["role"] not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, not {message['role']!r}",
                           param="messages")
        content = message.get("content")
        if content is None and message["role"] == "assistant":  # a turn that only called tools
            content = ""
        if content is None:
            raise ApiError(400, f"messages[{i}].content must be a string (only an assistant's may be null)",
                           param="messages")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        kept: dict[str, Any] = {"role": message["role"], "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):  # a tool-using turn, for the chat template
            if message.get(key) is not None:
                kept[key] = message[key]
        out.append(kept)
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a non-empty string (or one string, or a list of token ids)", param="prompt")


def parse_request(body: Any, *, chat: bool, defaults: GenerationSettings, max_tokens_cap: int) -> ParsedRequest:
    """Checks a request body against what `serve` supports; `defaults` are the server's own settings, and no
    request may ask for more than `max_tokens_cap` new tokens."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise ApiError(422, f"'{name}' is not supported by this server yet", param=name, code="unsupported")
    if _number(body, "n", 1, 1_000_000, 1, integer=True) != 1:
        raise ApiError(422, "'n' > 1 is not supported by this server yet", param="n", code="unsupported")
    for name in PENALTIES:
        neutral = 1.0 if name == "repetition_penalty" else 0.0
        if _number(body, name, -2, 2 if neutral == 0.0 else 10, neutral) != neutral:
            raise ApiError(422, f"'{name}' is not supported by this server yet: decoding is lossless, only "
                                "temperature, top_p and top_k shape it", param=name, code="unsupported")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(name)
    settings = replace(
        defaults,
        max_tokens=_number({name: limit}, name, 1, max_tokens_cap, defaults.max_tokens, integer=True),
        temperature=float(_number(body, "temperature", 0, 2, defaults.temperature)),
        top_p=float(_number(body, "top_p", 1e-9, 1, defaults.top_p)),
        top_k=max(_number(body, "top_k", -1, 1 << 31, defaults.top_k, integer=True), 0),  # -1: off
        seed=_number(body, "seed", -(1 << 63), (1 << 63) - 1, defaults.seed, integer=True))
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
    if stop is not None and (not isinstance(stop, (str, list)) or not all(isinstance(s, str) for s in stops)
                             or len(stops) > 4):
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
    stream = body.get("stream", False)
    stream_options = body.get("stream_options") or {}
    kwargs = body.get("chat_template_kwargs") or {}
    for name, value, kind in (("stream", stream, bool), ("stream_options", stream_options, dict),
                              ("chat_template_kwargs", kwargs, dict)):
        if not isinstance(value, kind):
            raise ApiError(400, f"'{name}' must be {'a boolean' if kind is bool else 'an object'}", param=name)
    if not isinstance(stream_options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ApiError(400, "'chat_template_kwargs.enable_thinking' must be a boolean", param="chat_template_kwargs")
    if thinking is not None:
        settings = replace(settings, think=thinking)
    try:
        tools = parse_tools(body) if chat else None
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    fmt = _output_format(body, tools)
    if fmt is not None:
        if settings.think:
            raise ApiError(400, "a structured reply cannot also think first: set enable_thinking to false (or "
                                "leave it out)", param="chat_template_kwargs")
        settings = replace(settings, output_format=fmt)
    return ParsedRequest(chat, _messages(body) if chat else None, None if chat else _prompt(body), settings,
                         stops, stream, bool(stream_options.get("include_usage")), tools)


def _output_format(body: dict, tools: ToolRequest | None) -> OutputFormat | None:
    """What the reply must follow: response_format (OpenAI's json_object and json_schema), vLLM's
    structured_outputs (json, regex, grammar, choice), or a forced tool call; each checked now."""
    given = [name for name in ("response_format", "structured_outputs") if body.get(name) not in (None, {})]
    fmt = None
    if "response_format" in given:
        fmt = _response_format(body["response_format"])
    if "structured_outputs" in given:
        fmt = _structured_outputs(body["structured_outputs"])
        given = given if fmt is not None else given[:1]
    if tools is not None and tools.forced:
        if fmt is not None:
            raise ApiError(400, "a forced tool call cannot also follow a response format", param="tool_choice")
        fmt, given = tools.output_format(), ["tool_choice"]
    if len(given) > 1 and fmt is not None:
        raise ApiError(400, "give 'response_format' or 'structured_outputs', not both", param="structured_outputs")
    if fmt is not None:
        try:
            fmt.grammar()
        except OutputFormatError as e:
            raise ApiError(400, str(e) + (f" ({e.hint})" if e.hint else ""), param=given[0]) from None
    return fmt


def _response_format(value: Any) -> OutputFormat | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_format(object_only=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "'response_format.json_schema.schema' must be a JSON Schema object",
                           param="response_format")
        return _checked(lambda: schema_format(schema, str(spec.get("name") or "")), "response_format")
    raise ApiError(400, "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"",
                   param="response_format")


def _structured_outputs(value: Any) -> OutputFormat | None:
    """vLLM's `structured_outputs`: one of json (a schema), regex, grammar (Lark or GBNF), choice (strings)."""
    keys = [k for k in ("json", "regex", "grammar", "choice") if isinstance(value, dict) and value.get(k) is not None]
    if len(keys) != 1:
        raise ApiError(400, "'structured_outputs' must set one of json, regex, grammar or choice",
                       param="structured_outputs")
    item = value[keys[0]]
    if keys[0] == "json":
        if not isinstance(item, (dict, str)):
            raise ApiError(400, "'structured_outputs.json' must be a JSON Schema", param="structured_outputs")
        return _checked(lambda: schema_format(item, "structured_outputs.json"), "structured_outputs")
    if keys[0] == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item):
            raise ApiError(400, "'structured_outputs.choice' must be a non-empty list of strings",
                           param="structured_outputs")
        return OutputFormat("grammar", "start: " + " | ".join(json.dumps(c) for c in item) + "\n", "(choice)")
    if not isinstance(item, str) or not item:
        raise ApiError(400, f"'structured_outputs.{keys[0]}' must be a non-empty string", param="structured_outputs")
    return regex_format(item) if keys[0] == "regex" else OutputFormat("grammar", item, "structured_outputs.grammar")


def _checked(make: Any, param: str) -> OutputFormat:
    try:
        return make()
    except OutputFormatError as e:
        raise ApiError(400, str(e), param=param) from None


def finish_reason(engine_reason: str | None, stopped_by_string: bool, tool_calls: bool = False,
                  aborted: bool = False) -> str:
    """OpenAI's finish_reason; "abort" (vLLM's word) for a reply the server's own stop cut short."""
    if tool_calls:
        return "tool_calls"
    if aborted and engine_reason is None and not stopped_by_string:
        return "abort"
    return "stop" if stopped_by_string or engine_reason == FINISH_STOP else "length"


def speculative_metrics(stats: GenerationStats) -> dict[str, Any]:
    """A reply's statistics under vLLM's per-request names (tau counts the bonus token, as ours does)."""
    return {
        "mean_acceptance_length": round(stats.acceptance_length, 4),
        "draft_acceptance_rate": round(stats.draft_acceptance, 4),
        "num_spec_steps": stats.steps,
        "num_draft_tokens": stats.drafted,
        "num_accepted_draft_tokens": stats.accepted,
        "num_accepted_tokens_per_pos": list(stats.position_accepted),
        "acceptance_rate_per_pos": [round(r, 4) for r in stats.per_position_acceptance],
        "block_size": stats.block_size,
        "paused_steps": stats.block_rounds[0] if stats.block_rounds else 0,
        "pause_reason": stats.pause_reason or None,
    }


def usage(stats: GenerationStats | None) -> dict[str, Any]:
    """completion_tokens: the reply's tokens, up to the one that completed a stop string (worker._cut); the
    speculative metrics count every verify step as the engine ran it, as vLLM's per-request ones do."""
    if stats is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.prefilled_tokens},
        "metrics": {"speculative_decoding": speculative_metrics(stats),
                    "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2),
                    "time_to_first_token_seconds": round(stats.time_to_first_token, 4)},
    }


def timings(stats: GenerationStats | None) -> dict[str, Any]:
    """llama-server's `timings` object (clients written for llama.cpp read acceptance from draft_n and
    draft_n_accepted), with the verify steps it lacks as draft_steps. The prompt figures count only the
    tokens read now (cache_n were reused)."""
    if stats is None:
        return {}
    prompt_ms, predicted_ms = stats.prefill_seconds * 1e3, stats.decode_seconds * 1e3
    prompt_n, predicted_n = stats.prefilled_tokens, stats.decode_tokens
    return {
        "cache_n": stats.prompt_tokens - stats.prefilled_tokens,
        "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
        "prompt_per_second": round(prompt_n / prompt_ms * 1e3, 2) if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / predicted_n, 3) if predicted_n else 0.0,
        "predicted_per_second": round(predicted_n / predicted_ms * 1e3, 2) if predicted_ms > 0 else 0.0,
        "draft_n": stats.drafted, "draft_n_accepted": stats.accepted, "draft_steps": stats.steps,
    }


def live_metrics(stats: GenerationStats) -> dict[str, Any]:
    """The running acceptance each streamed chunk carries, so a client can show it as it grows."""
    return {"speculative_decoding": {"mean_acceptance_length": round(stats.acceptance_length, 4),
                                     "num_spec_steps": stats.steps, "num_draft_tokens": stats.drafted,
                                     "num_accepted_draft_tokens": stats.accepted}}


class ResponseShape:
    """The ids, object names and choice bodies of one reply (chat.completion or text_completion)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, answer: str | None, reasoning: str | None, reason: str, use: dict[str, Any],
              tool_calls: list[dict[str, Any]] | None = None, times: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": answer}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": answer, "finish_reason": reason, "logprobs": None}
        return {**self.envelope(False), "choices": [choice], "usage": use, **self._metrics(use),
                **({"timings": times} if times else {})}

    def chunk(self, text: str = "", *, reasoning: bool = False, reason: str | None = None, role: bool = False,
              metrics: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None,
              times: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or role:
                delta["reasoning_content" if reasoning else "content"] = text
            if tool_calls:  # deltas, each with its call's "index"
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        out = {**self.envelope(True), "choices": [choice]}
        if metrics is not None:
            out["metrics"] = metrics
        if times:
            out["timings"] = times
        return out

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        return {**self.envelope(True), "choices": [], "usage": use, **self._metrics(use)}

    @staticmethod
    def _metrics(use: dict[str, Any]) -> dict[str, Any]:
        """The statistics also at the top level, where vLLM's per-request metrics put them."""
        return {"metrics": use["metrics"]} if "metrics" in use else {}
