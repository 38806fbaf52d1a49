"""--engine URL: generate and chat against a loopback OpenAI-compatible server (tests/support/fake_engine.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from click.testing import CliRunner
from prompt_toolkit import PromptSession
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from support.fake_engine import FakeEngine

from dflash_cli.conversation import GenerationSettings
from dflash_cli.runtime.remote import RemoteRuntime
from dflash_cli.ui.chat import INTERRUPTED, ChatSession
from dflash_cli.ui.cli import cli
from dflash_cli.ui.render import Output

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def engine(request):
    kwargs = getattr(request, "param", {})
    server = FakeEngine(**kwargs)
    yield server
    server.close()


def generate(engine, *args, input=None, env=None):
    env = {"DFLASH_API_KEY": "", "DFLASH_MODEL": "", "DFLASH_CONFIG": "", **(env or {})}
    return CliRunner().invoke(cli, ["generate", "--engine", engine.url, *args], input=input, env=env)


def as_json(result) -> dict:
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# -- generate -----------------------------------------------------------------------------------------

def test_generate_streams_the_reply_to_stdout_and_sends_the_prompt(engine):
    result = generate(engine, "-s", "Be brief.", "-n", "7", "say", "hi")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "Hello, world!\n"
    assert "Qwen/Qwen3-8B on the engine at" in result.stderr and "Error" not in result.stderr
    body = engine.requests[-1]
    assert body["model"] == "Qwen/Qwen3-8B" and body["stream"] is True and body["max_tokens"] == 7
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say hi"}]


def test_options_only_a_local_model_uses_are_said_to_be_ignored(engine):
    result = generate(engine, "--block-size", "4", "--quant", "q4", "--device", "cpu", "-n", "3", "hi")
    assert result.exit_code == 0, result.stderr
    assert "--block-size, --quant, --device are ignored with --engine" in result.stderr
    quiet = generate(engine, "-n", "3", "hi")  # defaults say nothing
    assert "ignored" not in quiet.stderr


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:99999", "Port out of range"),  # was "connection refused"
    ("http://[::1", "Invalid IPv6 URL"),  # was an internal error
    ("http://127.0.0.1:0", "port 0"),
])
def test_an_engine_url_that_cannot_be_a_server_is_a_usage_error(engine, url, why):
    result = CliRunner().invoke(cli, ["generate", "--engine", url, "hi"], env={"DFLASH_API_KEY": ""})
    assert result.exit_code == 2 and why in result.stderr and "Traceback" not in result.stderr


def test_credentials_are_never_printed_or_saved(engine, tmp_path):
    with_password = engine.url.replace("http://", "http://alice:s3cret@")
    result = CliRunner().invoke(cli, ["generate", "--engine", with_password, "-n", "3", "hi"],
                                env={"DFLASH_API_KEY": "", "DFLASH_MODEL": "", "DFLASH_CONFIG": ""})
    assert result.exit_code == 0, result.stderr
    assert "s3cret" not in result.stderr + result.stdout and "alice:***@" in result.stderr
    from dflash_cli.runtime.remote import RemoteConversation, RemoteRuntime

    runtime = RemoteRuntime(with_password)
    RemoteConversation(runtime).save(tmp_path / "chat.json", settings_for_save())
    assert "s3cret" not in (tmp_path / "chat.json").read_text()
    bad_key = CliRunner().invoke(cli, ["generate", "--engine", engine.url, "hi"],
                                 env={"DFLASH_API_KEY": "abc\ndef", "DFLASH_MODEL": "", "DFLASH_CONFIG": ""})
    assert bad_key.exit_code == 2 and "abc" not in bad_key.stderr and "DFLASH_API_KEY" in bad_key.stderr


def settings_for_save():
    from dflash_cli.conversation import GenerationSettings

    return GenerationSettings()


@pytest.mark.parametrize("engine, field", [
    ({"inject": '{"choices": "abc"}'}, "choices is 'abc'"),
    ({"inject": '{"choices": [{"delta": {"content": 42}}]}'}, "choices[i].delta.content is 42"),
    ({"inject": '{"choices": [], "usage": {"prompt_tokens": "many"}}'}, "usage.prompt_tokens is 'many'"),
    ({"inject": '{"choices": [7]}'}, "choices[i] is 7"),
    ({"inject": '{"choices": [], "meta_info": {"spec_verify_ct": "x"}}'}, "meta_info.spec_verify_ct is 'x'"),
], indirect=["engine"])
def test_a_stream_chunk_of_the_wrong_shape_names_its_field(engine, field):
    """These used to end in 'unexpected ...: report it'; the reply so far is kept on stdout."""
    result = generate(engine, "-n", "8", "hi")
    assert result.exit_code == 1 and field in result.stderr and "Traceback" not in result.stderr
    assert "report it" not in result.stderr and result.stdout.startswith("Hello")


@pytest.mark.parametrize("engine", [{"inject": '{"choices": [{"delta": {"content": "ok\\ud800!"}}]}'}],
                         indirect=True)
def test_a_lone_surrogate_becomes_a_replacement_character(engine):
    result = generate(engine, "-n", "8", "hi")
    assert result.exit_code == 0, result.stderr
    assert "Hellook\ufffd!" in result.stdout  # the text before it was lost


@pytest.mark.parametrize("engine", [{"models": [1, 2]}], indirect=True)
def test_model_ids_that_are_not_strings_are_one_line(engine):
    result = generate(engine, "hi")
    assert result.exit_code == 1 and "not OpenAI's format" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("engine", [{"hang": ("/v1/models",)}], indirect=True)
def test_a_hung_model_list_is_said_within_its_timeout(engine, monkeypatch):
    import dflash_cli.runtime.remote as remote

    monkeypatch.setattr(remote, "MODELS_TIMEOUT", 0.3)  # 30 s by default (it was the reply's 600 s)
    result = generate(engine, "hi")
    assert result.exit_code == 1 and "did not list its models within" in result.stderr


@pytest.mark.parametrize("engine", [{"hang": ("/metrics",)}], indirect=True)
def test_a_hung_metrics_endpoint_is_asked_once_not_twice_per_reply(engine, monkeypatch):
    import dflash_cli.runtime.remote as remote

    monkeypatch.setattr(remote, "METRICS_TIMEOUT", 0.2)
    runtime = remote.RemoteRuntime(engine.url)
    conversation = runtime.conversation()
    from dflash_cli.conversation import GenerationSettings

    for _ in range(2):
        steps = list(conversation.ask("hi", GenerationSettings(max_tokens=4)))
        assert "".join(s.text for s in steps) == "Hello, world!"
    assert engine.gets.count("/metrics") == 1  # it gave up after the first hang


@pytest.mark.parametrize("engine", [{"no_stream": True}], indirect=True)
def test_a_server_that_does_not_stream_is_named_as_such_not_a_cut_stream(engine):
    result = generate(engine, "hi")
    assert result.exit_code == 1 and "answered with one JSON object, not a stream" in result.stderr
    assert "cut" not in result.stderr


@pytest.mark.parametrize("engine", [{"end_early": True}], indirect=True)
def test_a_stream_that_ends_cleanly_without_done_or_a_finish_reason_is_a_cut_reply(engine):
    """The body ends as HTTP allows, so no transport error: only the client's own check can see that the
    reply did not end (the fake server's other cuts all surface as transport errors)."""
    result = generate(engine, "hi")
    assert result.exit_code == 1 and "cut the stream off before the reply ended (4 chunk(s) received)" in result.stderr
    assert result.stdout == "Hello, world!\n"  # the text received was kept


def test_generate_reads_stdin_and_names_the_model(engine):
    engine.models.append("other")
    result = generate(engine, "-m", "other", "summarize", input="a document\n")
    assert result.exit_code == 0, result.stderr
    assert engine.requests[-1]["model"] == "other"
    assert engine.requests[-1]["messages"] == [{"role": "user", "content": "a document\n\nsummarize"}]


def test_engine_from_the_environment_and_the_config_file(engine, tmp_path):
    assert CliRunner().invoke(cli, ["generate", "hi"], env={"DFLASH_ENGINE": engine.url,
                                                          "DFLASH_CONFIG": ""}).stdout == "Hello, world!\n"
    config = tmp_path / "config.toml"
    config.write_text(f'engine = "{engine.url}"\n')
    env = {**os.environ, "PYTHONPATH": SRC, "DFLASH_CONFIG": str(config), "DFLASH_ENGINE": "", "DFLASH_MODEL": ""}
    proc = subprocess.run([sys.executable, "-m", "dflash_cli", "generate", "hi"], capture_output=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=60)  # the config file is read by main()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"Hello, world!\n" and len(engine.requests) == 2


def test_json_with_vllm_metrics_differenced_around_the_request(engine):
    data = as_json(generate(engine, "--json", "hi"))
    assert data["text"] == "Hello, world!" and data["finish_reason"] == "stop" and data["interrupted"] is False
    assert data["generated_tokens"] == 4 and data["prompt_tokens"] == 12
    # the fake's counters started at 10/30/12 and the request added 3 drafts, 9 drafted, 6 accepted
    assert (data["steps"], data["drafted"], data["accepted"]) == (3, 9, 6)
    assert data["per_position_acceptance"] == [1.0, pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert data["committed_histogram"] == [0, 1, 1, 1]
    assert data["acceptance_length"] == pytest.approx(1.0) and data["draft_acceptance"] == pytest.approx(6 / 9)


@pytest.mark.parametrize("engine", [{"kind": "sglang"}], indirect=True)
def test_json_with_sglang_meta_info(engine):
    data = as_json(generate(engine, "--json", "hi"))
    assert (data["steps"], data["drafted"], data["accepted"]) == (2, 14, 2)
    assert data["acceptance_length"] == pytest.approx(1.5)  # 3 tokens after the first, over 2 verify steps


@pytest.mark.parametrize("engine", [{"kind": "plain"}], indirect=True)
def test_a_server_that_reports_nothing_says_so_instead_of_zeros(engine):
    data = as_json(generate(engine, "--json", "hi"))
    assert data["acceptance_reported"] is False
    assert data["steps"] is None and data["acceptance_length"] is None and data["drafted"] is None
    verbose = generate(engine, "-v", "hi")
    assert verbose.exit_code == 0 and "speculation:" in verbose.stderr
    assert "not reported by the server" in verbose.stderr and "0.00 tokens/step" not in verbose.stderr


def test_verbose_shows_the_reported_acceptance(engine):
    result = generate(engine, "-v", "hi")
    assert result.exit_code == 0, result.stderr
    assert "draft acceptance:" in result.stderr and "66.7% (6/9 drafted)" in result.stderr
    assert "per-position accept:" in result.stderr and "1:100% 2:67% 3:33%" in result.stderr


@pytest.mark.parametrize("engine", [{"slow_first": 0.6}], indirect=True)
def test_a_slow_first_token_is_waited_for_and_timed(engine):
    data = as_json(generate(engine, "--json", "hi"))
    assert data["text"] == "Hello, world!" and data["time_to_first_token_seconds"] >= 0.5


@pytest.mark.parametrize("engine", [{"finish_reason": "length"}], indirect=True)
def test_finish_reason_length(engine):
    assert as_json(generate(engine, "--json", "hi"))["finish_reason"] == "length"


def test_without_m_a_server_with_several_models_is_a_usage_error(engine):
    engine.models.append("other")
    result = generate(engine, "hi")
    assert result.exit_code == 2 and "serves 2 models: pick one with -m" in result.stderr
    assert "Qwen/Qwen3-8B, other" in result.stderr and engine.requests == []


# -- errors: one line, the right exit code --------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_error(result, code: int, *needles: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_refused_connection():
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(cli, ["generate", "--engine", url, "hi"], env={"DFLASH_CONFIG": ""})
    one_error(result, 1, f"cannot connect to the engine at {url}: connection refused", "is the server running")


def test_not_a_url_is_a_usage_error():
    result = CliRunner().invoke(cli, ["generate", "--engine", "localhost:8000", "hi"], env={"DFLASH_CONFIG": ""})
    one_error(result, 2, "is not an http:// or https:// URL")


@pytest.mark.parametrize("engine", [{"api_key": "sekrit"}], indirect=True)
def test_401_without_the_key_and_the_key_from_the_environment(engine):
    one_error(generate(engine, "hi"), 1, "refused the request (401 Unauthorized)", "DFLASH_API_KEY")
    assert generate(engine, "hi", env={"DFLASH_API_KEY": "sekrit"}).stdout == "Hello, world!\n"


def test_404_unknown_model(engine):
    one_error(generate(engine, "-m", "nope", "hi"), 2, "has no model 'nope'", "The model `nope` does not exist",
              "it serves: Qwen/Qwen3-8B")


@pytest.mark.parametrize("engine", [{"status": 429, "retry_after": "7"}], indirect=True)
def test_429_with_retry_after(engine):
    one_error(generate(engine, "hi"), 1, "is busy (429 Too Many Requests)", "try again in 7 seconds")


@pytest.mark.parametrize("engine", [{"status": 500}], indirect=True)
def test_500(engine):
    one_error(generate(engine, "hi"), 1, "failed (500 Internal Server Error): EngineCore encountered an issue")


@pytest.mark.parametrize("engine", [{"cut_after": 2}], indirect=True)
def test_a_cut_stream_keeps_the_text_and_says_so(engine):
    result = generate(engine, "hi")
    one_error(result, 1, "cut the stream off before the reply ended")
    assert result.stdout == "Hello,\n"


@pytest.mark.parametrize("engine", [{"malformed_after": 1}], indirect=True)
def test_a_malformed_chunk(engine):
    result = generate(engine, "hi")
    one_error(result, 1, "sent a malformed stream chunk")
    assert result.stdout == "Hello\n"


@pytest.mark.parametrize("engine", [{"cut_after": 2}], indirect=True)
def test_json_on_an_error_prints_no_partial_json(engine):
    result = generate(engine, "--json", "hi")
    assert result.exit_code == 1 and result.stdout == ""


# -- Ctrl-C -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", [{"hang_after": 2}], indirect=True)
def test_ctrl_c_mid_stream_closes_the_request_keeps_the_text_and_exits_130(engine):
    env = {**os.environ, "PYTHONPATH": SRC, "DFLASH_CONFIG": "", "DFLASH_API_KEY": ""}
    # default SIGINT in the child even when this run inherited it ignored (a background job of a script)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_cli", "generate", "--engine", engine.url, "hi"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(6)  # "Hello," : the server now holds the stream open
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert first + rest == b"Hello,\n"
    assert b"interrupted" in err and b"Traceback" not in err
    assert engine.client_closed.wait(10)  # the request was closed, not left running on the server


# -- chat ---------------------------------------------------------------------------------------------

class InterruptingOutput(Output):
    """Output into StringIO streams; `interrupt_at` = (reply, step): Ctrl-C while printing that step."""

    def __init__(self, interrupt_at: tuple[int, int] | None = None):
        super().__init__("never", stdout=StringIO(), stderr=StringIO())
        self.interrupt_at, self.reply, self.step = interrupt_at, 0, 0

    def text(self, step) -> None:
        if step.text:
            self.step += 1
            if (self.reply, self.step) == self.interrupt_at:
                raise KeyboardInterrupt
        super().text(step)

    def end_text(self) -> None:
        self.reply, self.step = self.reply + 1, 0
        super().end_text()


def drive(engine, keys: str, out: Output | None = None, **kwargs):
    runtime = RemoteRuntime(engine.url)
    out = out or InterruptingOutput()
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        pipe.close()
        session = ChatSession(runtime, out, GenerationSettings(max_tokens=12),
                              session_factory=lambda **kw: PromptSession(input=pipe, output=DummyOutput(), **kw),
                              **kwargs)
        code = session.run()
    return code, session, out


def test_chat_sends_the_history_and_the_system_prompt(engine):
    code, session, out = drive(engine, "/set system Be brief.\rhi\rand again\r/stats\r/bye\r")
    assert code == 0
    assert out.out.getvalue() == "Hello, world!\nHello, world!\n"
    assert engine.requests[-1]["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello, world!"}, {"role": "user", "content": "and again"}]
    err = out.err.getvalue()
    assert "on the engine at" in err.splitlines()[0]
    assert re.search(r"draft acceptance: +66.7% \(6/9 drafted\)", err)  # /stats, from vLLM's counters


def test_chat_leaves_the_block_size_to_the_server_and_passes_the_think_switch_on(engine):
    """A remote runtime has no drafter here: /set parameter block_size says the server chooses (none is still
    fine); /set think has no template here to check and goes to the server with the next request."""
    code, session, out = drive(engine, "/set parameter block_size 4\r/set parameter block_size none\r"
                                       "/set nothink\rhi\r/bye\r")
    err = out.err.getvalue()
    assert code == 0 and session.settings.block_size is None and session.settings.think is False
    assert "Error: the block size is the engine's to choose: it runs its own drafter" in err
    assert "Hint: set it where the server starts (serve-cmd --block-size)" in err
    assert "Set 'nothink' mode." in err and "thinking switch" not in err
    assert engine.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("engine", [{"kind": "plain"}], indirect=True)
def test_chat_summary_says_not_reported(engine):
    code, _, out = drive(engine, "hi\r/bye\r")
    assert code == 0 and "acceptance not reported by the server" in out.err.getvalue()


@pytest.mark.parametrize("engine", [{"hang_after": 2}], indirect=True)
def test_chat_ctrl_c_keeps_the_partial_reply_and_goes_on(engine):
    out = InterruptingOutput(interrupt_at=(0, 2))  # Ctrl-C while the second piece is being printed
    code, session, out = drive(engine, "hi\rmore\r/bye\r", out=out)
    assert code == 0
    assert engine.client_closed.wait(10)  # the first request, held open by the server, was closed
    assert INTERRUPTED in out.err.getvalue()
    messages = session.conversation.messages
    # as with a local model, the Step being printed when Ctrl-C came is part of the kept reply
    assert out.out.getvalue().startswith("Hello\n")
    assert messages[1] == {"role": "assistant", "content": "Hello,"}
    assert messages[3] == {"role": "assistant", "content": "Hello, world!"}  # the chat went on
    assert engine.requests[-1]["messages"][1] == {"role": "assistant", "content": "Hello,"}


@pytest.mark.parametrize("engine", [{"status": 500}], indirect=True)
def test_chat_reports_a_server_error_and_goes_on(engine):
    code, session, out = drive(engine, "hi\r/bye\r")
    assert code == 0 and "Error: the engine at" in out.err.getvalue() and "(500 " in out.err.getvalue()
    assert session.conversation.messages == []  # nothing was generated: the failed exchange leaves no trace


@pytest.mark.parametrize("engine", [{"kind": "plain"}, {"kind": "vllm"}], indirect=True)
def test_the_status_line_waits_for_the_servers_counters(engine):
    from dflash_cli.ui.render import status_text

    steps = list(RemoteRuntime(engine.url).stream_chat([{"role": "user", "content": "hi"}], GenerationSettings()))
    assert [s.text for s in steps] == ["Hello", ",", " world", "!", ""] and steps[-1].finish_reason == "stop"
    assert all(status_text(s.stats, True).startswith("◌ remote") for s in steps[:-1])  # no verdict mid-reply
    last = status_text(steps[-1].stats, True)
    assert ("acceptance not reported by the server" in last) == (engine.kind == "plain")
    assert ("τ 1.00" in last and "draft 67%" in last) == (engine.kind == "vllm")


# -- bench --------------------------------------------------------------------------------------------

def bench(engine, tmp_path, *args):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n')
    return CliRunner().invoke(cli, ["bench", "--engine", engine.url, "--prompts", str(prompts), *args],
                              env={"DFLASH_CONFIG": "", "DFLASH_MODEL": "", "DFLASH_API_KEY": ""})


def test_bench_reports_the_servers_acceptance_per_set(engine, tmp_path):
    result = bench(engine, tmp_path, "--warmup", "1", "-n", "9", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert len(engine.requests) == 3 and all(r["max_tokens"] == 9 and r["temperature"] == 0.0
                                             for r in engine.requests)  # 1 warm-up + 2 measured, greedy
    assert [r["id"] for r in report["records"]] == ["a", "b"]
    mine = report["sets"]["mine"]
    assert (mine["drafted"], mine["accepted"]) == (18, 12)  # two requests' counter deltas
    assert mine["tau_pooled"] == pytest.approx(1.0) and mine["draft_acceptance"] == pytest.approx(2 / 3)
    assert mine["per_position_acceptance"] == [1.0, pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert re.search(r"mine +2 +1\.00 +66\.7%", result.stderr)


@pytest.mark.parametrize("engine", [{"kind": "plain"}], indirect=True)
def test_bench_says_when_the_server_reports_nothing(engine, tmp_path):
    result = bench(engine, tmp_path, "--warmup", "0")
    assert result.exit_code == 0, result.stderr
    assert "mine: acceptance not reported by the server" in result.stderr
    assert re.search(r"mine +2 +n/a +n/a", result.stderr)


def test_bench_refuses_local_only_options_with_an_engine(engine, tmp_path):
    result = bench(engine, tmp_path, "--block-size", "4")
    assert result.exit_code == 2 and "server decodes with its own drafter" in result.stderr


# -- issue 23 F: --hide-thinking on a remote reply ------------------------------------------------------

THINKING = ["<th", "ink>\nThe capital", " is Paris.</th", "ink>\n", "\n", "Paris", "."]  # tags split across chunks


@pytest.mark.parametrize("engine", [{"pieces": THINKING}], indirect=True)
def test_hide_thinking_leaves_a_remote_replys_reasoning_out(engine):
    """It used to print the whole reply, tags and reasoning included, without a word."""
    hidden = generate(engine, "--hide-thinking", "hi")
    assert hidden.exit_code == 0, hidden.stderr
    assert hidden.stdout == "Paris.\n" and "ignored" not in hidden.stderr
    shown = generate(engine, "hi")  # the default on a pipe: the reply as the server sent it
    assert shown.stdout == "".join(THINKING) + "\n"
    data = as_json(generate(engine, "--json", "hi"))  # as for a local model: the reasoning under 'thinking'
    assert data["text"] == "Paris." and data["thinking"] == "The capital is Paris."


@pytest.mark.parametrize("engine", [{"pieces": THINKING}], indirect=True)
def test_chat_hides_a_remote_replys_reasoning_and_keeps_it_in_the_history(engine):
    code, session, out = drive(engine, "/set hidethinking\rhi\r/set showthinking\ragain\r/bye\r")
    assert code == 0
    assert out.out.getvalue() == "Paris.\n" + "".join(THINKING) + "\n"
    assert session.conversation.messages[1] == {"role": "assistant", "content": "".join(THINKING)}


@pytest.mark.parametrize("engine", [{"pieces": ["No tags here: <think> is only", " a word.</think>"]}], indirect=True)
def test_hide_thinking_leaves_a_remote_reply_without_reasoning_whole(engine):
    result = generate(engine, "--hide-thinking", "hi")
    assert result.stdout == "No tags here: <think> is only a word.</think>\n"


def test_every_local_only_option_is_said_to_be_ignored_but_hide_thinking_is_not(engine):
    result = generate(engine, "--max-context", "4096", "--no-chat-template", "--device-map", "auto",
                      "--max-memory", "0=10GiB", "--no-draft", "--hide-thinking", "-n", "3", "hi")
    assert result.exit_code == 0, result.stderr
    assert ("--max-context, --no-chat-template, --device-map, --max-memory, --no-draft are ignored with --engine"
            in result.stderr)
    assert "--hide-thinking" not in result.stderr


# -- issue 23 I: a status line while waiting, and a timeout to raise -------------------------------------

def run_on_a_terminal(args: list[str], rows: int = 24, columns: int = 100) -> tuple[int, bytes, str]:
    """Runs `dflash-cli ARGS` with stderr on a real pseudo-terminal and stdout on a pipe: (exit code,
    stdout, what the terminal received)."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(PYTHONPATH=SRC, DFLASH_CONFIG="", DFLASH_API_KEY="", DFLASH_MODEL="", TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_cli", *args], stdout=subprocess.PIPE, stderr=slave,
                            stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    received, deadline = b"", time.monotonic() + 60
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 1.0)[0]:
            continue
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        received += data
    else:
        proc.kill()
    os.close(master)
    out = proc.stdout.read()
    proc.stdout.close()
    return proc.wait(timeout=60), out, received.decode("utf-8", "replace")


@pytest.mark.parametrize("engine", [{"slow_first": 1.5}], indirect=True)
def test_a_terminal_shows_the_wait_for_the_first_token_and_clears_it_before_the_reply(engine):
    """It used to show nothing between the connection and the first token (up to READ_TIMEOUT)."""
    with_password = engine.url.replace("http://", "http://alice:s3cret@")
    code, out, err = run_on_a_terminal(["generate", "--engine", with_password, "hi"])
    assert code == 0, err
    assert out == b"Hello, world!\n"  # stdout has the text only
    waited = err.rfind("waiting for the engine's first token")
    assert waited >= 0, err
    assert "\r\x1b[2K" in err[waited:]  # the line was cleared
    # the model list's spinner names the engine without its password (it used to print the URL as given)
    assert "s3cret" not in err and "alice:***@" in err


@pytest.mark.parametrize("engine", [{"slow_first": 0.8}], indirect=True)
def test_no_waiting_line_on_a_pipe(engine):
    """A guard, not a fix: stderr on a pipe never gets the status line or an escape code."""
    result = generate(engine, "hi")
    assert result.exit_code == 0 and "waiting" not in result.stderr and "\x1b" not in result.stderr


@pytest.mark.parametrize("engine", [{"slow_first": 2.0}], indirect=True)
def test_a_timeout_given_bounds_the_wait_for_the_reply(engine):
    """READ_TIMEOUT (600 s) could not be changed: now a timeout given (ModelOptions.timeout, from --timeout /
    DFLASH_TIMEOUT) bounds the wait, and the error names it."""
    from dflash_cli.runtime import ModelOptions, open_runtime
    from dflash_cli.runtime.remote import RemoteError

    runtime = open_runtime(ModelOptions(engine=engine.url, timeout=0.5))
    with pytest.raises(RemoteError, match=r"did not answer within 0\.5 s"):
        list(runtime.stream_chat([{"role": "user", "content": "hi"}], GenerationSettings()))
    assert RemoteRuntime(engine.url).client.timeout.read == 600.0  # the default is unchanged


@pytest.mark.parametrize("engine", [{"hang": ("/v1/models",)}], indirect=True)
def test_a_timeout_given_bounds_the_model_list_too(engine):
    from dflash_cli.runtime.remote import RemoteError

    with pytest.raises(RemoteError, match=r"did not list its models within 0\.3 s"):
        RemoteRuntime(engine.url, timeout=0.3)


@pytest.mark.parametrize("engine", [{"slow_first": 1.2}], indirect=True)
def test_chat_shows_the_wait_for_the_first_token_on_a_terminal(engine):
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with os.fdopen(slave, "w", encoding="utf-8") as terminal:
        out = Output("never", stdout=StringIO(), stderr=terminal)
        code, _, out = drive(engine, "hi\r/bye\r", out=out)
    os.set_blocking(master, False)
    received = os.read(master, 65536).decode()
    os.close(master)
    assert code == 0 and out.out.getvalue() == "Hello, world!\n"
    waited = received.rfind("waiting for the engine's first token")
    assert waited >= 0 and "\r\x1b[2K" in received[waited:], received


REASONING = '{"choices": [{"index": 0, "delta": {"%s": "The capital is Paris."}, "finish_reason": null}]}'


@pytest.mark.parametrize("engine", [{"pieces": ["", "Paris."], "inject": REASONING % name}
                                    for name in ("reasoning", "reasoning_content")], indirect=True)
def test_reasoning_a_servers_parser_sends_apart_is_shown_hidden_and_split_like_a_local_models(engine):
    """vLLM's and SGLang's --reasoning-parser send it in delta.reasoning (vLLM 0.11+) or
    delta.reasoning_content: it used to be dropped, whatever --hide-thinking said, and the wait for the
    first token lasted the whole reasoning."""
    shown = generate(engine, "hi")
    assert shown.exit_code == 0, shown.stderr
    assert shown.stdout == "<think>\nThe capital is Paris.</think>\n\nParis.\n"
    assert generate(engine, "--hide-thinking", "hi").stdout == "Paris.\n"
    data = as_json(generate(engine, "--json", "hi"))
    assert data["text"] == "Paris." and data["thinking"] == "The capital is Paris."


@pytest.mark.parametrize("engine", [{"slow_first": 2.0}], indirect=True)
def test_timeout_option_and_variable_bound_the_wait(engine):
    flag = generate(engine, "--timeout", "0.5", "hi")
    assert flag.exit_code == 1 and "did not answer within 0.5 s" in flag.stderr and "Traceback" not in flag.stderr
    from_env = generate(engine, "hi", env={"DFLASH_TIMEOUT": "0.5"})
    assert from_env.exit_code == 1 and "within 0.5 s" in from_env.stderr
    bad = generate(engine, "--timeout", "0", "hi")
    assert bad.exit_code == 2 and "--timeout" in bad.stderr


SPEC_USAGE = ('{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "metrics": '
              '{"speculative_decoding": {"num_spec_steps": 4, "num_draft_tokens": 12, "num_accepted_draft_tokens": 4,'
              ' "num_accepted_tokens_per_pos": [3, 1, 0], "block_size": 4}}}}')


@pytest.mark.parametrize("engine", [{"kind": "plain", "inject": SPEC_USAGE}], indirect=True)
def test_a_requests_own_statistics_in_its_usage_chunk_are_read(engine):
    """dflash-cli serve (and vLLM with per-request metrics) send usage.metrics.speculative_decoding; a server
    without /metrics counters then still reports acceptance, for this request alone."""
    data = as_json(generate(engine, "--json", "-n", "8", "hi"))
    assert (data["steps"], data["drafted"], data["accepted"]) == (4, 12, 4)
    assert data.get("acceptance_reported", True) is True and data["block_size"] == 4


@pytest.mark.parametrize("engine", [{"inject": SPEC_USAGE.replace('"num_draft_tokens": 12',
                                                                 '"num_draft_tokens": "x"')}], indirect=True)
def test_a_usage_chunk_with_a_wrong_statistic_names_it(engine):
    result = generate(engine, "-n", "8", "hi")
    assert result.exit_code == 1 and "speculative_decoding.num_draft_tokens is 'x'" in result.stderr


VLLM_TOP_LEVEL = ('{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}, "metrics": '
                  '{"speculative_decoding": {"num_spec_steps": 3, "num_draft_tokens": 9, '
                  '"num_accepted_draft_tokens": 5}}}')


@pytest.mark.parametrize("engine", [{"kind": "plain", "inject": VLLM_TOP_LEVEL}], indirect=True)
def test_vllms_per_request_metrics_at_the_top_level_are_read(engine):
    """vLLM's --per-request-spec-decode-metrics puts them beside usage, not in it."""
    data = as_json(generate(engine, "--json", "-n", "8", "hi"))
    assert (data["steps"], data["drafted"], data["accepted"]) == (3, 9, 5)
