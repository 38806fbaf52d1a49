"""A loopback OpenAI-compatible engine server, as vLLM and SGLang speak it, with faults on demand.

- GET /v1/models: {"object": "list", "data": [{"id": ..., "object": "model", ...}]}
- POST /v1/chat/completions with "stream": true: Server-Sent Events, chunked transfer encoding, one
  `data: {chat.completion.chunk}\\n\\n` per piece of text (`choices[0].delta.content`), the last choice chunk
  with `finish_reason`, a usage chunk (empty `choices`) when `stream_options.include_usage`, then
  `data: [DONE]\\n\\n`.
- kind "sglang": the final chunk also carries SGLang's per-request `meta_info` (spec_verify_ct,
  spec_accept_length, spec_num_proposed_drafts, spec_num_correct_drafts, completion_tokens). `sglang_names`
  picks the counters' names: "current" (those), "older" (spec_draft_token_num, spec_accept_token_num),
  "no_accepted" (the drafted count only) or "verify_only" (spec_verify_ct alone, as the oldest servers);
  `sglang_counts` sets (verify steps, drafted, accepted); `sglang_meta_in` puts the meta info at the top
  level of the final chunk ("top"), in its choice ("choice") or in the usage chunk ("usage").
- kind "vllm": GET /metrics in Prometheus' text exposition format with vLLM's spec_decode counters, which
  the request advances (per-position counts with a position label).
  `vllm_request_spec` (a dict) rides the usage chunk as `metrics.speculative_decoding`, as vLLM started with
  `--per-request-spec-decode-metrics summary` sends it.
- kind "sglang" with `sglang_gauge`: /metrics has SGLang's `sglang:spec_accept_length` gauge (one sample per
  value, as ranks report it); with `sglang_meta_in="none"` the stream carries no meta info.
- kind "plain": no meta info, /metrics without spec_decode counters.
Faults: slow_first (seconds before the first chunk), cut (drop the connection after N chunks), malformed
(a chunk that is not JSON), status (429 with Retry-After, 500, ...), api_key (401 without it), hang (stop
after N chunks until released, for Ctrl-C). Unknown models get vLLM's 404 body.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeEngine:
    kind: str = "vllm"
    models: list[str] = field(default_factory=lambda: ["Qwen/Qwen3-8B"])
    pieces: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    finish_reason: str = "stop"
    slow_first: float = 0.0
    cut_after: int | None = None
    malformed_after: int | None = None
    status: int | None = None
    retry_after: str | None = None
    api_key: str | None = None
    hang_after: int | None = None
    inject: str | None = None  # a raw chunk (JSON text) streamed after the first piece
    hang: tuple[str, ...] = ()  # GET paths that never answer (until the server closes)
    no_stream: bool = False  # answer a streamed request with one JSON completion
    end_early: bool = False  # end the body cleanly after the pieces: no finish chunk, no [DONE]
    gets: list[str] = field(default_factory=list)
    # what a request does to vLLM's counters: drafts, draft tokens, accepted, accepted per position
    vllm_step: tuple[int, int, int, tuple[int, ...]] = (3, 9, 6, (3, 2, 1))
    # SGLang's meta info: which counter names, what counts (None: 2 steps, 14 drafted, len(pieces) - 2
    # accepted), and where in the stream
    sglang_names: str = "current"
    sglang_counts: tuple[int, int, int] | None = None
    sglang_meta_in: str = "top"
    sglang_gauge: tuple[float, ...] = ()
    vllm_request_spec: dict | None = None
    requests: list[dict] = field(default_factory=list)
    client_closed: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.counters = {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 12.0, "per_pos": [7.0, 4.0, 1.0]}
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                engine.handle_get(self)

            def do_POST(self):
                engine.handle_post(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    # -- responses ----------------------------------------------------------------------------------
    def send_json(self, h, status: int, data: dict, headers: dict | None = None) -> None:
        body = json.dumps(data).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    def error(self, h, status: int, message: str, kind: str, headers: dict | None = None) -> None:
        self.send_json(h, status, {"error": {"message": message, "type": kind, "param": None, "code": status}},
                       headers)

    def authorized(self, h) -> bool:
        if self.api_key and h.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.error(h, 401, "Unauthorized", "Unauthorized")
            return False
        return True

    def handle_get(self, h) -> None:
        self.gets.append(h.path)
        if h.path in self.hang:
            self.release.wait(30)
            return
        if h.path == "/metrics":
            return self.metrics(h)
        if not self.authorized(h):
            return
        if h.path == "/v1/models":
            return self.send_json(h, 200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 1700000000, "owned_by": self.kind} for m in self.models]})
        self.send_json(h, 404, {"detail": "Not Found"})

    def metrics(self, h) -> None:
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge",
                 'vllm:num_requests_running{engine="0",model_name="m"} 0.0']
        if self.kind == "vllm":
            c, label = self.counters, 'engine="0",model_name="m"'
            for name, value, text in (("drafts", c["drafts"], "Number of spec decoding drafts."),
                                      ("draft_tokens", c["draft_tokens"], "Number of draft tokens."),
                                      ("accepted", c["accepted"], "Number of accepted tokens.")):
                metric = {"drafts": "num_drafts", "draft_tokens": "num_draft_tokens",
                          "accepted": "num_accepted_tokens"}[name]
                lines += [f"# HELP vllm:spec_decode_{metric}_total {text}",
                          f"# TYPE vllm:spec_decode_{metric}_total counter",
                          f"vllm:spec_decode_{metric}_total{{{label}}} {value}",
                          f"vllm:spec_decode_{metric}_created{{{label}}} 1.7e+09"]
            lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
                      "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{k}"}} {v}'
                      for k, v in enumerate(c["per_pos"])]
        if self.kind == "sglang" and self.sglang_gauge:
            lines += ["# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.",
                      "# TYPE sglang:spec_accept_length gauge"]
            lines += [f'sglang:spec_accept_length{{model_name="m",tp_rank="{k}"}} {v}'
                      for k, v in enumerate(self.sglang_gauge)]
        body = ("\n".join(lines) + "\n").encode()
        h.send_response(200)
        h.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def handle_post(self, h) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(length) or b"{}")
        self.requests.append(body)
        if not self.authorized(h):
            return
        if h.path != "/v1/chat/completions":
            return self.send_json(h, 404, {"detail": "Not Found"})
        if self.status is not None:
            headers = {"Retry-After": self.retry_after} if self.retry_after else None
            message = "Too many requests" if self.status == 429 else "EngineCore encountered an issue."
            return self.error(h, self.status, message, "ServerError", headers)
        if body.get("model") not in self.models:
            return self.error(h, 404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        if self.no_stream:
            return self.send_json(h, 200, {"id": "chatcmpl-0", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "".join(self.pieces)},
                 "finish_reason": "stop"}]})
        self.stream(h, body)

    def stream(self, h, body: dict) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream; charset=utf-8")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        created, rid = int(time.time()), "chatcmpl-0123456789abcdef"

        def chunk(choices: list, **extra) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body["model"],
                    "choices": choices, **extra}

        def send(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            h.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
            h.wfile.flush()

        try:
            send(json.dumps(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}])))
            if self.slow_first:
                time.sleep(self.slow_first)
            for n, piece in enumerate(self.pieces):
                if self.cut_after is not None and n == self.cut_after:
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(2)  # no terminating chunk: the body ends mid-message
                    return
                if self.malformed_after is not None and n == self.malformed_after:
                    send('{"id": "chatcmpl-0123456789abcdef", "choices": [{"index": 0, "delta": {"content": ')
                if self.hang_after is not None and n == self.hang_after:
                    self.hang_after = None  # once: the next request streams normally
                    while not self.release.wait(0.05):  # a keep-alive comment until the client goes away
                        h.wfile.write(b"3\r\n:\n\n\r\n")
                        h.wfile.flush()
                send(json.dumps(chunk([{"index": 0, "delta": {"content": piece}, "logprobs": None,
                                        "finish_reason": None}])))
                if self.inject is not None and n == 0:
                    send(self.inject)
            if self.end_early:  # a well-formed end of the HTTP body, but not of the reply
                h.wfile.write(b"0\r\n\r\n")
                h.wfile.flush()
                return
            meta = self.sglang_meta(rid) if self.kind == "sglang" and self.sglang_meta_in != "none" else None
            if self.kind == "vllm":
                drafts, tokens, accepted, per_pos = self.vllm_step
                c = self.counters
                c["drafts"] += drafts
                c["draft_tokens"] += tokens
                c["accepted"] += accepted
                c["per_pos"] = [v + d for v, d in zip(c["per_pos"], per_pos)]
            last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason}
            if meta is not None and self.sglang_meta_in == "choice":
                last["meta_info"] = meta
            send(json.dumps(chunk([last], **({"meta_info": meta} if meta is not None
                                              and self.sglang_meta_in == "top" else {}))))
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 12, "completion_tokens": len(self.pieces),
                         "total_tokens": 12 + len(self.pieces)}
                if meta is not None and self.sglang_meta_in == "usage":
                    usage.update(meta)
                spec = self.vllm_request_spec
                send(json.dumps(chunk([], usage=usage, **({"metrics": {"speculative_decoding": spec}} if spec
                                                            is not None else {}))))
            send("[DONE]")
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.client_closed.set()

    def sglang_meta(self, rid: str) -> dict:
        """SGLang's per-request meta info for a reply of len(pieces) tokens, with the counters' names of
        `sglang_names`."""
        n = len(self.pieces)
        steps, drafted, accepted = self.sglang_counts or (2, 14, n - 2)
        meta = {"id": rid, "finish_reason": {"type": self.finish_reason}, "prompt_tokens": 12,
                "completion_tokens": n, "cached_tokens": 0, "spec_verify_ct": steps, "e2e_latency": 0.05}
        if self.sglang_names != "verify_only":
            meta["spec_accept_length"] = n / steps if steps else 0.0
        names = {"current": ("spec_num_proposed_drafts", "spec_num_correct_drafts"),
                 "older": ("spec_draft_token_num", "spec_accept_token_num"),
                 "no_accepted": ("spec_num_proposed_drafts", None), "verify_only": (None, None)}[self.sglang_names]
        for name, value in zip(names, (drafted, accepted)):
            if name is not None:
                meta[name] = value
        return meta
