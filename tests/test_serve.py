"""`dflash-cli serve`: the official openai client against a real server on a loopback port, running the tiny
test pair; replies equal the engine's own greedy output, the statistics equal what the engine counted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
from conftest import save_tiny_pair

from dflash_cli.conversation import GenerationSettings
from dflash_cli.engine.generate import generate
from dflash_cli.engine.response import GenerationStats, Step
from dflash_cli.engine.text import encode_prompt
from dflash_cli.runtime.local import load_runtime
from dflash_cli.server.worker import EngineWorker

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from support.live_server import BLOCK, Server  # noqa: E402 - needs openai, uvicorn and starlette, skipped above


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def runtime(pair):
    target, drafter = pair
    return load_runtime(target, drafter, dtype="float32", device="cpu", max_context=512)


@pytest.fixture(scope="module")
def server(runtime):
    served = Server(runtime)
    yield served
    served.stop()


def engine_reply(runtime, prompt_ids, max_tokens=24):
    """What the engine alone generates (greedy, the server's fixed block), for comparison."""
    return generate(runtime.target, runtime.drafter, prompt_ids, tokenizer=runtime.tokenizer,
                    max_new_tokens=max_tokens, block_size=BLOCK)


def chat_ids(runtime, text):
    return encode_prompt(runtime.tokenizer, [{"role": "user", "content": text}])


def test_chat_whole_and_streamed_equal_the_engine_with_its_statistics(server, runtime):
    server.idle()
    want = engine_reply(runtime, chat_ids(runtime, "Hello there"))
    client = server.client()
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}])
    assert got.choices[0].message.content == want.text
    spec = got.usage.model_extra["metrics"]["speculative_decoding"]
    assert got.usage.completion_tokens == want.stats.generated_tokens
    assert (spec["num_spec_steps"], spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]) == (
        want.stats.steps, want.stats.drafted, want.stats.accepted)
    assert spec["mean_acceptance_length"] == pytest.approx(want.stats.acceptance_length, abs=1e-4)
    assert spec["draft_acceptance_rate"] == pytest.approx(want.stats.draft_acceptance, abs=1e-4)
    assert spec["num_accepted_tokens_per_pos"] == list(want.stats.position_accepted)
    times = got.model_extra["timings"]  # llama-server's names, for clients written for llama.cpp
    assert (times["draft_n"], times["draft_n_accepted"], times["draft_steps"]) == (
        want.stats.drafted, want.stats.accepted, want.stats.steps)
    assert times["predicted_n"] == want.stats.decode_tokens and times["predicted_ms"] > 0
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    live = [c.model_extra["metrics"]["speculative_decoding"] for c in chunks if c.model_extra.get("metrics")]
    assert live and live[-1]["num_spec_steps"] >= 1  # the running acceptance rides on the chunks
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == want.stats.generated_tokens
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert finished.model_extra["timings"]["draft_n"] == want.stats.drafted


def test_completions_whole_and_streamed(server, runtime):
    server.idle()
    ids = encode_prompt(runtime.tokenizer, "Once upon", chat_template=False)
    want = engine_reply(runtime, ids, max_tokens=10)
    client = server.client()
    got = client.completions.create(model="tiny", prompt="Once upon", max_tokens=10)
    assert got.choices[0].text == want.text and got.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=10, stream=True) if c.choices)
    assert streamed == want.text


def test_a_stop_string_ends_the_reply_before_it(server, runtime):
    server.idle()
    want = engine_reply(runtime, chat_ids(runtime, "Stop here")).text
    stop = want[3:5]
    assert len(want) > 5 and stop
    got = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Stop here"}],
                                                  stop=[stop])
    assert got.choices[0].message.content == want[: want.index(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_the_second_turn_of_a_chat_reads_only_the_new_tokens(server, runtime):
    server.idle()
    client = server.client()
    first = [{"role": "user", "content": "Turn one"}]
    reply = client.chat.completions.create(model="tiny", messages=first, max_tokens=8)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "Turn two"}]
    again = client.chat.completions.create(model="tiny", messages=second, max_tokens=8)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(chat_ids(runtime, "Turn one"))  # at least the first turn's prompt was not read again
    first_ids = chat_ids(runtime, "Turn one")
    second_ids = encode_prompt(runtime.tokenizer, second)
    held = first_ids + runtime.tokenizer.encode(reply.choices[0].message.content, add_special_tokens=False)
    shared = next((i for i, (a, b) in enumerate(zip(held, second_ids)) if a != b), min(len(held), len(second_ids)))
    # reused: the first prompt at least, never more than the prefix the second prompt shares with what the
    # cache held; and what was read again is the rest (timings count it apart)
    assert len(first_ids) <= cached <= shared and again.usage.prompt_tokens == len(second_ids)
    assert again.model_extra["timings"]["cache_n"] == cached
    assert again.model_extra["timings"]["prompt_n"] == len(second_ids) - cached


def test_max_completion_tokens_limits_the_reply(server):
    body = {"messages": [{"role": "user", "content": "Count"}], "max_completion_tokens": 3, "max_tokens": 20}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["usage"]["completion_tokens"] == 3 and data["choices"][0]["finish_reason"] == "length"


def test_generate_with_engine_reads_our_server(server, runtime):
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    server.idle()
    want = engine_reply(runtime, chat_ids(runtime, "Via the CLI"), max_tokens=12)
    result = CliRunner().invoke(cli, ["generate", "--engine", server.url + "/v1", "-n", "12", "--json",
                                      "Via the CLI"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["text"] == want.text
    # the request's own statistics from the final usage chunk, not the server-wide counters
    assert (data["steps"], data["drafted"], data["accepted"]) == (want.stats.steps, want.stats.drafted,
                                                                  want.stats.accepted)
    assert data["acceptance_length"] == pytest.approx(want.stats.acceptance_length, abs=1e-6)


def test_a_client_that_leaves_mid_stream_stops_the_engine(server, runtime):
    server.idle()
    before = server.worker.counters.generated_tokens, server.worker.counters.cancelled
    body = {"model": "tiny", "messages": [{"role": "user", "content": "A long one"}], "max_tokens": 400,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if '"content"' in line and '"role"' not in line:
                break  # the first generated text arrived: leave
    server.idle()
    generated, cancelled = server.worker.counters.generated_tokens, server.worker.counters.cancelled
    assert cancelled == before[1] + 1
    assert generated - before[0] < 40  # stopped within a step or two of leaving, not after 400 tokens


def test_eight_clients_get_their_own_replies(server, runtime):
    server.idle()
    prompts = [f"Prompt number {i}" for i in range(8)]
    want = {p: engine_reply(runtime, chat_ids(runtime, p), max_tokens=6).text for p in prompts}
    client = server.client()

    def ask(i: int) -> tuple[str, str]:
        p = prompts[i % 8]
        got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=6)
        return p, got.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(200)))
    assert len(answers) == 200 and all(text == want[p] for p, text in answers)


def test_a_full_queue_answers_503(runtime):
    server = Server(runtime, max_queue=1, max_tokens=300)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Busy"}], "max_tokens": 300}
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda _: httpx.post(server.url + "/v1/chat/completions", json=body,
                                                           timeout=60), range(4)))
        busy = [r for r in responses if r.status_code == 503]
        assert busy and all(r.headers.get("retry-after") for r in busy)
        assert busy[0].json()["error"]["code"] == "queue_full"
        assert any(r.status_code == 200 for r in responses)
    finally:
        server.stop()


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), 400,
     "temperature"),
    (json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), 422, "n"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}).encode(), 400,
     "tools[0].function"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * 600}]}).encode(), 400, "messages"),  # too long
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}).encode(), 422,
     "presence_penalty"),
    (b"{" + b" " * (5 << 20) + b"}", 413, None),
    # what OpenAI refuses (round 3 of bad input): each was a 200 with a reply, or a 500
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "messages[0].role"),
    (json.dumps({"messages": [{"role": "user", "content": None}]}).encode(), 400, "messages[0].content"),
    (json.dumps({"messages": [{"content": "x"}]}).encode(), 400, "messages[0].role"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
     .encode(), 400, "messages[0].content"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": 5}).encode(), 400, "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": {}}).encode(), 400, "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": True}).encode(), 400, "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}).encode(), 400,
     "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": "yes"}})
     .encode(), 400, "stream_options.include_usage"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "no"}).encode(), 400, "stream"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}).encode(), 400, "n"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": True}).encode(), 400, "n"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 2.01}).encode(), 400, "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": ' + b"[" * 2000 + b"]" * 2000 + b"}]}", 400, None),
])
def test_bad_requests_get_an_error_object_and_the_server_goes_on(server, body, status, param):
    response = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_the_api_key_is_required_when_set(runtime):
    server = Server(runtime, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert [m.id for m in server.client(api_key="s3cret").models.list()] == ["tiny"]
        assert httpx.get(server.url + "/health").status_code == 200  # health needs no key
    finally:
        server.stop()


def test_metrics_count_under_vllms_names(server):
    # a reply first: on a pytest-xdist worker this test may be the first to use the module's server
    body = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 8}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total"):
        assert name in text
    from dflash_cli.runtime.remote_stats import VLLM_DRAFT_TOKENS, parse_spec_counters

    counters = parse_spec_counters(text)  # as the --engine client reads a vLLM server's
    assert counters[VLLM_DRAFT_TOKENS] == server.worker.counters.draft_tokens > 0


def test_a_client_that_leaves_a_whole_reply_stops_the_engine(server):
    server.idle()
    before = server.worker.counters.generated_tokens, server.worker.counters.cancelled
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Whole and long"}], "max_tokens": 3000}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.3)  # the client gives up
    server.idle()
    assert server.worker.counters.cancelled == before[1] + 1
    assert server.worker.counters.generated_tokens - before[0] < 3000


def test_stopping_the_worker_cancels_the_running_request_at_once(runtime):
    worker = EngineWorker(runtime).start()
    events, started = [], threading.Event()

    def on_event(event):
        events.append(event)
        started.set()

    from dflash_cli.server.worker import Request

    worker.submit(Request(chat_ids(runtime, "Endless"), GenerationSettings(max_tokens=400, block_size=BLOCK), on_event))
    assert started.wait(30)
    t0 = time.perf_counter()
    worker.stop()
    assert not worker.thread.is_alive() and time.perf_counter() - t0 < 5
    assert events[-1][0] == "done" and worker.counters.cancelled == 1
    assert events[-1][1][0].stats.generated_tokens < 400


@pytest.mark.parametrize("reply, inside", [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", False),
    ("  <think>\n\nA  b \n\n c\n</think>\n\nOK", False),
    ("Reasoning first.\n</think>\n\nDone.", True),
    ("<think>\nnever closed  \n", False),
])
def test_streamed_reasoning_content_equals_the_whole_replys(reply, inside):
    from dflash_cli.engine.thinking import ReasoningStream, ThinkingSplitter, split_reply

    reasoning, answer = split_reply(reply, inside)
    for size in (1, 2, 3, 7):
        splitter, stream = ThinkingSplitter(inside), ReasoningStream()
        parts = {True: "", False: ""}
        for i in range(0, len(reply), size):
            for thinking, piece in splitter.feed(reply[i:i + size]):
                parts[thinking] += stream.feed(piece) if thinking else piece
        for thinking, piece in splitter.flush():
            parts[thinking] += stream.feed(piece) if thinking else piece
        assert (parts[True], parts[False]) == (reasoning, answer), size


def fast_drafter_steps(pieces_per_step: list[tuple[str, ...]]):
    """A stand-in for stream_generate whose verify steps commit several tokens each (the tiny pair's random
    drafter is almost never accepted, so its steps commit one token): one piece per token."""
    def stream_generate(target, drafter, prompt, **kwargs):
        total = 0
        for k, pieces in enumerate(pieces_per_step):
            total += len(pieces)
            drafted, accepted = (3, len(pieces) - 1) if k else (0, 0)
            stats = GenerationStats(
                prompt_tokens=len(prompt), prefilled_tokens=len(prompt), prefill_seconds=0.01,
                generated_tokens=total, decode_seconds=0.01 * k, steps=k, drafted=3 * k,
                accepted=total - 1 - k, draft_seconds=0.0, verify_seconds=0.0, block_size=4,
                committed_histogram=(0, 0, 0, 0), position_drafted=(k, k, k), position_accepted=(0, 0, 0),
                peak_memory_bytes=None, peak_memory_kind="")
            last = k == len(pieces_per_step) - 1
            yield Step(tuple(range(total - len(pieces), total)), "".join(pieces), pieces, drafted, accepted,
                       (True,) * accepted + (False,), 0.0, 0.0, stats, "length" if last else None)
    return stream_generate


# "He" | "llo" "," " wo" "rld" | "!" " Bye" "." : the stop string ends inside a step of 4 tokens (" wo" is
# token 4), or spans two steps ("d!": token 6); a one-token-at-a-time decode would have stopped there
@pytest.mark.parametrize("stop, text, tokens", [(" wo", "Hello,", 4), ("d!", "Hello, worl", 6)])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_usage_after_a_stop_string_counts_the_tokens_up_to_it(server, monkeypatch, stop, text, tokens, chat):
    import dflash_cli.engine.generate as engine_generate

    monkeypatch.setattr(engine_generate, "stream_generate",
                        fast_drafter_steps([("He",), ("llo", ",", " wo", "rld"), ("!", " Bye", ".")]))
    server.idle()
    client = server.client()
    ask = dict(model="tiny", stop=[stop], max_tokens=24)
    before = server.worker.counters.generated_tokens
    if chat:
        whole = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **ask)
        got, reason = whole.choices[0].message.content, whole.choices[0].finish_reason
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True,
                                                     stream_options={"include_usage": True}, **ask))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        whole = client.completions.create(prompt="hi", **ask)
        got, reason = whole.choices[0].text, whole.choices[0].finish_reason
        chunks = list(client.completions.create(prompt="hi", stream=True, stream_options={"include_usage": True},
                                                **ask))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert (got, streamed, reason) == (text, text, "stop")
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + tokens
    server.idle()
    assert server.worker.counters.generated_tokens - before == 2 * tokens  # /metrics agrees with usage


def test_a_slow_tokenization_does_not_block_other_requests(server, monkeypatch):
    import dflash_cli.engine.text as engine_text

    real, entered, release = engine_text.encode_prompt, threading.Event(), threading.Event()

    def slow_encode(*args, **kwargs):
        entered.set()
        release.wait(20)  # a long prompt's template and encoding
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_text, "encode_prompt", slow_encode)
    server.idle()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "slowly"}], "max_tokens": 4}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, server.url + "/v1/chat/completions", json=body, timeout=60)
        try:
            assert entered.wait(20)
            assert httpx.get(server.url + "/health", timeout=3).json() == {"status": "ok"}
        finally:
            release.set()
        assert reply.result().status_code == 200


def serve_process(pair, inherit_sigint_ignored: bool):
    target, drafter = pair
    config = target.parent / "empty-config.toml"
    config.write_text("")
    env = {**os.environ, "DFLASH_CONFIG": str(config), "DFLASH_MODEL": "", "NO_COLOR": "1"}
    handler = signal.SIG_IGN if inherit_sigint_ignored else signal.SIG_DFL
    proc = subprocess.Popen([sys.executable, "-m", "dflash_cli", "serve", "-m", str(target), "--draft", str(drafter),
                             "--dtype", "float32", "--device", "cpu", "--port", "0"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, handler))
    seen = []
    for line in proc.stderr:
        if "serving" in line:
            return proc, line
        seen.append(line)
    proc.kill()
    raise AssertionError(f"serve did not start: {''.join(seen)}")


# uvicorn stops on SIGINT/SIGTERM and then re-raises the signal: the same exit as every other command
# (130, 143), also when the process inherited SIGINT ignored (a job started with `&` by a script)
@pytest.mark.parametrize("sig, ignored, code", [(signal.SIGINT, False, 130), (signal.SIGINT, True, 130),
                                                (signal.SIGTERM, False, 143)],
                         ids=["sigint", "sigint-inherited-ignored", "sigterm"])
def test_stopping_an_idle_server_by_a_signal_exits_as_every_command(pair, sig, ignored, code):
    proc, line = serve_process(pair, ignored)
    url = line.split(" on ", 1)[1].split()[0]
    assert httpx.get(url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "interrupted" in err and "Traceback" not in err


def test_sigterm_with_a_stream_open_ends_it_with_a_last_chunk_and_done(pair):
    proc, line = serve_process(pair, False)
    url = line.split(" on ", 1)[1].split()[0]
    body = {"messages": [{"role": "user", "content": "Tell me everything"}], "max_tokens": 400, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    try:
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=60) as response:
            for data in response.iter_lines():
                if not data.startswith("data: "):
                    continue
                events.append(data[6:])
                if len(events) == 3:  # the reply is streaming: stop the server under it
                    proc.send_signal(signal.SIGTERM)
    finally:
        _, err = proc.communicate(timeout=90)
    assert events[-1] == "[DONE]"
    finals = [json.loads(e) for e in events[:-1] if json.loads(e).get("choices")]
    assert finals[-1]["choices"][0]["finish_reason"] == "abort"
    assert json.loads(events[-2])["usage"]["completion_tokens"] < 400  # cut short, and counted
    assert proc.returncode == 143, err
    assert "interrupted" in err and "Traceback" not in err and "Terminated" not in err


@pytest.mark.parametrize("edge", [{"temperature": 0}, {"temperature": 2, "seed": 1}, {"top_p": 1},
                                  {"top_p": 1e-6, "temperature": 1, "seed": 1}, {"max_tokens": 1},
                                  {"stop": ["a", "b", "c", "d"]}, {"n": 1},
                                  {"stream_options": {"include_usage": False}, "stream": True}])
def test_values_at_the_edge_of_each_range_are_accepted(server, edge):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **edge}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if edge.get("stream"):  # no usage chunk asked for: every chunk has a choice, and the stream still ends
        chunks = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert chunks[-1] == "[DONE]" and all(json.loads(c)["choices"] for c in chunks[:-1])
