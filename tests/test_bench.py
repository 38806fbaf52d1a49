"""`dflash-cli bench` and dflash_cli.bench.local: prompt sets, the interleaved loop, the report and the table."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import save_target, save_tiny_pair, target_config

from dflash_cli.bench.local import BenchReport, format_table, run_bench
from dflash_cli.prompts.reader import BUILTIN_SETS, Prompt, PromptSetError, load_prompt_set
from dflash_cli.ui.cli import cli

SET_KEYS = {"name", "prompts", "generated_tokens_plain", "generated_tokens_dflash", "tau_macro", "tau_pooled",
            "draft_acceptance", "accepted", "drafted", "per_position_acceptance", "position_accepted",
            "position_drafted", "committed_histogram", "plain_tokens_per_second", "dflash_tokens_per_second",
            "speedup", "identical", "total", "divergences", "hf_tokens_per_second"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target, drafter = save_tiny_pair(root)
    return target, drafter


@pytest.fixture(scope="module")
def loaded(folders):
    from transformers import AutoTokenizer

    from dflash_cli.engine.load import load_pair

    pair = load_pair(folders[0], folders[1], device="cpu", dtype="float32")
    return pair.target, pair.drafter, AutoTokenizer.from_pretrained(str(folders[0]))


def bench(folders, *args):
    target, drafter = folders
    base = ["bench", "-m", str(target), "--draft", str(drafter), "--dtype", "float32", "--device", "cpu"]
    return CliRunner().invoke(cli, base + list(args))


# -- prompt sets ----------------------------------------------------------------------------------------


def test_shipped_sets_load_with_40_unique_prompts_each_and_share_none():
    seen: dict[str, str] = {}
    for name in BUILTIN_SETS:
        prompts = load_prompt_set(name)
        texts = [p.prompt for p in prompts]
        # json: replies under a schema (a shorter, opt-in set); the default sets have 40 each
        assert len(prompts) >= (10 if name == "json" else 40) and len(set(texts)) == len(texts), name
        assert len({p.id for p in prompts}) == len(prompts)
        assert all(p.prompt.strip() and len(p.prompt) < 400 for p in prompts)
        for text in texts:
            assert text not in seen, f"{name} repeats a prompt of {seen.get(text)}"
            seen[text] = name
    assert set(BUILTIN_SETS) == {"math", "code", "chat", "json"}


def test_jsonl_files_load_and_bad_lines_name_the_line(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text('{"id": "a", "prompt": "one"}\n\n{"prompt": "two"}\n')
    assert load_prompt_set(str(good)) == [Prompt("a", "one"), Prompt("mine-3", "two")]
    for body, expected in [('{"id": 1, "prompt": "x"}\n{oops\n', "line 2: not valid JSON"),
                           ('{"id": 1}\n', 'line 1: "prompt" must be a non-empty string'),
                           ('["x"]\n', "line 1: expected an object"),
                           ('{"id": 1, "prompt": "x"}\n{"id": 1, "prompt": "y"}\n', "line 2: id '1' appears twice")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(PromptSetError, match=expected):
            load_prompt_set(str(bad))
    with pytest.raises(PromptSetError, match="does not exist"):
        load_prompt_set(str(tmp_path / "missing.jsonl"))
    with pytest.raises(PromptSetError, match="unknown prompt set 'poetry'"):
        load_prompt_set("poetry")


# -- the loop -------------------------------------------------------------------------------------------


def test_run_bench_interleaves_plain_before_dflash_and_is_lossless(loaded):
    target, drafter, tokenizer = loaded
    calls: list[tuple[str, str, str]] = []
    progress: list[tuple[int, int]] = []
    sets = {"a": ["Hello there", "What is 2+2?"], "b": [Prompt("x", "Write a poem"), Prompt("y", "Why?")]}
    report = run_bench(target, drafter, tokenizer, sets, max_new_tokens=10, warmup=1,
                       on_generation=lambda s, i, m: calls.append((s, i, m)),
                       on_progress=lambda done, total, label: progress.append((done, total)))
    assert calls == [("a", "a-1", "plain"), ("a", "a-1", "dflash"), ("a", "a-2", "plain"), ("a", "a-2", "dflash"),
                     ("b", "x", "plain"), ("b", "x", "dflash"), ("b", "y", "plain"), ("b", "y", "dflash")]
    assert progress == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    sequence = [(r.plain.sequence, r.dflash.sequence) for r in report.records]
    assert sequence == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(r.identical and r.first_divergence is None for r in report.records)
    assert list(report.sets) == ["a", "b"] and report.overall.total == 4 and report.overall.identical == 4
    # the pooled figures are the engine's counters summed
    a = report.sets["a"]
    runs = [r.dflash for r in report.records if r.set == "a"]
    assert a.drafted == sum(r.drafted for r in runs) and a.accepted == sum(r.accepted for r in runs)
    steps = sum(r.steps for r in runs)
    assert a.tau_pooled == pytest.approx(sum(r.decode_tokens for r in runs) / steps)
    assert a.tau_macro == pytest.approx(sum(r.acceptance_length for r in runs) / len(runs))
    assert sum(a.committed_histogram) == steps and len(a.committed_histogram) == drafter.block_size
    assert 0 < a.position_drafted[0] <= steps and len(a.per_position_acceptance) == drafter.block_size - 1
    plain_rate = sum(r.plain.decode_tokens for r in report.records if r.set == "a") / sum(
        r.plain.decode_seconds for r in report.records if r.set == "a")
    assert a.plain_tokens_per_second == pytest.approx(plain_rate)
    assert a.speedup == pytest.approx(a.dflash_tokens_per_second / a.plain_tokens_per_second)
    assert report.hf_baseline["enabled"] is False and "assistant" in report.hf_baseline["reason"]
    json.loads(report.to_json())


def test_run_bench_limits_per_set_and_reports_a_divergence(loaded, monkeypatch):
    import dflash_cli.engine.generate as engine

    target, drafter, tokenizer = loaded
    real = engine.generate

    def tampered(t, d, prompt, **kw):  # make the dflash side differ at token 3
        result = real(t, d, prompt, **kw)
        if d is not None and len(result.tokens) > 3:
            result.tokens[3] = (result.tokens[3] + 1) % 100 + 3
        return result

    monkeypatch.setattr(engine, "generate", tampered)
    report = run_bench(target, drafter, tokenizer, {"s": ["one", "two", "three"]}, max_new_tokens=8, warmup=0,
                       per_set=2, block_size=4)
    assert report.overall.total == 2 and report.settings["block_size"] == 4
    assert [r.first_divergence for r in report.records] == [3, 3]
    assert report.sets["s"].divergences == [{"set": "s", "id": "s-1", "first_divergence": 3},
                                            {"set": "s", "id": "s-2", "first_divergence": 3}]
    assert any("outputs differ: s/s-1 at token 3" in line for line in format_table(report))


def test_format_table_is_aligned(loaded):
    target, drafter, tokenizer = loaded
    report = run_bench(target, drafter, tokenizer, {"math": ["1+1"], "chat": ["hi"]}, max_new_tokens=6, warmup=0)
    lines = format_table(report)
    assert lines[0].split()[:3] == ["set", "prompts", "tau"]
    table = lines[:5]  # header, rule, math, chat, all
    assert [ln.split()[0] for ln in table[2:]] == ["math", "chat", "all"]
    assert len({len(ln) for ln in table}) == 1
    assert any("per-position" in ln for ln in lines) and any("hf assisted" in ln for ln in lines)


# -- the command ----------------------------------------------------------------------------------------


def test_bench_json_has_every_field_per_set_and_identical_outputs(folders):
    result = bench(folders, "--json", "--limit", "2", "-n", "8")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"settings", "meta", "hf_baseline", "sets", "overall", "records"}
    assert list(data["sets"]) == ["math", "code", "chat"]
    for name, s in data["sets"].items():
        assert set(s) == SET_KEYS, name
        assert s["prompts"] == 2 and s["identical"] == s["total"] == 2 and s["divergences"] == []
        assert 1.0 <= s["tau_macro"] <= 8 and s["plain_tokens_per_second"] > 0 and s["dflash_tokens_per_second"] > 0
        assert s["speedup"] > 0 and s["generated_tokens_plain"] == s["generated_tokens_dflash"]
    assert set(data["overall"]) == SET_KEYS and data["overall"]["total"] == 6
    assert len(data["records"]) == 6 and all(r["identical"] for r in data["records"])
    assert data["records"][0]["id"] == "math-01" and data["records"][0]["plain"]["mode"] == "plain"
    assert data["settings"]["max_new_tokens"] == 8 and data["settings"]["temperature"] == 0.0
    assert data["settings"]["chat_template"] is True and data["meta"]["dtype"] == "float32"
    assert data["hf_baseline"]["enabled"] is False
    assert "tau" in result.stderr and "speedup" in result.stderr  # the table, on stderr


def test_bench_prompts_file_and_bad_line(folders, tmp_path):
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"id": "q1", "prompt": "Say hi"}\n{"id": "q2", "prompt": "Count to three"}\n')
    result = bench(folders, "--prompts", str(mine), "-n", "6", "--json", "--warmup", "0")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert list(data["sets"]) == ["mine"] and [r["id"] for r in data["records"]] == ["q1", "q2"]
    assert data["overall"]["identical"] == 2

    mine.write_text('{"id": "q1", "prompt": "Say hi"}\n{"id": "q2", "prompt": \n')
    bad = bench(folders, "--prompts", str(mine), "-n", "6")
    assert bad.exit_code == 2 and "line 2" in bad.stderr and "mine.jsonl" in bad.stderr
    assert bad.stdout == ""


def test_bench_needs_a_drafter(folders):
    target, _ = folders
    result = CliRunner().invoke(cli, ["bench", "-m", str(target), "--dtype", "float32", "--device", "cpu"])
    assert result.exit_code == 2 and "drafter" in result.stderr
    result = bench(folders, "--no-draft")
    assert result.exit_code == 2 and "--no-draft" in result.stderr


def test_bench_unknown_set_is_a_usage_error(folders):
    result = bench(folders, "--sets", "math,poetry")
    assert result.exit_code == 2 and "unknown prompt set 'poetry'" in result.stderr


def test_report_is_plain_data():
    assert BenchReport.__dataclass_fields__.keys() >= {"settings", "sets", "overall", "records", "hf_baseline"}


def test_hf_assisted_column_off_for_dflash_drafters_and_on_for_a_causal_lm(loaded, tmp_path):
    from transformers import AutoModelForCausalLM

    target, drafter, tokenizer = loaded
    asked = run_bench(target, drafter, tokenizer, {"s": ["hi"]}, max_new_tokens=4, warmup=0, hf_baseline=True)
    assert asked.hf_baseline["enabled"] is False and asked.hf_baseline["reason"].startswith("requested, but")
    assert asked.records[0].hf is None and asked.records[0].hf_identical is None

    small = save_target(tmp_path / "small", target_config("qwen3", num_hidden_layers=1), seed=5)
    assistant = AutoModelForCausalLM.from_pretrained(str(small), dtype="float32").eval()
    calls: list[str] = []
    report = run_bench(target, drafter, tokenizer, {"s": ["hi", "Say more"]}, max_new_tokens=10, warmup=0,
                       hf_baseline=assistant, on_generation=lambda s, i, m: calls.append(m))
    assert calls == ["plain", "dflash", "hf-assisted"] * 2
    assert report.hf_baseline["enabled"] is True
    assert all(r.hf is not None and r.hf.generated_tokens >= 1 for r in report.records)
    assert all(r.hf_identical for r in report.records)  # greedy assisted generation is lossless too
    assert report.sets["s"].hf_tokens_per_second > 0
    assert "hf tok/s" in format_table(report)[0]


def test_adaptive_bench_drafts_less_with_a_useless_drafter_and_stays_lossless(loaded):
    target, drafter, tokenizer = loaded
    sets = {"a": ["Hello there", "What is 2+2?", "Why is the sky blue?"]}
    fixed = run_bench(target, drafter, tokenizer, sets, max_new_tokens=40, warmup=0)
    adaptive = run_bench(target, drafter, tokenizer, sets, max_new_tokens=40, warmup=0, adaptive=True)
    assert adaptive.settings["adaptive"] is True and fixed.settings["adaptive"] is False
    assert all(r.identical for r in adaptive.records)
    # fixed: every round drafts a whole block (the last few are cut short by max_new_tokens)
    assert all(r.dflash.drafted >= 0.8 * r.dflash.steps * (drafter.block_size - 1) for r in fixed.records)
    # the random drafter is never accepted, so adaptive rounds pause drafting after the first measurements
    assert sum(r.dflash.drafted for r in adaptive.records) < 0.5 * sum(r.dflash.drafted for r in fixed.records)
    assert any("adaptive blocks up to" in line for line in format_table(adaptive))


@pytest.mark.parametrize("sets", ["", " , "])
def test_an_empty_set_list_is_a_usage_error_not_the_whole_default_run(folders, sets):
    result = bench(folders, "--sets", sets)
    assert result.exit_code == 2 and "--sets" in result.stderr and "names no prompt set" in result.stderr
    assert "Traceback" not in result.output


def test_bench_context_fills_each_prompt_to_the_length_asked(folders, tmp_path):
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"id": "q1", "prompt": "Say hi"}\n{"id": "q2", "prompt": "Count to three"}\n')
    result = bench(folders, "--prompts", str(mine), "-n", "4", "--json", "--warmup", "0", "--context", "300",
                   "--adaptive", "--draft-window", "64")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["settings"]["context"] == 300 and data["settings"]["draft_window"] == 64
    assert all(290 <= r["prompt_tokens"] <= 310 for r in data["records"]), [r["prompt_tokens"] for r in data["records"]]
    assert data["overall"]["identical"] == 2  # still lossless at length
    short = json.loads(bench(folders, "--prompts", str(mine), "-n", "4", "--json", "--warmup", "0").stdout)
    assert all(r["prompt_tokens"] < 60 for r in short["records"]) and short["settings"]["draft_window"] is None
    table = bench(folders, "--prompts", str(mine), "-n", "4", "--warmup", "0", "--draft-window", "64")
    assert table.exit_code == 0 and "the drafter sees the last 64 tokens" in table.stderr, table.stderr
