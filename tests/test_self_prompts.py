"""`train --prompts self:N` (train/prompts/self_written.py, train/prompts/quality.py): prompts the target writes
from its chat template's user-turn header, sampled reproducibly, cleaned, deduplicated, resumable, and trained
on."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import save_target, save_tiny_tokenizer, target_config

from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.load import load_target
from dflash_cli.train.prompts import self_written as sp
from dflash_cli.train.prompts.quality import NearDuplicates, category, prompt_stats, rejection

SETTINGS = sp.SelfPromptSettings(seed=3, max_tokens=32)


def save_chatty_target(folder, end_logit: float):
    """The tiny random Qwen3 target with ChatML, made to end a sampled user turn as a real instruct model does:
    every embedding gets a shared component (dimension 0), which the final hidden states keep, and the LM head's
    row for <|im_end|> (id 2) reads only that component, for a logit of about `end_logit` at every position
    (the others' largest is about 1.3)."""
    from transformers import AutoModelForCausalLM

    save_target(folder, target_config("qwen3"), seed=1, scale=3.0)
    save_tiny_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 1.0
        ids = torch.randint(4, 100, (8, 40), generator=torch.Generator().manual_seed(0))
        shared = model.model(ids).last_hidden_state[..., 0].mean()
        model.lm_head.weight[2] = 0.0
        model.lm_head.weight[2, 0] = end_logit / shared
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chatty_target_dir(tmp_path_factory):
    """Turns of ~10 tokens (p(<|im_end|>) ~ 0.1 per token); greedy replies end at once."""
    return save_chatty_target(tmp_path_factory.mktemp("self-target") / "qwen3", 3.0)


@pytest.fixture(scope="module")
def chatty(chatty_target_dir):
    from transformers import AutoTokenizer

    return (load_target(chatty_target_dir, device="cpu", dtype="float32"),
            AutoTokenizer.from_pretrained(str(chatty_target_dir)))


def test_the_user_turn_is_the_templates_opening_and_its_closing_token(chatty):
    _, tokenizer = chatty
    turn = sp.user_turn(tokenizer, [2])
    assert tokenizer.decode(turn.header, skip_special_tokens=False) == "<|im_start|>user\n"
    assert turn.stop_ids == [2] and "<|im_end|>" in turn.end_texts and "<|im_start|>" in turn.end_texts
    text, closed = sp.turn_text(tokenizer, turn, tokenizer.encode("Hi there<|im_end|>\n<|im_start|>user\n",
                                                                  add_special_tokens=False))
    assert (text, closed) == ("Hi there", True)
    assert sp.turn_text(tokenizer, turn, tokenizer.encode("an open turn", add_special_tokens=False)) == (
        "an open turn", False)
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = None
    with pytest.raises(InvalidSettingError, match="need a chat template") as e:
        sp.user_turn(tokenizer)
    assert "instruct model" in e.value.hint


def test_draws_follow_the_nucleus_distribution_and_depend_on_seed_index_and_position_only():
    from dflash_cli.engine.sampling import sampling_probs

    scores = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 4
    for top_p in (1.0, 0.9):
        settings = sp.SelfPromptSettings(seed=1, temperature=0.8, top_p=top_p)
        n = 6000
        rows = scores.repeat_interleave(n, 0)
        tokens = sp.draw_tokens(settings, list(range(3 * n)), torch.zeros(3 * n, dtype=torch.long), rows)
        probs = sampling_probs(scores, 0.8, top_p)
        for r in range(3):
            counts = torch.bincount(tokens[r * n : (r + 1) * n], minlength=500).float() / n
            assert 0.5 * (counts - probs[r]).abs().sum() < 0.06, (top_p, r)
            assert counts[probs[r] == 0].sum() == 0  # never outside the nucleus
        # the same (index, position) draws the same token in any batch and order
        keys, positions = [7, 3, 11], torch.tensor([5, 9, 2])
        together = sp.draw_tokens(settings, keys, positions, scores)
        alone = [sp.draw_tokens(settings, [k], positions[i : i + 1], scores[i : i + 1]) for i, k in enumerate(keys)]
        assert together.tolist() == torch.cat(alone).tolist()
    assert sp.uniform(1, 2, 3) == sp.uniform(1, 2, 3) != sp.uniform(1, 2, 4)
    assert len({sp.uniform(0, i, 0) for i in range(1000)}) == 1000


def test_the_batched_generator_and_transformers_generate_write_the_same_turns(chatty):
    target, tokenizer = chatty
    turn = sp.user_turn(tokenizer, [2])
    batched = {i: ids for i, ids, _ in sp.write_candidates(target, turn, list(range(10)), SETTINGS, width=4)}
    plain = sp._generate_turns(target, turn, list(range(10)), SETTINGS)
    assert [batched[i] for i in range(10)] == plain
    lengths = [len(ids) for ids in plain]
    assert min(lengths) < SETTINGS.max_tokens and all(2 not in ids[:-1] for ids in plain)
    assert len({tuple(ids) for ids in plain}) >= 8


def test_self_prompts_end_at_the_turn_are_distinct_reproducible_and_resume(chatty, tmp_path):
    target, tokenizer = chatty
    first = sp.sample_self_prompts(target, tokenizer, 12, tmp_path / "a", SETTINGS, stop_ids=[2])
    assert len(first.prompts) == len(set(first.prompts)) == 12 and first.sampled >= 12
    assert not any("<|im_end|>" in p or "<|im_start|>" in p for p in first.prompts)
    assert all(rejection(p, True) is None for p in first.prompts)
    assert first.categories == [category(p) for p in first.prompts]
    folder = tmp_path / "a" / sp.FOLDER
    settings = json.loads((folder / "settings.json").read_text())
    assert settings["seed"] == 3 and settings["temperature"] == sp.TEMPERATURE and settings["header"]
    assert json.loads((folder / "summary.json").read_text())["count"] == 12
    # read back: nothing sampled again
    again = sp.sample_self_prompts(target, tokenizer, 12, tmp_path / "a", SETTINGS, stop_ids=[2])
    assert again.prompts == first.prompts and again.sampled == 0
    # an interrupted run (half the candidates, the last line cut off) resumes to the same set
    lines = (folder / "candidates.jsonl").read_text().splitlines(keepends=True)
    resumed = tmp_path / "b" / sp.FOLDER
    resumed.mkdir(parents=True)
    (resumed / "settings.json").write_text((folder / "settings.json").read_text())
    (resumed / "candidates.jsonl").write_text("".join(lines[: len(lines) // 2]) + lines[len(lines) // 2][:9])
    back = sp.sample_self_prompts(target, tokenizer, 12, tmp_path / "b", SETTINGS, stop_ids=[2])
    assert back.prompts == first.prompts and 0 < back.sampled < len(lines)
    assert all(json.loads(line) for line in (resumed / "candidates.jsonl").read_text().splitlines())
    # another seed, another set; more prompts extend the same list
    other = sp.sample_self_prompts(target, tokenizer, 12, tmp_path / "c", sp.SelfPromptSettings(seed=4, max_tokens=32),
                                   stop_ids=[2])
    assert other.prompts != first.prompts
    more = sp.sample_self_prompts(target, tokenizer, 16, tmp_path / "a", SETTINGS, stop_ids=[2])
    assert more.prompts[:12] == first.prompts
    with pytest.raises(InvalidSettingError, match=r"sampled with other settings \(seed\)") as e:
        sp.sample_self_prompts(target, tokenizer, 12, tmp_path / "a", sp.SelfPromptSettings(seed=9, max_tokens=32))
    assert "another output folder" in e.value.hint


def test_a_target_that_repeats_itself_is_told_so_with_a_hint(chatty, tmp_path):
    target, tokenizer = chatty
    cold = sp.SelfPromptSettings(seed=0, temperature=1e-4, max_tokens=32)  # nearly greedy: one turn over and over
    with pytest.raises(InvalidSettingError, match=r"wrote only \d usable, distinct prompts in \d+ tries") as e:
        sp.sample_self_prompts(target, tokenizer, 5, tmp_path, cold, stop_ids=[2])
    assert "self:" in e.value.hint


def test_what_is_rejected_and_what_counts_as_a_near_duplicate():
    assert rejection("Can you explain how tides work?", False) == "unfinished"
    assert rejection("Hi there", True) == "short"
    assert rejection("word " * 500, True) == "long"
    assert rejection("Расскажи мне о приливах и отливах", True) == "script"
    assert rejection("Explain tides \ufffd please", True) == "broken"
    assert rejection("Écris une lettre à mon propriétaire.", True) is None  # Latin letters with accents
    # each limit from both sides: 3 words and 2000 characters are kept, 2 words and 2001 characters are not
    assert rejection("Explain ocean tides", True) is None and rejection("Explain tides", True) == "short"
    assert rejection("a " * 999 + "b.", True) is None and rejection("a " * 1000 + "b", True) == "long"
    # Latin Extended-A letters count as Latin: Polish and Czech prompts are kept
    assert rejection("Napisz krótki list do właściciela mieszkania, proszę.", True) is None
    assert rejection("Vysvětli mi, jak fungují příliv a odliv, prosím.", True) is None
    seen = NearDuplicates()
    long = "I'm planning a small dinner party for six friends next Saturday. Can you suggest a simple menu?"
    assert seen.add(long)
    assert not seen.add(long.upper())  # the same words
    assert not seen.add(long.replace("six", "eight"))  # one word changed in a long prompt
    assert seen.add("Write a Python function that reverses a linked list in place.")
    assert seen.add("Write a Python function that checks whether a number is prime.")
    chosen = sp.select({0: sp.Candidate(long, True), 1: sp.Candidate(long.lower(), True),
                        2: sp.Candidate("Hi", True), 3: sp.Candidate("What is 15% of 80?", True),
                        5: sp.Candidate("never looked at: 4 is missing", True)}, 10)
    assert chosen.prompts == [long, "What is 15% of 80?"] and chosen.indices == [0, 3] and chosen.scanned == 4
    assert dict(chosen.rejected) == {"duplicate": 1, "short": 1}


def test_categories_and_the_summary_of_a_set():
    assert category("What is 15% of 80?") == "math"
    assert category("Solve for x: 3x + 2 = 11") == "math"
    assert category("Write a Python function that sorts a list") == "code"
    assert category("Can you help me plan a trip to Lisbon?") == "chat"
    assert category("The sun sets over the quiet harbour") == "other"
    prompts = ["What is 15% of 80?", "Write a Python function that sorts a list",
               "Can you help me plan a trip to Lisbon?", "Can you help me plan a trip to Lisbon?"]
    stats = prompt_stats(prompts, {"short": 2})
    assert stats.count == 4 and stats.categories == {"math": 0.25, "code": 0.25, "chat": 0.5, "other": 0.0}
    assert stats.near_duplicates == 0.25 and stats.rejected == {"short": 2} and 0 < stats.distinct_2 < 1


def test_self_joins_other_sets_holds_out_its_share_and_is_refused_where_no_target_samples_it():
    from dflash_cli.train.api import _resolve_prompts, split_prompts
    from dflash_cli.train.prompts import check_prompt_spec, resolve_prompts

    asked = []

    def fake(n):  # what the target would write: only the joining is under test here
        asked.append(n)
        return [f"self prompt {i}" for i in range(n)], ["chat"] * n

    joined = _resolve_prompts("self:20+mix:30", fake)
    assert asked == [20] and joined.part_sizes == [20, 30] and joined.texts[:20] == fake(20)[0]
    assert joined.categories is not None and joined.categories[:20] == ["chat"] * 20
    _, held = split_prompts(joined.texts, joined.part_sizes)
    assert held == [9, 19, 29, 39, 49]  # every 10th of each part
    assert _resolve_prompts("self", fake).part_sizes == [4000]
    check_prompt_spec("self:5+wide:10")  # nothing sampled, no error
    with pytest.raises(InvalidSettingError, match="only train samples them"):
        resolve_prompts("self:5")
    with pytest.raises(InvalidSettingError, match="more than one self part"):
        check_prompt_spec("self:5+mix:10+self:3")
    for bad in ("self:0", "self:many"):
        with pytest.raises(InvalidSettingError, match="no prompt file or built-in prompt set") as e:
            check_prompt_spec(bad)
        assert "self" in e.value.hint


def test_checking_a_spec_draws_no_set_but_reads_files_and_refuses_bad_parts(tmp_path, monkeypatch):
    from dflash_cli.train import prompts

    def no_drawing(n=None):
        raise AssertionError("check_prompt_spec drew a set")

    monkeypatch.setitem(prompts.CATEGORIZED_SETS, "mix", no_drawing)
    monkeypatch.setitem(prompts.CATEGORIZED_SETS, "wide", no_drawing)
    mine = tmp_path / "mine.txt"
    mine.write_text("first prompt\nsecond prompt\n")
    prompts.check_prompt_spec(f"mix:24000+wide+self:9+{mine}")
    with pytest.raises(InvalidSettingError, match="mix:0.*in 'wide:5\\+mix:0'"):
        prompts.check_prompt_spec("wide:5+mix:0")
    with pytest.raises(InvalidSettingError, match="no prompt file"):
        prompts.check_prompt_spec(f"mix+{tmp_path / 'missing.txt'}")
    with pytest.raises(AssertionError, match="drew a set"):  # resolving still draws
        prompts.resolve_prompt_parts("mix:3")


def test_train_on_self_prompts_end_to_end_writes_a_lossless_drafter(tmp_path):
    from click.testing import CliRunner

    from dflash_cli.engine.generate import generate
    from dflash_cli.engine.load import load_pair
    from dflash_cli.ui.cli import cli

    # an end of turn sampled now and then (turns of ~60 tokens) but rarely greedy: replies go on
    chatty_target_dir = save_chatty_target(tmp_path / "target", 1.0)
    out = tmp_path / "d"
    result = CliRunner().invoke(cli, ["train", "-m", str(chatty_target_dir), "-o", str(out), "--prompts", "self:8",
                                      "--steps", "3", "--block-size", "4", "--anchors", "4", "--max-new-tokens", "12",
                                      "--device", "cpu", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^sampled \d+/\d+ candidate prompts for self:8", result.stderr, re.M)
    assert re.search(r"self:8: prompts the target wrote, kept from \d+ samples", result.stderr)
    assert "generated 8/8 replies" in result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["training"]["prompts"] == "self:8" and config["training"]["step"] == 3
    stored = [json.loads(line) for line in (out / sp.FOLDER / "candidates.jsonl").read_text().splitlines()]
    assert len(stored) >= 8
    pair = load_pair(chatty_target_dir, out, device="cpu", dtype="float32")
    target_only = load_target(chatty_target_dir, device="cpu", dtype="float32")
    for prompt in ([5, 9, 30, 41], [70, 71, 72, 3, 8, 100]):
        plain = generate(target_only, None, prompt, max_new_tokens=20, stop_ids=[])
        assert generate(pair.target, pair.drafter, prompt, max_new_tokens=20, stop_ids=[]).tokens == plain.tokens


def test_a_prompt_file_is_jsonl_by_its_content_not_its_name(tmp_path):
    """JSONL lines give their "prompt" fields whatever the file is called; other files give their lines."""
    from dflash_cli.train.data import read_prompts

    lines = ['{"prompt": "Explain tides"}', '{"id": 7, "prompt": "Write a haiku"}']
    for name in ("p.jsonl", "p.json", "p.txt"):
        (tmp_path / name).write_text("\n".join(lines) + "\n\n")
        assert read_prompts(tmp_path / name) == ["Explain tides", "Write a haiku"]
    (tmp_path / "plain.jsonl").write_text("Explain tides\n\n  Write a haiku  \n")
    assert read_prompts(tmp_path / "plain.jsonl") == ["Explain tides", "Write a haiku"]
