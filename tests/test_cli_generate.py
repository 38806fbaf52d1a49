"""`dflash-cli generate`: prompt sources, stdout/stderr separation, --json, --verbose, --compare, errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import save_tiny_pair

from dflash_cli.ui.cli import cli


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target, drafter = save_tiny_pair(root)
    return target, drafter


def run(folders, *args, input=None, env=None):
    target, drafter = folders
    base = ["generate", "-m", str(target), "--draft", str(drafter), "--dtype", "float32", "--device", "cpu"]
    return CliRunner().invoke(cli, base + list(args), input=input, env=env)


def as_json(result) -> dict:
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_argument_prompt_streams_text_to_stdout_and_the_rest_to_stderr(folders):
    result = run(folders, "-n", "12", "Hello there")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.endswith("\n") and len(result.stdout) > 1
    assert "speculation on" in result.stderr
    assert "speculation" not in result.stdout and "\x1b" not in result.stdout


def test_prompt_sources_stdin_file_and_both(folders, tmp_path):
    from transformers import AutoTokenizer

    from dflash_cli.engine.text import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(folders[0])
    both = as_json(run(folders, "-n", "3", "--json", "summarize", input="the document\n"))
    assert both["prompt_tokens"] == len(encode_prompt(tokenizer, "the document\n\nsummarize"))
    only_stdin = as_json(run(folders, "-n", "3", "--json", input="just stdin"))
    assert only_stdin["prompt_tokens"] == len(encode_prompt(tokenizer, "just stdin"))
    doc = tmp_path / "doc.txt"
    doc.write_text("from a file")
    from_file = as_json(run(folders, "-n", "3", "--json", "-f", str(doc), "and an instruction"))
    assert from_file["prompt_tokens"] == len(encode_prompt(tokenizer, "from a file\n\nand an instruction"))


def test_json_has_the_documented_keys_and_the_streamed_text(folders):
    data = as_json(run(folders, "-n", "20", "--json", "Tell me"))
    for key in ("text", "finish_reason", "prompt_tokens", "generated_tokens", "steps", "drafted", "accepted",
                "acceptance_length", "draft_acceptance", "per_position_acceptance", "prefill_seconds",
                "decode_seconds", "decode_tokens_per_second"):
        assert key in data, key
    assert data["generated_tokens"] == 20 and data["finish_reason"] == "length"
    assert data["adaptive"] is True and sum(data["block_rounds"]) == data["steps"]
    streamed = run(folders, "-n", "20", "Tell me").stdout
    assert streamed == data["text"] + "\n"


def test_speculative_text_equals_plain_decoding(folders):
    spec = run(folders, "-n", "25", "Lossless?").stdout
    plain = run(folders, "-n", "25", "--no-draft", "Lossless?")
    assert plain.exit_code == 0 and "speculation off" in plain.stderr
    assert spec == plain.stdout


def test_verbose_prints_the_stats_block(folders):
    result = run(folders, "-n", "10", "-v", "Hi")
    for label in ("prompt eval count:", "eval rate:", "acceptance length:", "draft acceptance:",
                  "per-position accept:", "draft / verify time:"):
        assert label in result.stderr
    assert "acceptance" not in result.stdout
    assert "adaptive blocks" in result.stderr  # the adaptive choice is visible
    fixed = run(folders, "-n", "10", "-v", "--block-size", "4", "Hi")
    assert "block 4" in fixed.stderr and "adaptive" not in fixed.stderr


def test_compare_reports_speedup_and_identical_output(folders):
    result = run(folders, "-n", "15", "--compare", "Compare")
    assert result.exit_code == 0, result.stderr
    assert "identical output (15/15 tokens)" in result.stderr and "tok/s" in result.stderr
    data = as_json(run(folders, "-n", "15", "--compare", "--json", "Compare"))
    assert data["identical"] is True and data["first_divergence"] is None
    assert data["speedup"] > 0 and data["baseline"]["generated_tokens"] == 15


def test_compare_with_a_fixed_block_size_compares_against_plain_decoding(folders):
    """--block-size shapes the speculative run only; the plain baseline has no blocks (it used to fail
    after the whole speculative reply with 'a block size needs a drafter', losing a --json reply)."""
    result = run(folders, "-n", "15", "--compare", "--block-size", "4", "Compare")
    assert result.exit_code == 0, result.stderr
    assert "identical output (15/15 tokens)" in result.stderr
    data = as_json(run(folders, "-n", "15", "--compare", "--block-size", "4", "--json", "Compare"))
    assert data["identical"] is True and data["block_size"] == 4
    assert data["baseline"]["generated_tokens"] == 15 and data["baseline"]["steps"] == 14  # one token a step


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1", "x"], "--temperature"),
    (["--temperature", "nan", "x"], "'nan' is not a finite number"),  # nan passes every range comparison
    (["--top-p", "nan", "x"], "'nan' is not a finite number"),
    (["--temperature", "inf", "x"], "'inf' is not a finite number"),
    (["--block-size", "99", "x"], "block size 99 is outside 1..8"),
    (["--quant", "fp3", "x"], "--quant"),
    (["-n", "0", "x"], "--max-tokens"),
])
def test_bad_options_exit_2_with_a_clear_message(folders, args, message):
    result = run(folders, *args)
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_missing_model_and_missing_prompt(folders, tmp_path):
    missing = CliRunner().invoke(cli, ["generate", "-m", str(tmp_path / "nope"), "hi"])
    assert missing.exit_code == 1
    assert "is not a folder, a known name or a Hub repo id" in missing.stderr and "qwen3-8b" in missing.stderr
    assert "Traceback" not in missing.stderr
    no_model = CliRunner().invoke(cli, ["generate", "hi"], env={"DFLASH_MODEL": ""})
    assert no_model.exit_code == 2 and "no model given" in no_model.stderr
    no_prompt = run(folders)
    assert no_prompt.exit_code == 2 and "no prompt" in no_prompt.stderr


def test_no_ansi_on_a_pipe_even_with_force_color(folders):
    result = run(folders, "-n", "10", "-v", "colour?", env={"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"})
    assert result.exit_code == 0 and "\x1b" not in result.stdout


def _command(folders, *args):
    target, drafter = folders
    return [sys.executable, "-m", "dflash_cli", "generate", "-m", str(target), "--draft", str(drafter),
            "--dtype", "float32", "--device", "cpu", *args]


def test_head_closing_the_pipe_ends_quietly(folders):
    proc = subprocess.Popen(_command(folders, "-n", "400", "go on"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    first = proc.stdout.read(3)
    proc.stdout.close()  # what `| head -c 3` does
    _, err = proc.communicate(timeout=120)
    assert first and proc.returncode == 0
    assert b"Traceback" not in err and b"BrokenPipe" not in err


def test_ctrl_c_prints_what_was_generated_and_exits_130(folders):
    # default SIGINT in the child even when this run inherited it ignored (a background job of a script)
    proc = subprocess.Popen(_command(folders, "-n", "5000", "--temperature", "1", "--seed", "1", "long"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(1)  # generation has started (and cannot finish soon: ~500 tokens to go)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert first and (first + rest).endswith(b"\n")
    assert b"interrupted" in err and b"Traceback" not in err


def test_a_model_folder_without_a_tokenizer_is_a_clear_error(tiny_models):
    result = CliRunner().invoke(cli, ["generate", "-m", str(tiny_models["qwen3"]), "--no-draft", "hi"])
    assert result.exit_code == 1 and "has no tokenizer files" in result.stderr and "Traceback" not in result.stderr


def test_compile_setting_picks_the_forward_and_keeps_the_text(folders):
    fast = as_json(run(folders, "-n", "16", "--json", "Same words"))
    off = as_json(run(folders, "-n", "16", "--json", "--compile", "off", "Same words"))
    from_env = as_json(run(folders, "-n", "16", "--json", "Same words", env={"DFLASH_COMPILE": "off"}))
    assert fast["forward"].startswith("static cache, eager")
    assert off["forward"] == from_env["forward"] == "transformers forward (compile off)"
    assert fast["text"] == off["text"] == from_env["text"]
    verbose = run(folders, "-n", "4", "--verbose", "Hi")
    assert "forward:" in verbose.stderr and "static cache" in verbose.stderr
    assert "; attention: torch's fused cpu kernel" in verbose.stderr  # what runs, not only which path
    bad = run(folders, "-n", "4", "--compile", "fast", "Hi")
    assert bad.exit_code == 2 and "'fast' is not one of 'auto', 'on', 'off'" in bad.stderr


def test_sampled_runs_report_their_seed_and_compare_identical(folders):
    data = as_json(run(folders, "-n", "15", "--temperature", "0.9", "--compare", "--json", "Roll"))
    assert isinstance(data["seed"], int) and data["identical"] is True and data["first_divergence"] is None
    replay = as_json(run(folders, "-n", "15", "--temperature", "0.9", "--seed", str(data["seed"]), "--json",
                         "Roll"))
    assert replay["text"] == data["text"] and replay["seed"] == data["seed"]
    assert as_json(run(folders, "-n", "3", "--json", "Greedy"))["seed"] is None


@pytest.mark.parametrize("kind", ["transformers format", "dflash 2"])
def test_draft_accepts_every_drafter_format(folders, tmp_path, kind):
    """--draft FOLDER reads the format from config.json; the text equals the run with the z-lab drafter."""
    from conftest import dflash2_config, drafter_config, save_random_drafter, target_config

    if kind == "transformers format":
        drafter = save_random_drafter(tmp_path / "d", drafter_config(target_config("qwen3")), seed=2,
                                      fmt="transformers")
    else:
        drafter = save_random_drafter(tmp_path / "d", dflash2_config(target_config("qwen3")), seed=2)
    want = as_json(run(folders, "-n", "16", "--json", "Tell me"))
    got = as_json(run((folders[0], drafter), "-n", "16", "--json", "Tell me"))
    assert got["text"] == want["text"] and got["drafted"] > 0
    assert str(drafter) in run((folders[0], drafter), "-n", "4", "Tell me").stderr


def test_a_second_generate_starts_from_the_round_costs_the_first_measured(folders, monkeypatch):
    """A one-shot `generate` leaves the adaptive controller's round costs in the cache folder; the next process
    of the same pair and settings starts from them (one full block to measure its own request, where a fresh
    one drafts three and times plain rounds), each counted as one round. A damaged file is ignored and
    replaced; other settings (another thread count) keep their own."""
    from dflash_cli import settings as S
    from dflash_cli.engine import adaptive

    started: list[tuple[int, dict]] = []  # each controller's warm-up rounds and costs, as it started
    original = adaptive.BlockSizeController.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        started.append((self.warmup, {b: dict(t) for b, t in self.shared.seconds.items()}))

    monkeypatch.setattr(adaptive.BlockSizeController, "__init__", recording)

    def first_controller(*args):
        started.clear()
        as_json(run(folders, "-n", "24", "--json", *args, "Tell me a story"))
        return started[0]

    warmup, costs = first_controller()
    kept = list((S.cache_dir() / "round-costs").glob("*.json"))
    assert warmup == 3 and costs == {} and len(kept) == 1
    saved = json.loads(kept[0].read_text())
    assert saved["key"]["drafter"] == str(folders[1].resolve()) and saved["costs"]["seconds"]["0"]

    warmup, costs = first_controller()
    assert warmup == 1  # costs known: one full block measures this request, then it drafts or pauses
    assert costs == {int(b): {int(n): s for n, s in t.items()} for b, t in saved["costs"]["seconds"].items()}

    kept[0].write_text('{"key": ')  # cut short
    warmup, costs = first_controller()
    assert warmup == 3 and costs == {}
    assert json.loads(kept[0].read_text())["key"] == saved["key"]  # replaced by a whole one

    warmup, costs = first_controller("--threads", "1")
    assert warmup == 3 and costs == {} and len(list((S.cache_dir() / "round-costs").glob("*.json"))) == 2
