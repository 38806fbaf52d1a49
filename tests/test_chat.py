"""`dflash-cli chat`: the REPL driven through prompt_toolkit's pipe input, on tiny random models."""

from __future__ import annotations

import faulthandler
import json
import re

import pytest
import torch
from click.testing import CliRunner
from conftest import TargetForwardLog, save_tiny_pair
from prompt_toolkit.history import InMemoryHistory
from support.chat_driver import RecordingOutput, Run, drive

from dflash_cli.conversation import Conversation, GenerationSettings
from dflash_cli.runtime.local import load_runtime
from dflash_cli.ui import chat as chat_mod
from dflash_cli.ui.chat import EXIT_HINT, INTERRUPTED, SafeFileHistory, open_history
from dflash_cli.ui.cli import cli

ANSI = re.compile(r"\x1b[\[\]]")
PRINTABLE = range(4, 99)  # the tiny tokenizer's ids of " " .. "~": text that re-encodes to the same ids


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """The tiny pair, on one thread: tiny matrices gain nothing from more, and lose a lot on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("chat-models")
    target, drafter = save_tiny_pair(root)
    yield load_runtime(str(target), str(drafter), dtype="float32", device="cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runtimes(runtime, tmp_path_factory):
    """The tiny pair on the fast path (the default) and on transformers' forward (--compile off), whose
    dynamic cache an interrupted forward leaves holding rows past the committed tokens."""
    root = tmp_path_factory.mktemp("chat-models-off")
    target, drafter = save_tiny_pair(root)
    return {"fast": runtime, "off": load_runtime(str(target), str(drafter), dtype="float32", device="cpu",
                                                 compile="off")}


@pytest.fixture(autouse=True)
def watchdog():
    """A REPL waiting for input that never comes would hang the run: dump the stacks and exit instead."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def replies(run: Run) -> list[list]:
    """The Steps of each reply."""
    return [steps for steps in run.out.replies if steps]


class mask_logits:
    """Makes the tiny model (target and drafter share its lm_head) emit only the given token ids."""

    def __init__(self, runtime, allowed):
        self.head, self.allowed = runtime.target.logits_head, torch.tensor(list(allowed))

    def __enter__(self):
        def hook(_module, _inputs, logits):
            keep = torch.full_like(logits, float("-inf"))
            keep[..., self.allowed] = 0
            return logits + keep

        self.handle = self.head.register_forward_hook(hook)

    def __exit__(self, *exc):
        self.handle.remove()


def test_help_unknown_command_and_exit(runtime):
    run = drive(runtime, "/?\r/frobnicate now\r/bye\r")
    assert run.code == 0
    assert "Available commands" in run.stderr and "/set parameter" in run.stderr
    assert "Unknown command '/frobnicate'. Type /? for help\n" in run.stderr
    assert "/? for help" in run.stderr.splitlines()[0]  # the banner
    assert run.messages == [] and run.stdout == ""


def test_block_size_without_a_drafter_says_so_not_a_range_error(runtime):
    import dataclasses

    plain = dataclasses.replace(runtime, drafter=None, drafter_dir=None)
    settings = GenerationSettings(max_tokens=12)
    run = drive(plain, "/set parameter block_size 4\r/set parameter block_size none\r", settings=settings)
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error: ")]
    assert errors == ["Error: a block size needs a drafter"], run.stderr
    assert settings.block_size is None  # "none" (the default) is still accepted


def test_ctrl_d_exits_zero(runtime):
    run = drive(runtime, "\x04")
    assert run.code == 0 and run.messages == []


def test_set_parameter_validates_values(runtime):
    keys = ["/set parameter temperature 0.5", "/set parameter temperature nan", "/set parameter top_k -1",
            "/set parameter top_p 1.5", "/set parameter max_tokens abc", "/set parameter num_predict 7",
            "/set parameter block_size 99", "/set parameter block_size 3", "/set parameter seed 42",
            "/set parameter nope 1", "/set parameter temperature"]
    settings = GenerationSettings(max_tokens=12)
    run = drive(runtime, "".join(k + "\r" for k in keys), settings=settings)
    assert (settings.temperature, settings.top_k, settings.top_p) == (0.5, 0, 1.0)
    assert (settings.max_tokens, settings.block_size, settings.seed) == (7, 3, 42)
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 7, run.stderr
    assert "Error: invalid value for top_k: '-1' (expected an integer >= 0 (0 = off))" in errors
    assert any("unknown parameter 'nope'" in e for e in errors)
    assert "Set parameter 'num_predict' to '7'." in run.stderr


def test_show_info_is_aligned(runtime):
    run = drive(runtime, "/show info\r/show nothing\r")
    lines = [line for line in run.stderr.splitlines() if line.startswith("  ")]
    info = runtime.info()
    assert [line.split(":")[0].strip() for line in lines] == list(info)
    columns = {len(line) - len(line.split(":", 1)[1].lstrip()) for line in lines}
    assert len(columns) == 1  # every value starts in the same column
    assert "Error: unknown /show option 'nothing'" in run.stderr


def test_reply_summary_and_stats(runtime):
    run = drive(runtime, "/stats\rHello\r/stats\r", color="auto")
    assert run.messages[0] == {"role": "user", "content": "Hello"}
    reply = run.messages[1]["content"]
    assert reply and run.stdout == reply + "\n"
    assert "\x1b" not in run.stdout and "\x1b" not in run.stderr  # not terminals: no ANSI at all
    assert "Error: no reply yet" in run.stderr
    summary = [line for line in run.stderr.splitlines() if "tok/s" in line and "tokens" in line]
    assert len(summary) == 1 and "draft acceptance" in summary[0]
    assert "eval count:" in run.stderr and "acceptance length:" in run.stderr  # /stats


def test_verbose_and_quiet(runtime):
    run = drive(runtime, "/set verbose\rHello\r/set quiet\rAgain\r")
    assert run.stderr.count("\neval count:") == 1  # verbose: the block instead of the summary line
    assert not [line for line in run.stderr.splitlines() if line.endswith("speculation off") or " · τ " in line]
    assert len(run.messages) == 4


def test_regen_replaces_the_last_reply(runtime):
    run = drive(runtime, "/regen\rHello\r/regen\r")
    assert "Error: nothing to regenerate yet" in run.stderr
    assert [m["role"] for m in run.messages] == ["user", "assistant"]
    assert len(replies(run)) == 2
    # greedy: the new reply is the same text, printed a second time
    assert run.stdout == (run.messages[1]["content"] + "\n") * 2


def test_sampled_regen_moves_to_the_next_seed_and_reads_no_stale_cache(runtime):
    sampled = dict(max_tokens=16, temperature=1.0, seed=5)
    run = drive(runtime, "Hello\r/regen\r", settings=GenerationSettings(**sampled))
    run.session.conversation.state.check()  # now: the fresh conversations below take the model's caches over
    first, second = ["".join(s.text for s in r) for r in replies(run)]
    # fresh conversations with seeds 5 and 6 give what the chat printed: the regenerated reply was
    # computed from the prompt alone, not from caches still holding the dropped reply
    fresh = [drive(runtime, "Hello\r", settings=GenerationSettings(**dict(sampled, seed=seed)))
             for seed in (5, 6)]
    assert [run.messages[1]["content"] for run in fresh] == [first, second]
    assert run.messages[1]["content"] == second and run.session.settings.seed == 6
    assert first != second


def test_save_and_load_round_trip(runtime, tmp_path):
    path = tmp_path / "chat.json"
    first = drive(runtime, f"/set system Be brief.\rHello\r/save {path}\r")
    data = json.loads(path.read_text())
    assert data["format"] == "dflash-cli chat" and data["messages"] == first.messages
    assert data["system"] == "Be brief."
    second = drive(runtime, f"/load {path}\r/show system\r")
    assert second.messages == first.messages and second.session.conversation.system == "Be brief."
    assert f"Loaded 2 messages from {path}." in second.stderr

    precious = tmp_path / "notes.txt"
    precious.write_text("not a transcript")
    run = drive(runtime, f"/save {precious}\r/load {precious}\r")
    assert precious.read_text() == "not a transcript"
    assert "is not a dflash-cli transcript: not overwriting it" in run.stderr
    assert run.stderr.count("Error: ") == 2


def test_multiline_block_and_paste_are_one_message(runtime):
    keys = ('"""first line\r  second line\rend"""\r'
            '"""\r/not a command\r"""\r'
            '\x1b[200~pasted one\npasted two\x1b[201~\r')
    run = drive(runtime, keys, settings=GenerationSettings(max_tokens=2))
    users = [m["content"] for m in run.messages if m["role"] == "user"]
    assert users == ["first line\n  second line\nend", "/not a command", "pasted one\npasted two"]


def test_read_sends_file_content_then_text(runtime, tmp_path):
    doc = tmp_path / "my doc.txt"
    doc.write_text("The document.\n")
    run = drive(runtime, f'/read "{doc}" Summarise it.\r/read {tmp_path / "missing"}\r/read\r',
                settings=GenerationSettings(max_tokens=2))
    assert [m["content"] for m in run.messages if m["role"] == "user"] == ["The document.\n\nSummarise it."]
    assert "Error: cannot read" in run.stderr and "Error: usage: /read FILE [TEXT]" in run.stderr


def test_read_of_bytes_that_are_not_utf8_warns_once(runtime, tmp_path):
    doc = tmp_path / "latin1.txt"
    doc.write_bytes(b"caf\xe9 ok\n")
    run = drive(runtime, f"/read {doc}\r", settings=GenerationSettings(max_tokens=2))
    assert [m["content"] for m in run.messages if m["role"] == "user"] == ["caf\ufffd ok"]
    assert run.stderr.count("is not valid UTF-8: the invalid bytes were replaced with U+FFFD") == 1


@pytest.mark.parametrize("path", ["fast", "off"])
def test_ctrl_c_during_a_reply_keeps_the_partial_reply(runtimes, path):
    runtime = runtimes[path]
    calls = []

    def interrupt_third_forward(*_):
        calls.append(1)
        if len(calls) == 3:  # the prefill and one verify step have produced some text
            raise KeyboardInterrupt

    # a layer norm runs once per target forward on both the fast path and transformers' forward
    handle = runtime.target.layers[0].mlp.act_fn.register_forward_hook(interrupt_third_forward)
    try:
        run = drive(runtime, "Hello\rAgain\r", settings=GenerationSettings(max_tokens=40))
    finally:
        handle.remove()
    assert run.code == 0
    assert INTERRUPTED in run.stderr
    first, second = replies(run)
    partial = "".join(s.text for s in first)
    assert partial and run.messages[1] == {"role": "assistant", "content": partial}
    assert first[-1].finish_reason is None
    assert [m["role"] for m in run.messages] == ["user", "assistant", "user", "assistant"]
    # the caches survived the interrupt: the next reply is exactly that of a fresh run
    fresh = Conversation(runtime)
    fresh.messages = run.messages[:2]
    list(fresh.ask("Again", GenerationSettings(max_tokens=40)))
    assert fresh.messages[-1] == run.messages[-1]


def test_ctrl_c_at_the_prompt(runtime):
    run = drive(runtime, "\x03/bye\r")
    assert run.code == 0 and EXIT_HINT in run.stderr
    run = drive(runtime, "\x03\x03")
    assert run.code == 130
    run = drive(runtime, "typed text\x03\r/bye\r")  # Ctrl-C with text clears the line
    assert run.code == 0 and run.messages == [] and EXIT_HINT not in run.stderr


def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_run(runtime):
    settings = GenerationSettings(max_tokens=10)
    with mask_logits(runtime, [2, *PRINTABLE]), TargetForwardLog(runtime.target) as log:
        run = drive(runtime, "/set verbose\rHello there\rAnd a second question?\r", settings=settings)
        run.session.conversation.state.check()
        first, second = (group[-1].stats for group in replies(run))
        # measured inside the model: two prefills, the second of only the new tokens
        prefills = [size for size in log.sizes if size > runtime.drafter.block_size]
        assert prefills == [first.prefilled_tokens] or prefills == [first.prefilled_tokens, second.prefilled_tokens]
        conv = run.session.conversation
        # the prompt of turn 2 starts with turn 1's prompt and reply tokens; only the rest is prefilled
        prompt1 = Conversation(runtime, messages=run.messages[:1]).prompt_ids(settings)
        prompt2 = Conversation(runtime, messages=run.messages[:3]).prompt_ids(settings)
        reply1 = [t for s in replies(run)[0] for t in s.tokens]
        assert prompt2[: len(prompt1) + len(reply1)] == prompt1 + reply1
        assert first.prefilled_tokens == first.prompt_tokens == len(prompt1)
        assert second.prompt_tokens == len(prompt2)
        new = len(prompt2) - len(prompt1) - len(reply1)
        assert second.prefilled_tokens == new + 1  # + the last reply token, never run through the target
        # measured inside the model: one forward per printed step (the prefill, then one per verify), and
        # turn 2's prefill read only its new tokens
        turn1_forwards = len(replies(run)[0])
        assert log.sizes[0] == len(prompt1) and log.sizes[turn1_forwards] == new + 1
        assert max(log.sizes[1:turn1_forwards] + log.sizes[turn1_forwards + 1 :]) <= runtime.drafter.block_size
        assert conv.cached_before == len(prompt1) + len(reply1)
        assert run.session.reread_tokens(second) == 0 and "read again" not in run.stderr
        assert "reused from cache" in run.stderr
        for turn in (1, 2):
            fresh = Conversation(runtime, messages=[dict(m) for m in run.messages[: 2 * turn - 2]])
            list(fresh.ask(run.messages[2 * turn - 2]["content"], settings))
            assert fresh.messages[-1] == run.messages[2 * turn - 1]


def test_verbose_says_when_earlier_tokens_are_read_again(runtime):
    # <extra_140> is one token whose text re-encodes as 11 characters: turn 2 re-reads turn 1's reply
    with mask_logits(runtime, [140]):
        run = drive(runtime, "/set verbose\rHello\rAgain\r", settings=GenerationSettings(max_tokens=3))
    assert run.messages[1]["content"] == "<extra_140>" * 3
    second = replies(run)[1][-1].stats
    assert run.session.reread_tokens(second) > 0
    assert "earlier token(s) were read again" in run.stderr
    run.session.conversation.state.check()


def test_history_file_and_unreadable_history(tmp_path, monkeypatch, runtime):
    monkeypatch.setenv("DFLASH_DATA_DIR", str(tmp_path / "data"))
    out = RecordingOutput()
    history = open_history(out)
    assert isinstance(history, SafeFileHistory) and (tmp_path / "data").is_dir()
    drive(runtime, "/show system\r", history=history)
    assert "/show system" in list(open_history(out).load_history_strings())

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "chat_history").mkdir()  # a folder where the file should be: cannot be read
    monkeypatch.setenv("DFLASH_DATA_DIR", str(blocked))
    history = open_history(out)
    assert isinstance(history, InMemoryHistory)
    assert "warning: cannot use the chat history file" in out.err.getvalue()
    assert drive(runtime, "/bye\r", history=history).code == 0


def test_refuses_to_start_without_a_terminal():
    result = CliRunner().invoke(cli, ["chat", "-m", "nowhere", "--no-history"], input="hello\n")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["Error: " + chat_mod.NOT_A_TERMINAL]
    assert "dflash-cli generate" in result.stderr and result.stdout == ""


def test_no_ansi_reaches_a_non_terminal_stdout_even_with_provenance(runtime):
    run = drive(runtime, "/set provenance\rHello\r", color="auto")
    assert not ANSI.search(run.stdout) and not ANSI.search(run.stderr)
    assert "provenance colours need colour on stdout" in run.stderr


def test_an_engine_error_is_reported_and_the_chat_goes_on(runtime):
    run = drive(runtime, "x" * 600 + "\rHello\r")  # 600 characters: more tokens than the tiny target's context
    assert "Error: the prompt has" in run.stderr and "context holds 512" in run.stderr
    assert [m["content"] for m in run.messages if m["role"] == "user"] == ["Hello"]  # the failed turn left no trace
    assert run.code == 0
