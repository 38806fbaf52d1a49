"""Thinking models: the reasoning dimmed, hidden or kept apart in --json, and the drafter's thinking mode.

A scripted tiny target stands in for Qwen3 (it writes `<think>` itself) and Qwen3.5 (the template opens
`<think>` in the prompt): its attention and MLP outputs are zero, so it is a bigram model whose weights
say which token follows which, and greedy decoding writes `<think>hm</think>OK` then stops.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
import torch
from click.testing import CliRunner
from conftest import VOCAB, drafter_config, save_random_drafter, target_config
from test_chat import drive

from dflash_cli import settings as S
from dflash_cli.conversation import GenerationSettings
from dflash_cli.engine.text import THINK_TAGS
from dflash_cli.engine.thinking import ThinkingSplitter, split_reply
from dflash_cli.models.registry import PairEntry
from dflash_cli.runtime.local import load_runtime
from dflash_cli.ui.cli import cli
from dflash_cli.ui.render import DIM

OPENS = "{% else %}<think>"  # Qwen3.5: thinking on opens <think> in the prompt
THINKING_TEMPLATE = (
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
    + OPENS + "{% endif %}{% endif %}")
REPLY = "<think>hm</think>OK"


# -- the splitter ----------------------------------------------------------------------------------------
def stream(text: str, cuts: list[int], inside: bool = False, markers=THINK_TAGS) -> list[tuple[bool, str]]:
    splitter = ThinkingSplitter(inside, markers)
    bounds = [0, *cuts, len(text)]
    segments = [seg for a, b in zip(bounds, bounds[1:]) for seg in splitter.feed(text[a:b])]
    return segments + splitter.flush()


def parts(segments) -> tuple[str, str]:
    return ("".join(s for t, s in segments if t), "".join(s for t, s in segments if not t))


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


def assert_split_at_every_chunking(text, inside, thinking, answer, markers):
    """Every split into two chunks, one character a chunk, and random 5-chunk splits: the same parts."""
    for cut in range(len(text) + 1):
        assert parts(stream(text, [cut], inside, markers)) == (thinking, answer), cut
    assert parts(stream(text, list(range(1, len(text))), inside, markers)) == (thinking, answer)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4)))
        segments = stream(text, cuts, inside, markers)
        assert "".join(s for _, s in segments) == text and parts(segments) == (thinking, answer)


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
def save_thinking_tokenizer(folder, opens: bool):
    """The char-level tokenizer of conftest plus `<think>` and `</think>` as single (non-special) tokens,
    as in Qwen's vocabulary, and a Qwen-like template with `enable_thinking`; `opens`: thinking on opens
    `<think>` in the prompt (Qwen3.5), else the model writes it (Qwen3)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>", "<think>", "</think>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = THINKING_TEMPLATE.replace(OPENS, OPENS if opens else "")
    fast.save_pretrained(folder)
    return fast


def save_bigram_target(folder, tok, chain: list[str]):
    """A bigram model saved in `folder` with `tok`: each token of `chain` is followed by the next (the last
    ends the reply). Each chain token's embedding is a basis vector, and the lm_head row of the token that
    must follow it points along that vector; attention and MLP add nothing. The chain's tokens must differ."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = [tok.convert_tokens_to_ids(t) for t in chain]
    assert len(set(ids)) == len(ids) and tok.unk_token_id not in ids, chain
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**target_config("qwen3")), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for k, (token, nxt) in enumerate(zip(ids, ids[1:])):
            embed[token] = 0
            embed[token, k] = 1.0
            head[nxt, k] += 100.0
    model.save_pretrained(folder)
    return folder


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


def ok(result):
    assert result.exit_code == 0, result.stderr
    return result


def styled(stdout: str) -> tuple[str, str]:
    """(the text printed dim, the rest), from stdout with ANSI codes."""
    dim, rest, style = [], [], ""
    for code, text in re.findall(r"(\x1b\[[0-9;]*m)|([^\x1b]+)", stdout):
        if code:
            style = "" if code == "\x1b[0m" else style + code
        else:
            (dim if DIM in style else rest).append(text)
    return "".join(dim), "".join(rest)


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
