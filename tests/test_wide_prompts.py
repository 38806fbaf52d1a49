"""The `wide` training prompt set, and `--prompts` specs joined with `+`."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from click.testing import CliRunner

from dflash_cli.train.api import split_heldout
from dflash_cli.train.data import read_index
from dflash_cli.train.prompts import resolve_prompt_parts, resolve_prompts, resolve_prompts_with_categories
from dflash_cli.train.prompts.mix import mix_prompts, mix_prompts_with_categories
from dflash_cli.train.prompts.wide import wide_prompts, wide_prompts_with_categories

DEVICE = "cpu"
MIX_12000_SHA256, WIDE_12000_SHA256 = "a91468a7115b9f8d", "c2929a6a94aa180a"


@pytest.fixture(scope="module")
def wide_12000():
    return wide_prompts_with_categories(12000)


def test_wide_set_is_reproducible_a_prefix_family_distinct_and_apart_from_the_bench_sets(wide_12000):
    from dflash_cli.prompts.reader import BUILTIN_SETS, load_prompt_set

    prompts = [p for _, p in wide_12000]
    assert len(set(prompts)) == 12000 and wide_prompts() == prompts
    assert wide_prompts(500) == prompts[:500] and wide_prompts(500, seed=1) != prompts[:500]
    bench = {p.prompt for name in BUILTIN_SETS for p in load_prompt_set(name)}
    assert len(bench) >= 100 and not bench & set(prompts)
    # only the plain "Write a LANG function that TASK." form can repeat a mix prompt word for word
    shared = set(prompts) & set(mix_prompts(24000))
    assert len(shared) < 40 and all(p.startswith("Write a") for p in shared)
    assert all(p.isascii() and 10 < len(p) < 400 and "  " not in p for p in prompts)


@pytest.mark.parametrize("n", [3000, 12000])
def test_wide_set_keeps_40_30_30_and_its_kinds_of_request(wide_12000, n):
    head = wide_12000[:n]
    shares = Counter(c for c, _ in head)
    for cat, want in (("math", 0.40), ("code", 0.30), ("chat", 0.30)):
        assert abs(shares[cat] / n - want) < 0.025, (cat, shares[cat] / n)
    by_cat = {cat: [p for c, p in head if c == cat] for cat in ("math", "code", "chat")}
    # word problems of several steps: two sentences or more (a story, then a question), two numbers or more
    assert all(len(re.findall(r"[.?!](?:\s|$)", p)) >= 2 for p in by_cat["math"])
    assert sum(len(re.findall(r"\d+", p)) >= 2 for p in by_cat["math"]) > 0.9 * len(by_cat["math"])
    code_markers = ("What does this", "What is wrong", "Explain what this shell command", "function that")
    for cat, markers in (("code", code_markers),
                         ("chat", ("Why ", "story", "What should I do?", "Explain how", "message to"))):
        for marker in markers:
            assert sum(marker in p for p in by_cat[cat]) >= 10, (cat, marker)
        assert len({" ".join(p.split()[:3]) for p in by_cat[cat]}) >= 30, cat


def test_joined_specs_list_their_parts_in_order_with_categories_only_when_all_have_them(tmp_path):
    texts, cats = resolve_prompts_with_categories("mix:50+wide:30")
    assert texts == mix_prompts(50) + wide_prompts(30) == resolve_prompts("mix:50+wide:30")
    assert cats == [c for c, _ in mix_prompts_with_categories(50) + wide_prompts_with_categories(30)]
    f = tmp_path / "mine.txt"
    f.write_text("one\ntwo\n")
    assert resolve_prompts_with_categories(f"{f}+wide:5") == (["one", "two"] + wide_prompts(5), None)
    assert [len(p) for p, _ in resolve_prompt_parts(f"wide:5+{f}+mix:3")] == [5, 2, 3]
    plus = tmp_path / "a+b.txt"  # a file whose own name has a + is that file
    plus.write_text("x\n")
    assert resolve_prompts(str(plus)) == ["x"]


@pytest.mark.parametrize("bad, part", [("mix:50+nope", "'nope'"), ("wide:0+mix:3", "'wide:0'"), ("wide:x", "'wide:x'")])
def test_a_bad_part_of_a_joined_spec_is_named(bad, part):
    from dflash_cli.engine.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError, match=f"no prompt file or built-in prompt set named {part}") as info:
        resolve_prompts(bad)
    assert "join several with +" in info.value.hint
    assert ("+" not in bad) or repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", ["mix:3+", "mix:3++wide:2", "+mix:3"])
def test_an_empty_part_is_an_error_and_spaces_around_parts_are_not(bad):
    from dflash_cli.engine.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError, match="an empty part in the prompt spec"):
        resolve_prompts(bad)
    assert resolve_prompts("mix:3 + wide:2") == mix_prompts(3) + wide_prompts(2)


def test_the_listed_sets_stay_the_prompts_the_demo_drafter_was_trained_on():
    """The demo drafter's recipe names `mix:24000` and `wide:12000`; a change to their generators changes the data
    such a command makes (and moves stored answers away from their prompts: train refuses those folders)."""
    import hashlib

    digest = {name: hashlib.sha256("\n".join(f(12000)).encode()).hexdigest()[:16]
              for name, f in (("mix", mix_prompts), ("wide", wide_prompts))}
    assert digest == {"mix": MIX_12000_SHA256, "wide": WIDE_12000_SHA256}


def test_each_part_of_a_joined_list_gives_its_own_held_out_prompts():
    assert split_heldout(50) == ([i for i in range(50) if i not in (9, 19, 29, 39, 49)], [9, 19, 29, 39, 49])
    assert split_heldout(50, [50]) == split_heldout(50)
    train, held = split_heldout(400 + 30, [400, 30])
    assert held == list(range(9, 320, 10)) + [409, 419, 429]  # at most 32 from the first part
    assert sorted(train + held) == list(range(430)) and not set(train) & set(held)
    assert split_heldout(7, [2, 5])[1] == [6]  # a part of 4-9 prompts gives its last one; fewer give none


def test_a_prompt_listed_twice_is_not_trained_on_where_another_copy_is_held_out():
    from dflash_cli.train.api import split_prompts

    a = [f"prompt {i}" for i in range(12)]
    b = a[1:] + ["new"]  # b's 10th prompt (place 21) is a's 11th (place 10); b's 9th (20) is a's 10th, held out
    train, held = split_prompts(a + b, [12, 12])
    assert held == [9, 21]
    assert train == [i for i in range(24) if i not in (9, 21, 10, 20)]
    assert split_prompts(a, [12]) == split_heldout(12)


def test_a_later_run_adds_a_set_after_the_stored_answers_and_keeps_them(tmp_path, tiny_target_dir):
    """`--prompts A` then `--prompts A+B` on one folder: A's answers stay as they were and where they were, only
    B's are generated (after them in the list), and each part holds out its own prompts."""
    from dflash_cli.ui.cli import cli

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("".join(f"Question {i} about apples?\n" for i in range(12)))
    b.write_text("".join(f"Write line {i} of a song.\n" for i in range(5)))
    out = tmp_path / "d"
    common = ["train", "-m", str(tiny_target_dir), "-o", str(out), "--block-size", "4", "--anchors", "4",
              "--max-new-tokens", "6", "--device", DEVICE, "--dtype", "float32", "--taps", "1,4"]
    first = CliRunner().invoke(cli, [*common, "--prompts", str(a), "--steps", "2"])
    assert first.exit_code == 0, first.output
    before = read_index(out / "data")["shards"]
    files = {s["file"]: (out / "data" / s["file"]).read_bytes() for s in before}
    assert sorted(i for s in before for i in s["prompts"]) == list(range(12))

    second = CliRunner().invoke(cli, [*common, "--prompts", f"{a}+{b}", "--steps", "4"])
    assert second.exit_code == 0, second.output
    after = read_index(out / "data")["shards"]
    assert after[: len(before)] == before
    assert all((out / "data" / name).read_bytes() == data for name, data in files.items())
    assert sorted(i for s in after[len(before):] for i in s["prompts"]) == list(range(12, 17))
    training = json.loads((out / "config.json").read_text())["training"]
    assert training["prompts"] == f"{a}+{b}"
    assert training["heldout_sequences"] == 2  # prompt 9 of a, the last of b's 5 (index 16); one list of 17: one

    # listed the other way round, the stored answers no longer sit at their prompts' places: refused
    third = CliRunner().invoke(cli, [*common, "--prompts", f"{b}+{a}", "--steps", "6"])
    assert third.exit_code != 0 and "holds an answer to another prompt at place 0" in third.output
    assert read_index(out / "data")["shards"] == after
    # only the last stored prompt changed: its old answer must not pair with the new text either
    changed = tmp_path / "b2.txt"
    changed.write_text(b.read_text().replace("Write line 4 of a song.", "Write line 4 of a poem."))
    fourth = CliRunner().invoke(cli, [*common, "--prompts", f"{a}+{changed}", "--steps", "6"])
    assert fourth.exit_code != 0 and "holds an answer to another prompt at place 16" in fourth.output
    assert read_index(out / "data")["shards"] == after

