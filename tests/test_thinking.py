"""Thinking models: the reasoning dimmed, hidden or kept apart in --json, and the drafter's thinking mode.

A scripted tiny target stands in for Qwen3 (it writes `<think>` itself) and Qwen3.5 (the template opens
`<think>` in the prompt): its attention and MLP outputs are zero, so it is a bigram model whose weights
say which token follows which, and greedy decoding writes `<think>hm</think>OK` then stops.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner
from conftest import drafter_config, save_random_drafter, target_config
from support.chat_driver import drive
from support.cli_output import ok, styled
from support.thinking import assert_split_at_every_chunking, save_bigram_target, save_thinking_tokenizer

from dflash_cli import settings as S
from dflash_cli.conversation import GenerationSettings
from dflash_cli.engine.text import THINK_TAGS
from dflash_cli.engine.thinking import ThinkingSplitter, split_reply
from dflash_cli.models.registry import PairEntry
from dflash_cli.runtime.local import load_runtime
from dflash_cli.ui.cli import cli

REPLY = "<think>hm</think>OK"


# -- the splitter ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,inside,thinking,answer", [
    ("<think>\nLet me see.\n</think>\n\nThe answer.", False, "<think>\nLet me see.\n</think>\n\n", "The answer."),
    ("Let me see.\n</think>\n\nThe answer.", True, "Let me see.\n</think>\n\n", "The answer."),
    ("\n<think>a</ b</thin c</think>x </think> <think>", False, "\n<think>a</ b</thin c</think>", "x </think> <think>"),
    ("The answer mentions <think> tags.", False, "", "The answer mentions <think> tags."),
    ("<thin", False, "", "<thin"),
    ("<think>cut short </thi", False, "<think>cut short </thi", ""),
])
def test_splitter_finds_the_tags_across_every_chunking(text, inside, thinking, answer):
    assert_split_at_every_chunking(text, inside, thinking, answer, THINK_TAGS)


def test_splitter_holds_back_only_what_may_be_a_tag():
    splitter = ThinkingSplitter()
    assert splitter.feed("Hello") == [(False, "Hello")]  # an answer streams at once
    splitter = ThinkingSplitter()
    assert splitter.feed("<thi") == [] and splitter.feed("nk>ab</") == [(True, "<think>"), (True, "ab")]
    assert splitter.feed("x") == [(True, "</x")]


def test_split_reply_strips_tags_and_blank_lines():
    assert split_reply("<think>\nwhy\n</think>\n\nbecause") == ("why", "because")
    assert split_reply("why\n</think>\n\nbecause", inside=True) == ("why", "because")
    assert split_reply("no reasoning here") == (None, "no reasoning here")
    assert split_reply("still thinking", inside=True) == ("still thinking", "")


# -- a scripted thinking target --------------------------------------------------------------------------
def save_scripted_target(folder, opens: bool):
    """The bigram model that writes `<think>hm</think>OK` after the prompt's last newline, then ends the turn."""
    folder.mkdir(parents=True)
    tok = save_thinking_tokenizer(folder, opens)
    return save_bigram_target(folder, tok, ["\n", "<think>", "h", "m", "</think>", "O", "K", "<|im_end|>"])


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{"qwen3": (target, drafter), "qwen3.5": (target, drafter)}; the folders carry the repo names of
    the registry pair the tests declare (scripted-target, scripted-drafter)."""
    out = {}
    for name, opens in (("qwen3", False), ("qwen3.5", True)):
        root = tmp_path_factory.mktemp(name)
        target = save_scripted_target(root / "scripted-target", opens)
        drafter = save_random_drafter(root / "scripted-drafter", drafter_config(target_config("qwen3")), seed=2)
        out[name] = (target, drafter)
    other = tmp_path_factory.mktemp("other")
    out["other-drafter"] = save_random_drafter(other / "other-drafter", drafter_config(target_config("qwen3")))
    return out


def generate(pair, *args, **kwargs):
    target, drafter = pair
    base = ["generate", "-m", str(target), "--draft", str(drafter), "--dtype", "float32", "--device", "cpu",
            "-n", "20"]
    return CliRunner().invoke(cli, base + list(args) + ["Hi"], **kwargs)


@pytest.mark.parametrize("model,reply", [("qwen3", REPLY), ("qwen3.5", REPLY.removeprefix("<think>"))])
def test_generate_prints_dims_hides_and_splits_the_reasoning(pairs, model, reply):
    pair = pairs[model]
    plain = ok(generate(pair))
    assert plain.stdout == reply + "\n"  # a pipe gets the text as generated, no escape codes
    dim, rest = styled(ok(generate(pair, "--color", "always")).stdout)
    assert (dim, rest) == (reply.removesuffix("OK"), "OK\n")
    assert ok(generate(pair, "--hide-thinking")).stdout == "OK\n"
    assert ok(generate(pair, "--hide-thinking", "--color", "always", "--no-provenance")).stdout == "OK\n"
    data = json.loads(ok(generate(pair, "--json")).stdout)
    assert (data["text"], data["thinking"]) == ("OK", "hm")
    # every token counts: the reasoning, the tags, the answer and the end-of-turn token
    assert data["generated_tokens"] == len(reply.replace("<think>", "(").replace("</think>", ")")) + 1
    off = json.loads(ok(generate(pair, "--json", "--no-think")).stdout)
    assert (off["text"], off["thinking"], off["generated_tokens"]) == ("OK", None, 3)


def test_hide_thinking_from_the_environment_and_the_config_file(pairs, tmp_path, monkeypatch):
    pair = pairs["qwen3"]
    assert ok(generate(pair, env={S.ENV["hide_thinking"]: "1"})).stdout == "OK\n"
    config = tmp_path / "config.toml"
    config.write_text("hide_thinking = true\n")
    monkeypatch.setenv(S.CONFIG_ENV, str(config))
    default_map = S.load_config().default_map()
    assert ok(generate(pair, default_map=default_map)).stdout == "OK\n"
    assert ok(generate(pair, "--show-thinking", default_map=default_map)).stdout == REPLY + "\n"


def test_chat_keeps_the_reply_as_generated_and_toggles_hiding(pairs):
    target, drafter = pairs["qwen3.5"]
    runtime = load_runtime(str(target), str(drafter), dtype="float32", device="cpu")
    run = drive(runtime, "Hi\r/set hidethinking\rAgain\r/set showthinking\r/set nothink\rNo\r",
                settings=GenerationSettings(max_tokens=20))
    assert run.stdout == "hm</think>OK\n" + "OK\n" + "OK\n"
    # the history holds what the model wrote: Qwen templates take the reasoning out of earlier turns themselves
    assert [m["content"] for m in run.messages if m["role"] == "assistant"] == ["hm</think>OK"] * 2 + ["OK"]
    assert "<|im_start|>assistant\nOK<|im_end|>" in runtime.tokenizer.apply_chat_template(run.messages,
                                                                                            tokenize=False)
    dim, rest = styled(drive(runtime, "Hi\r", settings=GenerationSettings(max_tokens=20), color="always").stdout)
    assert (dim, rest) == ("hm</think>", "OK\n")


# -- the drafter's thinking mode -------------------------------------------------------------------------
WARNING = "the drafter for tiny was trained with thinking {}: with thinking {}, expect lower acceptance"


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """Declares the scripted pair in the user's registry; returns a function setting its thinking mode."""
    config = tmp_path / "config.toml"
    monkeypatch.setenv(S.CONFIG_ENV, str(config))

    def declare(thinking: bool):
        config.write_text(f'[pairs.tiny]\ntarget = "org/scripted-target"\ndrafter = "org/scripted-drafter"\n'
                          f"thinking = {str(thinking).lower()}\n")
    return declare


def test_warns_once_when_thinking_contradicts_the_drafters_training(pairs, registry):
    pair = pairs["qwen3"]
    registry(False)
    on = WARNING.format("off", "on")
    for args in ((), ("--think",), ("--json",)):  # the template's default is thinking on
        result = ok(generate(pair, *args))
        assert result.stderr.count(on) == 1, (args, result.stderr)
        assert "--no-think (chat: /set nothink) matches its training" in result.stderr
    assert on not in ok(generate(pair, "--no-think")).stderr
    assert on not in ok(generate(pair, "--no-draft")).stderr
    assert on not in ok(generate(pair, "--no-chat-template")).stderr  # no template, no thinking mode
    assert on not in ok(generate((pair[0], pairs["other-drafter"]))).stderr  # not the registry's drafter
    registry(True)
    assert WARNING.format("on", "off") in ok(generate(pair, "--no-think")).stderr
    assert "warning" not in ok(generate(pair)).stderr


def test_chat_warns_when_set_think_turns_to_the_other_mode(pairs):
    target, drafter = pairs["qwen3"]
    runtime = load_runtime(str(target), str(drafter), dtype="float32", device="cpu")
    entry = PairEntry("tiny", "org/scripted-target", "org/scripted-drafter", thinking=False)
    runtime = dataclasses.replace(runtime, drafter_entry=entry)
    run = drive(runtime, "/set nothink\r/set think\r/set think\r/set nothink\r")
    assert run.stderr.count(WARNING.format("off", "on")) == 1, run.stderr
    plain = dataclasses.replace(runtime, drafter=None)
    assert "warning" not in drive(plain, "/set nothink\r/set think\r").stderr  # no drafter, no warning
