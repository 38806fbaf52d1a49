"""OpenAI-style requests checked and turned into engine settings, and the response bodies `serve` sends.

Every refusal is an `ApiError` that becomes an OpenAI error object, `{"error": {"message", "type", "param",
"code"}}`, with its HTTP status. The statistics of a reply go in `usage.metrics.speculative_decoding` with
vLLM's per-request field names (see README, "Using it from other programs").
"""

from __future__ import annotations

import json
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
from dflash_cli.server.requests import (
    ChatRequest,
    CompletionRequest,
    Message,
    RequestError,
    ResponseFormat,
    StructuredOutputs,
    read_request,
)
from dflash_cli.server.tools import ToolError, ToolRequest, tool_request

UNSUPPORTED = ("functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
               "suffix", "echo", "best_of")
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}  # refused unless so


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


def read_body(raw: bytes, *, chat: bool) -> ChatRequest | CompletionRequest:
    """The request in a body's JSON text, or a 400 naming the first field that is wrong (server/requests.py)."""
    try:
        return read_request(raw, chat=chat)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param) from None


def parse_request(request: ChatRequest | CompletionRequest, *, defaults: GenerationSettings,
                  max_tokens_cap: int) -> ParsedRequest:
    """Turns a request into engine settings: `defaults` are the server's own, what the server cannot do is a
    422, and no request may ask for more than `max_tokens_cap` new tokens."""
    for name in UNSUPPORTED:
        if getattr(request, name) not in (None, False, [], {}):
            raise ApiError(422, f"'{name}' is not supported by this server yet", param=name, code="unsupported")
    if request.n != 1:
        raise ApiError(422, "'n' > 1 is not supported by this server yet", param="n", code="unsupported")
    for name, neutral in PENALTIES.items():
        if getattr(request, name) != neutral:
            raise ApiError(422, f"'{name}' is not supported by this server yet: decoding is lossless, only "
                                "temperature, top_p and top_k shape it", param=name, code="unsupported")
    name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    limit = getattr(request, name)
    if limit is not None and limit > max_tokens_cap:
        raise ApiError(400, f"'{name}' must be at most {max_tokens_cap} on this server, got {limit}", param=name)
    settings = replace(
        defaults, max_tokens=defaults.max_tokens if limit is None else limit,
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        top_k=defaults.top_k if request.top_k is None else max(request.top_k, 0),  # -1: off
        seed=defaults.seed if request.seed is None else request.seed)
    stops = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    if not isinstance(request, ChatRequest):
        prompt = request.prompt[0] if isinstance(request.prompt, list) and isinstance(request.prompt[0], str) \
            else request.prompt
        return ParsedRequest(False, None, prompt, settings, stops, request.stream, include_usage)
    kwargs = request.chat_template_kwargs
    if kwargs is not None and kwargs.enable_thinking is not None:
        settings = replace(settings, think=kwargs.enable_thinking)
    try:
        tools = tool_request(request)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    fmt = _output_format(request, tools)
    if fmt is not None:
        if settings.think:
            raise ApiError(400, "a structured reply cannot also think first: set enable_thinking to false (or "
                                "leave it out)", param="chat_template_kwargs")
        settings = replace(settings, output_format=fmt)
    return ParsedRequest(True, [_message(m) for m in request.messages], None, settings, stops, request.stream,
                         include_usage, tools)


def _message(message: Message) -> dict[str, Any]:
    """A message as the chat template takes it: text content, and a tool-using turn's fields."""
    kept: dict[str, Any] = {"role": message.role, "content": message.text()}
    for key in ("tool_calls", "tool_call_id", "name"):
        if getattr(message, key) is not None:
            kept[key] = getattr(message, key)
    return kept


def _output_format(request: ChatRequest, tools: ToolRequest | None) -> OutputFormat | None:
    """What the reply must follow: response_format (OpenAI's json_object and json_schema), vLLM's
    structured_outputs (json, regex, grammar, choice), or a forced tool call; each checked now."""
    if request.response_format is not None and request.structured_outputs is not None:
        raise ApiError(400, "give 'response_format' or 'structured_outputs', not both", param="structured_outputs")
    fmt, param = None, None
    if request.response_format is not None:
        fmt, param = _response_format(request.response_format), "response_format.json_schema.schema"
    elif request.structured_outputs is not None:
        fmt, param = _structured_outputs(request.structured_outputs)
    if tools is not None and tools.forced:
        if fmt is not None:
            raise ApiError(400, "a forced tool call cannot also follow a response format", param="tool_choice")
        fmt, param = tools.output_format(), "tool_choice"
    if fmt is not None:
        try:
            fmt.grammar()
        except OutputFormatError as e:
            raise ApiError(400, str(e) + (f" ({e.hint})" if e.hint else ""), param=param) from None
    return fmt


def _response_format(value: ResponseFormat) -> OutputFormat | None:
    if value.type == "text":
        return None
    if value.type == "json_object":
        return json_format(object_only=True)
    spec = value.json_schema
    assert spec is not None  # ResponseFormat requires it for json_schema
    schema = spec.schema_
    return _checked(lambda: schema_format(schema, spec.name or ""), "response_format.json_schema.schema")


def _structured_outputs(value: StructuredOutputs) -> tuple[OutputFormat, str]:
    """vLLM's `structured_outputs`: one of json (a schema), regex, grammar (Lark or GBNF), choice (strings);
    and the field, for the 400 of one that does not compile."""
    if value.json_ is not None:
        schema = value.json_
        where = "structured_outputs.json"
        return _checked(lambda: schema_format(schema, where), where), where
    if value.choice is not None:
        choices = " | ".join(json.dumps(c) for c in value.choice)
        return OutputFormat("grammar", f"start: {choices}\n", "(choice)"), "structured_outputs.choice"
    if value.regex is not None:
        return regex_format(value.regex), "structured_outputs.regex"
    assert value.grammar is not None  # StructuredOutputs holds exactly one
    return OutputFormat("grammar", value.grammar, "structured_outputs.grammar"), "structured_outputs.grammar"


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
