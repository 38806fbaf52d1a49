"""Structured output (engine/constraint.py, engine/output_format.py): every reply keeps to its schema, grammar
or regex, and speculative decoding commits exactly the plain constrained reply (greedy, fp32), with drafts
that are rejected, drafts from a DFlash 2 selector and from a draft vocabulary; a seed replays sampled output
whatever the block size."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner
from conftest import (
    CHATML,
    DEVICE,
    dflash2_config,
    drafter_config,
    save_random_drafter,
    save_target,
    target_config,
)
from safetensors.torch import load_file, save_file
from support.tiny_tokenizers import byte_level_tokenizer

from dflash_cli.engine.constraint import ConstrainedSampler
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.output_format import (
    OutputFormat,
    OutputFormatError,
    concise_schema,
    json_format,
    parse_format_setting,
    parse_schema_option,
    regex_format,
)
from dflash_cli.engine.sampling import Sampler

VOCAB = 400  # the byte-level tokenizer's 256 bytes, specials and merges (llguidance needs token bytes)
# compact JSON (llguidance's own option): random tiny models fill every allowed whitespace to the limit
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "colour"],
          "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None},
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "colour": {"enum": ["red", "green", "blue"]}}}
LARK = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,4}/\n'
GBNF = 'root ::= "a" [0-9] [0-9]? [0-9]? "b" ("!" | "?")\n'
REGEX = r"[a-z]{1,6}-[0-9]{2,3}"
FORMATS = {
    "schema": (OutputFormat("schema", json.dumps(SCHEMA), "test"), lambda text: _schema_ok(json.loads(text))),
    "lark": (OutputFormat("grammar", LARK, "lark"), lambda text: re.fullmatch(r"yes|no|maybe [0-9]{1,4}", text)),
    "gbnf": (OutputFormat("grammar", GBNF, "gbnf"), lambda text: re.fullmatch(r"a[0-9]{1,3}b[!?]", text)),
    "regex": (regex_format(REGEX), lambda text: re.fullmatch(REGEX, text)),
}


def _schema_ok(value) -> bool:
    return (set(value) == {"ok", "n", "colour"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 999
            and value["colour"] in ("red", "green", "blue"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny fp32 Qwen3 and Llama targets over a byte-level BPE tokenizer, a v1 drafter for each, a DFlash 2
    drafter and a draft-vocabulary drafter for the Qwen3 one."""
    root = tmp_path_factory.mktemp("structured")
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = CHATML
    out = {}
    for family in ("qwen3", "llama"):
        cfg = target_config(family, vocab_size=VOCAB, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id)
        out[family] = save_target(root / family, cfg, seed=1, scale=3.0)
        tokenizer.save_pretrained(out[family])
        out[f"{family}-drafter"] = save_random_drafter(root / f"{family}-drafter", drafter_config(cfg), seed=2)
        if family == "qwen3":
            out["qwen3-dflash2"] = save_random_drafter(root / "dflash2", dflash2_config(cfg), seed=3)
            folder = save_random_drafter(root / "vocab-drafter", drafter_config(cfg), seed=4)
            tensors = load_file(str(folder / "model.safetensors"))
            tensors["draft_vocab"] = torch.arange(0, VOCAB, 2)  # every other id: many allowed tokens left out
            save_file(tensors, str(folder / "model.safetensors"))
            out["qwen3-vocab"] = folder
    return out


def _pair(folders, target: str, drafter: str, fast: bool = False):
    from transformers import AutoTokenizer

    pair = load_pair(folders[target], folders[drafter], device=DEVICE, dtype="float32")
    if fast:
        assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    return pair, AutoTokenizer.from_pretrained(folders[target])


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3-fast"])
def pair(request, folders):
    family, _, fast = request.param.partition("-")
    return _pair(folders, family, f"{family}-drafter", fast=bool(fast))


def _prompts(tokenizer):
    return [tokenizer.encode(text) for text in ("hello there", "Crème brûlée?", "a\nb")]


@pytest.mark.parametrize("kind", list(FORMATS))
def test_greedy_speculative_equals_plain_constrained_and_every_reply_keeps_to_the_format(pair, kind):
    (pair, tokenizer), (fmt, valid) = pair, FORMATS[kind]
    for prompt in _prompts(tokenizer):
        plain = generate(pair.target, None, prompt, tokenizer=tokenizer, max_new_tokens=80, output_format=fmt)
        assert plain.stats.finish_reason == "stop" and plain.tokens[-1] == tokenizer.eos_token_id
        assert valid(tokenizer.decode(plain.tokens[:-1])), tokenizer.decode(plain.tokens)
        for block in (2, 4, 8, None):  # None: adaptive blocks
            got = generate(pair.target, pair.drafter, prompt, tokenizer=tokenizer, max_new_tokens=80,
                           output_format=fmt, block_size=block, adaptive=block is None)
            assert got.tokens == plain.tokens, (kind, block)


@pytest.mark.parametrize("acceptance", [0.9, 0.3])
def test_rejected_drafts_roll_the_grammar_back(pair, acceptance):
    """An oracle that knows the plain constrained reply, with a share of its drafts replaced by other tokens
    (outside the grammar as often as not): every rejection rolls the matcher back to the accepted prefix."""
    (pair, tokenizer), (fmt, _) = pair, FORMATS["schema"]
    for i, prompt in enumerate(_prompts(tokenizer)):
        plain = generate(pair.target, None, prompt, tokenizer=tokenizer, max_new_tokens=80, output_format=fmt)
        oracle = OracleDrafter(pair.drafter, prompt + plain.tokens + [0] * 20, acceptance=acceptance, seed=i,
                               vocab_size=VOCAB)
        got = generate(pair.target, oracle, prompt, tokenizer=tokenizer, max_new_tokens=80, output_format=fmt,
                       block_size=8)
        assert got.tokens == plain.tokens
        assert 0 < got.stats.accepted < got.stats.drafted  # accepted runs and rejections both happened


def test_a_seed_replays_sampled_constrained_output_at_every_block_size(pair):
    (pair, tokenizer), (fmt, valid) = pair, FORMATS["regex"]
    for seed in (1, 2):
        prompt = _prompts(tokenizer)[seed]
        kwargs = dict(tokenizer=tokenizer, max_new_tokens=60, output_format=fmt, temperature=0.9, seed=seed)
        plain = generate(pair.target, None, prompt, **kwargs)
        assert valid(tokenizer.decode(plain.tokens[:-1]))
        for block in (2, 8, None):
            got = generate(pair.target, pair.drafter, prompt, block_size=block, adaptive=block is None, **kwargs)
            assert got.tokens == plain.tokens


@pytest.mark.parametrize("drafter", ["qwen3-dflash2", "qwen3-vocab"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_dflash2_and_draft_vocabulary_drafters_stay_lossless(folders, drafter, temperature):
    pair, tokenizer = _pair(folders, "qwen3", drafter)
    for kind in ("schema", "lark"):
        fmt = FORMATS[kind][0]
        for prompt in _prompts(tokenizer)[:2]:
            kwargs = dict(tokenizer=tokenizer, max_new_tokens=60, output_format=fmt, temperature=temperature, seed=5)
            plain = generate(pair.target, None, prompt, **kwargs)
            for block in (4, 8):
                got = generate(pair.target, pair.drafter, prompt, block_size=block, **kwargs)
                assert got.tokens == plain.tokens, (kind, block)


@pytest.mark.parametrize("drafter", ["qwen3-drafter", "qwen3-dflash2", "qwen3-vocab"])
def test_drafts_are_drafted_inside_the_grammar(folders, drafter):
    """Every drafted block is a valid continuation of the committed output: the drafter's row i is masked
    by the grammar advanced through its drafts before i (and the matcher is back where it was after)."""
    pair, tokenizer = _pair(folders, "qwen3", drafter)
    fmt = FORMATS["schema"][0]
    sampler = ConstrainedSampler(Sampler(), fmt, tokenizer, VOCAB, [tokenizer.eos_token_id])
    committed = tokenizer.encode('{"ok":true,"n":1', add_special_tokens=False)
    sampler.advance(committed)
    prompt = tokenizer.encode("hi") + committed
    context = pair.target.forward(torch.tensor([prompt[:-1]], device=DEVICE), pair.target.new_cache(), 0,
                                  taps=True)[1]  # the positions before the anchor, prompt[-1]
    for temperature in (0.0, 1.0):
        sampler.sampler = Sampler(temperature=temperature, seed=7)
        sampler.greedy = sampler.sampler.greedy
        drafts = pair.drafter.draft(context, torch.tensor([prompt[-1]], device=DEVICE), len(prompt) - 1, 8,
                                    pair.drafter.new_cache(), pair.target.embed_table, pair.target.lm_head,
                                    sampler=sampler).tolist()
        free = pair.drafter.draft(context, torch.tensor([prompt[-1]], device=DEVICE), len(prompt) - 1, 8,
                                  pair.drafter.new_cache(), pair.target.embed_table, pair.target.lm_head).tolist()
        assert sampler.matcher.validate_tokens(drafts) == len(drafts) == 7
        assert sampler.matcher.validate_tokens(free) < 7  # the random drafter alone leaves the grammar
        assert tokenizer.decode(committed + drafts).startswith('{"ok":true,"n":1')


def test_the_token_limit_ends_an_incomplete_reply_with_length(pair):
    (pair, tokenizer), fmt = pair, FORMATS["schema"][0]
    got = generate(pair.target, pair.drafter, _prompts(tokenizer)[0], tokenizer=tokenizer, max_new_tokens=5,
                   output_format=fmt)
    assert got.stats.finish_reason == "length" and len(got.tokens) == 5
    assert '{"ok":'.startswith(tokenizer.decode(got.tokens)[:6])  # the schema's start, cut off


# -- reading what the user wrote -------------------------------------------------------------------------

def test_the_concise_schema_reads_as_llm_writes_it():
    assert concise_schema("name, age int, bio: a short bio") == {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "bio"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "bio": {"type": "string", "description": "a short bio"}}}
    multi = concise_schema("name str: the name, with a comma\nscore float\nok bool")
    assert multi["properties"] == {"name": {"type": "string", "description": "the name, with a comma"},
                                   "score": {"type": "number"}, "ok": {"type": "boolean"}}


def test_schema_option_takes_inline_json_a_file_or_the_concise_form(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCHEMA))
    assert json.loads(parse_schema_option(str(path)).source) == SCHEMA
    assert json.loads(parse_schema_option(json.dumps(SCHEMA)).source) == SCHEMA
    assert json.loads(parse_schema_option("a int").source)["properties"] == {"a": {"type": "integer"}}
    assert parse_format_setting("format", "text") is None
    assert parse_format_setting("format", "json") == json_format()


@pytest.mark.parametrize("name, value, message", [
    ("schema", '{"type": "object",', "is not valid JSON: Expecting"),
    ("schema", "[1, 2]", "the schema is a JSON array, not an object"),
    ("schema", '{"type": "strnig"}', "invalid schema"),
    ("schema", "age integr", "unknown type 'integr'"),
    ("schema", "missing.json", "schema file missing.json does not exist"),
    ("regex", "[a-z", "invalid regex"),
    ("grammar", "GRAMMAR", "invalid grammar"),
    ("format", "yaml", "unknown format 'yaml'"),
])
def test_a_bad_format_is_one_line_naming_what_is_wrong(tmp_path, monkeypatch, name, value, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "GRAMMAR").write_text("start: foo\nfoo: bar\n")  # `bar` is never defined
    with pytest.raises(OutputFormatError) as info:
        fmt = parse_format_setting(name, value)
        assert fmt is not None
        fmt.grammar()
    assert message in str(info.value) and "\n" not in str(info.value)


def _cli(folders, *args):
    from dflash_cli.ui.cli import cli

    return CliRunner().invoke(cli, ["generate", "-m", str(folders["qwen3"]), "--draft", str(folders["qwen3-drafter"]),
                                    "--dtype", "float32", "-q", *args])


def test_generate_with_a_schema_prints_json_that_follows_it(folders):
    result = _cli(folders, "--schema", json.dumps(SCHEMA), "-n", "80", "hello")
    assert result.exit_code == 0, result.output
    assert _schema_ok(json.loads(result.stdout))


def test_bad_formats_and_two_formats_at_once_are_usage_errors(folders, tmp_path):
    for args, message in ((["--regex", "[a-z"], "invalid regex"),
                          (["--schema", "a int", "--regex", "[0-9]+"], "cannot be combined"),
                          (["--grammar", str(tmp_path / "none.lark")], "does not exist"),
                          (["--format", "json", "--think"], "--think cannot be combined")):
        result = _cli(folders, *args, "hi")
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


def test_a_flag_overrides_a_format_from_the_environment(folders, monkeypatch):
    monkeypatch.setenv("DFLASH_FORMAT", "json")
    result = _cli(folders, "--regex", REGEX, "-n", "40", "hi")
    assert result.exit_code == 0, result.output
    assert re.fullmatch(REGEX, result.stdout.strip())


def test_an_incomplete_reply_warns_on_stderr(folders):
    result = _cli(folders, "--schema", json.dumps(SCHEMA), "-n", "3", "hi")
    assert result.exit_code == 0
    assert "the output is incomplete: --max-tokens ran out" in result.stderr


@pytest.mark.slow
def test_the_demo_with_a_schema_gives_parseable_json(smollm2_converted, monkeypatch):
    from dflash_cli.ui.cli import cli

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(smollm2_converted.cache))  # reuse this run's conversion

    result = CliRunner().invoke(cli, ["generate", "-m", "demo", "-q", "-n", "120", "--schema", "name, age int, colour",
                                      "Tom is a 3 year old black cat. Give his name, age and colour as JSON."])
    assert result.exit_code == 0, result.output
    value = json.loads(result.stdout)
    assert value == {"name": "Tom", "age": 3, "colour": "black"}


def test_chat_sets_and_checks_a_format_per_reply(folders):
    from support.chat_driver import drive

    from dflash_cli.conversation import GenerationSettings
    from dflash_cli.runtime.local import load_runtime

    runtime = load_runtime(str(folders["qwen3"]), str(folders["qwen3-drafter"]), dtype="float32", device="cpu")
    settings = GenerationSettings(max_tokens=40)
    keys = ["/set regex [a-z", "/set schema age integr", f"/set regex {REGEX}", "/set think", "hello",
            "/set format text", "again"]
    run = drive(runtime, "".join(k + "\r" for k in keys), settings=settings)
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 3 and "invalid regex" in errors[0] and "unknown type 'integr'" in errors[1], run.stderr
    assert "cannot think first" in errors[2]
    replies = [m["content"] for m in run.messages if m["role"] == "assistant"]
    assert re.fullmatch(REGEX, replies[0].removesuffix("<|endoftext|>")), replies
    assert settings.output_format is None and not re.fullmatch(REGEX, replies[1])  # free text again


def test_bench_runs_a_set_of_structured_prompts_next_to_free_text(folders, tmp_path):
    from dflash_cli.bench.local import run_bench
    from dflash_cli.prompts.reader import PromptSetError, load_prompt_set

    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "s", "prompt": "hello", "schema": SCHEMA}) + "\n"
                    + json.dumps({"id": "r", "prompt": "hi", "regex": REGEX}) + "\n")
    pair, tokenizer = _pair(folders, "qwen3", "qwen3-drafter")
    report = run_bench(pair.target, pair.drafter, tokenizer, {"structured": load_prompt_set(path),
                                                              "free": ["hello", "hi"]},
                       max_new_tokens=60, warmup=0)
    structured = [r for r in report.records if r.set == "structured"]
    assert all(r.identical and r.plain.finish_reason == "stop" for r in structured)  # the format completed
    assert report.sets["structured"].name == "structured" and report.sets["free"].name == "free"
    assert all(r.plain.finish_reason == "length" for r in report.records if r.set == "free")  # no format, no stop
    assert [p.output[0] for p in load_prompt_set("json")] == ["schema"] * 10  # the built-in set loads and checks
    path.write_text(json.dumps({"prompt": "x", "regex": "[a-z"}) + "\n")
    with pytest.raises(PromptSetError, match="line 1: invalid regex"):
        load_prompt_set(path)


def test_a_hybrid_target_stays_lossless_under_a_grammar(tmp_path, monkeypatch):
    """Qwen3.5's Gated DeltaNet layers roll their state back after every rejected draft, grammar or not."""
    import conftest
    from support import hybrid_models

    monkeypatch.setattr(conftest, "VOCAB", VOCAB)  # the byte-level tokenizer's ids must fit the tiny model
    monkeypatch.setattr(hybrid_models, "VOCAB", VOCAB)
    pair = hybrid_models.load_family("qwen3_5", tmp_path)
    tokenizer = byte_level_tokenizer()
    for kind in ("schema", "regex"):
        fmt = FORMATS[kind][0]
        for prompt in _prompts(tokenizer)[:2]:
            plain = generate(pair.target, None, prompt, tokenizer=tokenizer, max_new_tokens=60, output_format=fmt,
                             stop_ids=[tokenizer.eos_token_id])
            for block in (3, 8):
                got = generate(pair.target, pair.drafter, prompt, tokenizer=tokenizer, max_new_tokens=60,
                               output_format=fmt, block_size=block, stop_ids=[tokenizer.eos_token_id])
                assert got.tokens == plain.tokens, (kind, block)


def test_the_python_api_takes_a_format(folders):
    import dflash_cli

    runtime = dflash_cli.load(str(folders["qwen3"]), str(folders["qwen3-drafter"]), dtype="float32", device="cpu")
    result = dflash_cli.generate(runtime, "hello", regex=REGEX, max_new_tokens=40)
    assert re.fullmatch(REGEX, result.text.removesuffix("<|endoftext|>")) and result.stats.finish_reason == "stop"
    value = json.loads(dflash_cli.generate(runtime, "hello", schema=SCHEMA, max_new_tokens=80).text
                       .removesuffix("<|endoftext|>"))
    assert _schema_ok(value)
    with pytest.raises(OutputFormatError, match="invalid regex"):
        dflash_cli.generate(runtime, "hello", regex="[a-z")


def test_a_format_in_the_config_file_applies_and_a_flag_turns_it_off(folders, tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "config.toml").write_text(f"regex = '{REGEX}'\n")
    env = {**os.environ, "DFLASH_CONFIG": str(tmp_path / "config.toml")}

    def run(*args):
        result = subprocess.run([sys.executable, "-m", "dflash_cli", "generate", "-m", str(folders["qwen3"]),
                                 "--no-draft", "--dtype", "float32", "-q", "-n", "30", *args, "hello"],
                                capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert re.fullmatch(REGEX, run())
    assert not re.fullmatch(REGEX, run("--format", "text"))
