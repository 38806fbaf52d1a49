"""One engine, many clients: the worker thread that decodes requests one at a time for `dflash-cli serve`.

Requests wait in a bounded queue (`submit` refuses past it). The worker keeps one DecodeState for every
request, so a request whose prompt extends the previous prompt and reply (a chat client's next turn) reads
only the new tokens. Each request gets its events through `on_event` (called on the worker thread); a
cancelled request (its client went away) stops at the next step. `Counters` adds every request up for
/metrics, under vLLM's names where they exist. Nothing here knows HTTP (server/app.py does).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dflash_cli.conversation import GenerationSettings
from dflash_cli.engine.response import GenerationStats, Step

if TYPE_CHECKING:
    from dflash_cli.runtime.local import LocalRuntime


class ServerStopping(RuntimeError):
    """The server stopped before a waiting request began."""


@dataclass
class Request:
    """A prompt to decode and where its Steps go: on_event(("step", Step)), then ("done", Step | None) or
    ("error", exception). `stop` strings end the reply before they appear (the text up to them is kept);
    the Step then counts the tokens up to the one that completed the stop string, not the rest of its
    verify step."""

    prompt: list[int]
    settings: GenerationSettings
    on_event: Callable[[tuple[str, Any]], None]
    stop: tuple[str, ...] = ()
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Counters:
    """Totals since the server started (Prometheus counters; read under the lock)."""

    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    drafts: int = 0  # verify steps that had drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, stats: GenerationStats) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.prefilled_tokens += stats.prefilled_tokens
        self.generated_tokens += stats.generated_tokens
        self.drafts += sum(stats.block_rounds[1:])  # rounds of 2+ slots: the ones that drafted
        self.draft_tokens += stats.drafted
        self.accepted_tokens += stats.accepted
        if len(self.accepted_per_position) < len(stats.position_accepted):
            self.accepted_per_position += [0] * (len(stats.position_accepted) - len(self.accepted_per_position))
        for k, n in enumerate(stats.position_accepted):
            self.accepted_per_position[k] += n


class StopMatcher:
    """Cuts streamed text before the first of the stop strings, holding back what may begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that is safe to send now, whether a stop string was found)."""
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out, False
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.held = self.held[: min(hits)], ""
            return out, True
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.held.endswith(s[:n])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class EngineWorker:
    """Decodes queued Requests on one thread, through one DecodeState (see the module docstring)."""

    def __init__(self, runtime: LocalRuntime, max_queue: int = 16):
        from dflash_cli.engine.state import DecodeState

        self.runtime = runtime
        self.state = DecodeState(runtime.target, runtime.drafter)
        self.queue: queue.Queue[Request | None] = queue.Queue(maxsize=max_queue)
        self.counters = Counters()
        self.lock = threading.Lock()
        self.busy = False
        self.stopping = False  # abort() was called: replies cut short now end with finish_reason "abort"
        self.current: Request | None = None
        self.thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)

    def start(self) -> EngineWorker:
        self.thread.start()
        return self

    def abort(self) -> None:
        """The server is stopping: the running request ends at its next step (its reply so far is sent, with
        finish_reason "abort"), and what waits is refused (503). Safe from a signal handler: it only sets
        flags and empties the queue."""
        self.stopping = True
        current = self.current
        if current is not None:
            current.cancelled.set()
        while True:
            try:
                waiting = self.queue.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                waiting.cancelled.set()
                _tell(waiting, ("error", ServerStopping("the server is shutting down")))

    def stop(self) -> None:
        """Cancels the running request and what waits; the thread ends after the current step."""
        self.abort()
        self.queue.put(None)
        self.thread.join(timeout=30)

    def submit(self, request: Request) -> bool:
        """Queues the request; False when the queue is full (the caller answers 503)."""
        try:
            self.queue.put_nowait(request)
        except queue.Full:
            return False
        return True

    @property
    def waiting(self) -> int:
        return self.queue.qsize() + (1 if self.busy else 0)

    def _run(self) -> None:
        while True:
            request = self.queue.get()
            if request is None:
                return
            if request.cancelled.is_set():  # its client left while it waited
                with self.lock:
                    self.counters.requests += 1
                    self.counters.cancelled += 1
                _tell(request, ("done", (None, "", time.time())))
                continue
            self.busy, self.current = True, request
            try:
                self._decode(request)
            except Exception as error:  # nothing one request does may stop the worker
                _tell(request, ("error", error))
            finally:
                self.busy, self.current = False, None

    def _decode(self, request: Request) -> None:
        from dflash_cli.engine.generate import stream_generate

        last: Step | None = None
        stopper = StopMatcher(request.stop)
        try:
            for step in stream_generate(self.runtime.target, self.runtime.drafter, request.prompt,
                                        tokenizer=self.runtime.tokenizer, state=self.state,
                                        **request.settings.engine_kwargs()):
                if request.cancelled.is_set():
                    break
                text, kept = _cut(stopper, step)
                if kept is not None:  # the tokens after the stop string are not part of the reply
                    generated = step.stats.generated_tokens - len(step.tokens) + kept
                    step = replace(step, stats=replace(step.stats, generated_tokens=generated))
                last = step
                _tell(request, ("step", (step, text, "stop" if kept is not None else None)))
                if kept is not None:
                    break
        except Exception as error:  # every failure goes back to its client, the server goes on
            with self.lock:
                self.counters.requests += 1
                self.counters.failed += 1
            _tell(request, ("error", error))
            return
        with self.lock:
            self.counters.requests += 1
            self.counters.cancelled += request.cancelled.is_set()
            if last is not None:
                self.counters.add(last.stats)
        _tell(request, ("done", (last, stopper.flush(), time.time())))


def _cut(stopper: StopMatcher, step: Step) -> tuple[str, int | None]:
    """The step's text that may be sent, and where a stop string ended it: how many of the step's tokens
    reach the one that completed the stop string (None: no stop string). Fed token by token, so a step that
    committed several tokens counts only those up to the stop, as a one-token-at-a-time decode would."""
    aligned = len(step.pieces) == len(step.tokens) and "".join(step.pieces) == step.text
    out = []
    for n, piece in enumerate(step.pieces if aligned else (step.text,), 1):
        text, stopped = stopper.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), n if aligned else len(step.tokens)
    return "".join(out), None


def _tell(request: Request, event: tuple[str, Any]) -> None:
    """Hands an event to the request's callback; a callback that fails (its client's loop is gone)
    cancels the request, never the worker."""
    try:
        request.on_event(event)
    except Exception:
        request.cancelled.set()
