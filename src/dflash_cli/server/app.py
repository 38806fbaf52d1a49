"""The HTTP side of `dflash-cli serve`: an OpenAI-compatible Starlette app over server/worker.EngineWorker.

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events, or whole),
GET /v1/models, /health and /metrics (Prometheus text, with vLLM's speculative counter names). A streamed
request waits for its first event before the response starts, so a request the engine refuses (a prompt
longer than the context) still gets a status and an error object; a client that goes away cancels its
request, which the engine stops at its next step.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_cli.conversation import GenerationSettings
from dflash_cli.engine.errors import DFlashError
from dflash_cli.engine.text import THINK_TAGS, ThinkingMarkers
from dflash_cli.engine.thinking import ReasoningStream, ThinkingSplitter, split_reply
from dflash_cli.server.protocol import (
    ApiError,
    ParsedRequest,
    ResponseShape,
    finish_reason,
    live_metrics,
    parse_request,
    read_body,
    timings,
    usage,
)
from dflash_cli.server.tools import ForcedCallStream, read_calls
from dflash_cli.server.worker import EngineWorker, ServerStopping
from dflash_cli.server.worker import Request as EngineRequest

MAX_BODY_BYTES = 4 << 20


class ServerState:
    """What the routes share: the worker, the served model's name, the key, the generation defaults (the
    command line's settings, which a request may override), the most new tokens a request may ask for, and
    the system prompt for chats that bring none."""

    def __init__(self, worker: EngineWorker, model: str, *, api_key: str | None, defaults: GenerationSettings,
                 max_tokens_cap: int, system: str | None = None):
        self.worker, self.model, self.api_key = worker, model, api_key
        self.defaults, self.max_tokens_cap, self.system = defaults, max_tokens_cap, system
        self.started = int(time.time())
        # prompts are encoded on worker threads (off the event loop), one at a time: a fast tokenizer's
        # truncation and padding settings are state that concurrent calls can trip over
        self.encoding = threading.Lock()

    @functools.cached_property
    def markers(self) -> ThinkingMarkers | None:
        """How the served model marks its reasoning (None: it has no reasoning sections)."""
        from dflash_cli.engine.text import thinking_markers

        return thinking_markers(self.worker.runtime.tokenizer)


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def read_body_bytes(request: Request) -> bytes:
    """The body, refused with a 413 as soon as it grows past MAX_BODY_BYTES (before any of it is parsed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
    return bytes(body)


def check_key(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode(), state.api_key.encode()):
        raise ApiError(401, "a valid API key is needed: 'Authorization: Bearer KEY'", kind="authentication_error",
                       code="invalid_api_key")


def prompt_ids(state: ServerState, parsed: ParsedRequest) -> tuple[list[int], bool]:
    """The prompt's token ids, and whether the reply starts inside a reasoning section the template opened."""
    from dflash_cli.engine.text import chat_template_of, encode_prompt, opens_thinking
    from dflash_cli.server.tools import template_takes_tools

    tokenizer = state.worker.runtime.tokenizer
    if isinstance(parsed.prompt, list):
        return parsed.prompt, False
    if not parsed.chat:
        assert isinstance(parsed.prompt, str)
        return encode_prompt(tokenizer, parsed.prompt, chat_template=False), False
    assert parsed.messages is not None
    own_system = any(m["role"] == "system" for m in parsed.messages)
    if parsed.tools is not None and not template_takes_tools(chat_template_of(tokenizer)):
        raise ApiError(400, f"{state.model}'s chat template does not take tools in the <tool_call> format this "
                            "server reads (Qwen2.5, Qwen3 and Qwen3.5 templates do)", param="tools")
    ids = encode_prompt(tokenizer, parsed.messages, chat_template=parsed.settings.chat_template,
                        enable_thinking=parsed.settings.thinking,
                        system=None if own_system else state.system,
                        tools=parsed.tools.tools if parsed.tools is not None else None)
    inside = state.markers is not None and opens_thinking(tokenizer, ids, state.markers)
    return ids, inside


async def completions(request: Request, *, chat: bool) -> Response:
    state: ServerState = request.app.state.server
    try:
        check_key(state, request)
        body = read_body(await read_body_bytes(request), chat=chat)
        if body.model not in (None, state.model):
            raise ApiError(404, f"the model {body.model!r} is not served here (this server serves "
                                f"{state.model!r})", param="model", code="model_not_found")
        parsed = parse_request(body, defaults=state.defaults, max_tokens_cap=state.max_tokens_cap)
        ids, inside = await run_in_threadpool(encoded, state, parsed)  # a long prompt takes a while
    except ApiError as e:
        return error_response(e)
    except ClientDisconnect:
        return Response(status_code=499)
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    job = EngineRequest(ids, parsed.settings, lambda event: None, stop=parsed.stop)
    job.on_event = deliver(asyncio.get_running_loop(), events, job)
    if not state.worker.submit(job):
        return error_response(ApiError(503, "the server is busy: too many requests are waiting",
                                       kind="server_error", code="queue_full"))
    watcher = asyncio.create_task(watch_disconnect(request, job))

    def aborted() -> bool:  # the server's stop cut this reply short
        return state.worker.stopping and job.cancelled.is_set()
    markers = state.markers or THINK_TAGS  # a model without reasoning sections: a reply opening <think> is split
    try:
        first = await next_event(events, parsed)
        if parsed.stream:  # from here the streaming response watches the connection itself
            watcher.cancel()
            return StreamingResponse(stream(ResponseShape(chat, state.model), parsed, events, first, job, inside,
                                            markers, aborted), media_type="text/event-stream")
        return await whole_reply(ResponseShape(chat, state.model), events, first, parsed, inside and chat, markers,
                                 aborted)
    except ApiError as e:
        return error_response(e)
    except asyncio.CancelledError:  # the server is shutting down, or the connection was dropped
        job.cancelled.set()
        raise
    finally:
        watcher.cancel()


def deliver(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, job: EngineRequest):
    """The worker thread's callback for one request: hands events to its handler's loop; a loop that is
    gone (the server stopped) cancels the request instead of failing on the worker thread."""
    def on_event(event: tuple[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:
            job.cancelled.set()
    return on_event


async def watch_disconnect(request: Request, job: EngineRequest) -> None:
    """Cancels the request when its client disconnects (the body is read: the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancelled.set()
            return


def encoded(state: ServerState, parsed: ParsedRequest) -> tuple[list[int], bool]:
    """prompt_ids (run on a worker thread), with a chat template's own refusal (roles out of order, no user
    turn) as a 400."""
    try:
        with state.encoding:
            return prompt_ids(state, parsed)
    except ApiError:
        raise
    except Exception as e:  # templates raise what they like (jinja2's errors, TypeError, ...)
        raise ApiError(400, f"the prompt cannot be built: {type(e).__name__}: {e}",
                       param="messages" if parsed.chat else "prompt") from None


async def next_event(events: asyncio.Queue, parsed: ParsedRequest) -> tuple[str, Any]:
    """The engine's next event; an error event becomes an ApiError."""
    event = await events.get()
    if event[0] == "error":
        error = event[1]
        if isinstance(error, DFlashError):
            if str(error).startswith("the prompt has"):  # longer than the context
                raise ApiError(400, str(error), param="messages" if parsed.chat else "prompt",
                               code="context_length_exceeded")
            hint = f" ({error.hint})" if getattr(error, "hint", None) else ""
            raise ApiError(400, f"{error}{hint}")
        if isinstance(error, ServerStopping):
            raise ApiError(503, str(error), kind="server_error", code="shutting_down")
        raise ApiError(500, f"the engine failed: {type(error).__name__}: {error}", kind="server_error")
    return event


async def whole_reply(shape: ResponseShape, events: asyncio.Queue, event: tuple[str, Any], parsed: ParsedRequest,
                      inside: bool, markers: ThinkingMarkers = THINK_TAGS, aborted: Any = lambda: False) -> Response:
    text: list[str] = []
    stopped, last = False, None
    while event[0] == "step":
        step, piece, stop = event[1]
        text.append(piece)
        stopped, last = stopped or stop is not None, step
        event = await next_event(events, parsed)
    done_step, rest, _ = event[1]
    last = done_step or last
    aborted = aborted()
    text.append(rest)
    reply = "".join(text)
    reasoning, answer = split_reply(reply, inside, markers) if shape.chat else (None, reply)
    content, calls = tool_calls_of(parsed, answer)
    stats = last.stats if last is not None else None
    reason = finish_reason(stats.finish_reason if stats else None, stopped, bool(calls), aborted)
    return JSONResponse(shape.whole(content, reasoning, reason, usage(stats), calls, timings(stats)))


def tool_calls_of(parsed: ParsedRequest, answer: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the content, the tool calls) of a reply to a request with tools (server/tools.py)."""
    if parsed.tools is None or not parsed.tools.reads_calls:
        return answer, []
    return read_calls(answer, parsed.tools.names())


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def stream(shape: ResponseShape, parsed: ParsedRequest, events: asyncio.Queue, event: tuple[str, Any],
                 job: EngineRequest, inside: bool, markers: ThinkingMarkers = THINK_TAGS,
                 aborted: Any = lambda: False) -> AsyncIterator[bytes]:
    """The reply as server-sent events; leaving early (the client went away) cancels the request."""
    splitter = ThinkingSplitter(inside, markers) if shape.chat else None
    reasoning_text = ReasoningStream(markers)
    stopped, last = False, None
    # a forced call streams as it is written; a reply that may hold calls (auto) is read whole, its content
    # sent with them at the end
    forced = ForcedCallStream() if parsed.tools is not None and parsed.tools.forced else None
    held: list[str] | None = [] if parsed.tools is not None and parsed.tools.reads_calls and not forced else None
    try:
        if shape.chat:
            yield sse(shape.chunk(role=True))
        while True:
            kind, payload = event
            if kind == "step":
                step, text, stop = payload
                stopped, last = stopped or stop is not None, step
                metrics = live_metrics(step.stats)
            else:
                done_step, text, _ = payload
                last, metrics = done_step or last, None
            for reasoning, piece in (splitter.feed(text) if splitter else [(False, text)]):
                piece = reasoning_text.feed(piece) if reasoning else piece
                if held is not None and not reasoning:
                    held.append(piece)
                    piece = ""
                if forced is not None and not reasoning:
                    for delta in forced.feed(piece):
                        yield sse(shape.chunk(tool_calls=[delta]))
                    piece = ""
                if piece or metrics is not None:
                    yield sse(shape.chunk(piece, reasoning=reasoning, metrics=metrics))
            if kind == "done":
                break
            event = await next_event(events, parsed)
        for reasoning, piece in (splitter.flush() if splitter else []):
            piece = reasoning_text.feed(piece) if reasoning else piece
            if held is not None and not reasoning:
                held.append(piece)
            elif piece:
                yield sse(shape.chunk(piece, reasoning=reasoning))
        calls: list[dict[str, Any]] = forced.calls if forced is not None else []
        if held is not None:
            content, calls = tool_calls_of(parsed, "".join(held))
            if content or calls:
                yield sse(shape.chunk(content or "", tool_calls=[{"index": i, **c} for i, c in enumerate(calls)]))
        stats = last.stats if last is not None else None
        yield sse(shape.chunk(reason=finish_reason(stats.finish_reason if stats else None, stopped, bool(calls),
                                                   aborted()), times=timings(stats)))
        if parsed.include_usage:
            yield sse(shape.usage_chunk(usage(stats)))
        yield b"data: [DONE]\n\n"
    except ApiError as e:  # the engine failed after the reply started: the error as the last event
        yield sse(e.body())
    finally:
        job.cancelled.set()  # a no-op after the last step; stops the engine when the client left early


async def chat_completions(request: Request) -> Response:
    return await completions(request, chat=True)


async def text_completions(request: Request) -> Response:
    return await completions(request, chat=False)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        check_key(state, request)
    except ApiError as e:
        return error_response(e)
    return JSONResponse({"object": "list", "data": [{"id": state.model, "object": "model",
                                                     "created": state.started, "owned_by": "dflash-cli"}]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    worker = state.worker
    with worker.lock:
        c = worker.counters
        label = 'model_name="' + state.model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        lines = [
            ("dflash_requests_total", c.requests), ("dflash_requests_failed_total", c.failed),
            ("dflash_requests_cancelled_total", c.cancelled), ("vllm:num_requests_waiting", worker.queue.qsize()),
            ("vllm:num_requests_running", int(worker.busy)), ("vllm:prompt_tokens_total", c.prompt_tokens),
            ("dflash_prefilled_tokens_total", c.prefilled_tokens),
            ("vllm:generation_tokens_total", c.generated_tokens), ("vllm:spec_decode_num_drafts_total", c.drafts),
            ("vllm:spec_decode_num_draft_tokens_total", c.draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens_total", c.accepted_tokens),
        ]
        text = [f"{name}{{{label}}} {value}" for name, value in lines]
        text += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{k}"}} {n}'
                 for k, n in enumerate(c.accepted_per_position)]
    return PlainTextResponse("\n".join(text) + "\n", media_type="text/plain; version=0.0.4")


def make_app(state: ServerState) -> Starlette:
    app = Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.server = state
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(404, f"no route {request.url.path}", code="not_found"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))
