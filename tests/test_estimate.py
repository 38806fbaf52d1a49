"""The held-out acceptance estimate replays greedy speculative decoding exactly as the engine drafts."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
import torch
from conftest import DEVICE, drafter_config, save_random_drafter, target_config

from dflash_cli.engine.load import attach_drafter, load_drafter, load_target
from dflash_cli.train.config import TrainConfig
from dflash_cli.train.data import Example, load_examples
from dflash_cli.train.estimate import accepted_runs, first_tokens, replay, replay_tau
from dflash_cli.train.trainer import evaluate, make_head


def test_replay_walks_the_greedy_path_and_stops_at_the_reply_end():
    # anchors 0..5 after the first token: commit 3 (2 drafts + 1) at 0, 2 at 3, 1 at 5
    assert replay([2, 0, 9, 1, 7, 0]) == (6, 3)
    # at offset 1 all 4 remaining tokens are drafted right: no bonus token past the end
    assert replay([0, 4, 3, 2, 1]) == (5, 2)
    assert replay([]) == (0, 0)
    tau, by_set = replay_tau([(6, 3), (5, 2), (0, 0)], ["math", "code", "math"])
    assert tau == pytest.approx((2.0 + 2.5) / 2) and by_set == {"code": 2.5, "math": 2.0}


def test_first_tokens_cuts_the_reply_as_a_token_limit_does():
    ids, feats = torch.arange(300), torch.randn(299, 4)
    cut = first_tokens(Example(ids, feats, prompt_len=20), 128)
    assert cut.ids.tolist() == list(range(148)) and torch.equal(cut.features, feats[:147]) and cut.prompt_len == 20
    short = first_tokens(Example(ids[:50], feats[:49], prompt_len=20), 128)
    assert len(short.ids) == 50 and len(short.features) == 49


def _engine_drafts(drafter, target, features, ids, p):
    """What the engine drafts at anchor p: a fresh cache, the tapped rows before p as its context."""
    anchor = ids[p : p + 1]
    return drafter.draft(features[None, :p].float(), anchor, p, drafter.block_size, drafter.new_cache(),
                         target.embed_table, target.logits_head)


def _walked_tau(drafter, target, example):
    """tau of greedy speculative decoding along a stored reply, step by step with the engine's drafts: at
    anchor p the leading drafts equal to the reply are accepted, plus the target's own token, never past
    the reply's end (bench's default 128 tokens are more than these replies hold)."""
    ids, features = example.ids.to(DEVICE), example.features.to(DEVICE)
    assert len(ids) - example.prompt_len <= 128
    p, tokens, steps = example.prompt_len, 0, 0
    while p < len(ids) - 1:
        drafts = _engine_drafts(drafter, target, features, ids, p).tolist()
        accepted = 0
        while accepted < len(drafts) and p + 1 + accepted < len(ids) and drafts[accepted] == ids[p + 1 + accepted]:
            accepted += 1
        committed = min(accepted + 1, len(ids) - 1 - p)
        tokens, steps, p = tokens + committed, steps + 1, p + committed
    return tokens / steps


@pytest.mark.parametrize("with_draft_vocab", [False, True])
def test_estimate_counts_what_the_engine_would_accept_along_the_greedy_path(tmp_path, tiny_target_dir,
                                                                           with_draft_vocab):
    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    dcfg = drafter_config(target_config("qwen3"), block_size=6)
    drafter = load_drafter(save_random_drafter(tmp_path / "d", dcfg, seed=3), device=DEVICE, dtype="float32")
    vocab_rows = target.embed_weight.shape[0]
    if with_draft_vocab:  # and a drafter that scales its block's embeddings, as some published ones do
        drafter.draft_vocab = torch.tensor(sorted(random.Random(0).sample(range(vocab_rows), 60)), device=DEVICE)
        drafter.config = dataclasses.replace(drafter.config, input_embedding_scale=3.0)
    attach_drafter(target, drafter)
    rng = random.Random(5)
    prompt_len, length = 7, 60
    features = torch.randn(length - 1, dcfg["hidden_size"] * 3, generator=torch.Generator().manual_seed(0))
    features = (features * 2).to(torch.bfloat16).to(DEVICE)  # stored as the data cache stores them
    ids = torch.tensor([rng.randrange(3, vocab_rows) for _ in range(length)], device=DEVICE)
    # Make the reply what a drafter that is often right would see: at each anchor on the greedy path, the
    # next `take` tokens are the engine's own drafts and the one after differs (a draft at p depends only on
    # rows < p and on x_p, so later edits do not change it).
    p, path = prompt_len, []
    while p < length - 1:
        drafts = _engine_drafts(drafter, target, features, ids, p)
        take = min(rng.choice([0, 1, 2, 5]), length - 1 - p)
        ids[p + 1 : p + 1 + take] = drafts[:take]
        if take < len(drafts) and p + 1 + take < length:
            ids[p + 1 + take] = drafts[take] + 1 if drafts[take] + 1 < vocab_rows else 3
        path.append(take)
        p += min(take + 1, length - 1 - p)
    example = Example(ids=ids.cpu(), features=features.cpu(), prompt_len=prompt_len)
    head = make_head(target.lm_head, drafter.draft_vocab)

    def draft_ids(h):
        if drafter.draft_vocab is not None:
            return drafter.draft_vocab[head.logits(h).argmax(-1)]
        return target.lm_head(h).argmax(-1)

    runs = accepted_runs(drafter, target.embed_weight, draft_ids, example, chunk=5)
    expected = []
    for p in range(prompt_len, length - 1):
        drafts = _engine_drafts(drafter, target, features, ids, p)
        following = ids[p + 1 : p + 1 + len(drafts)]  # fewer near the reply's end
        expected.append(int((drafts[: len(following)] == following).cumprod(0).sum()))
    assert runs == expected
    assert sum(path) > 10  # the path is not all misses: the check has accepted drafts to count
    tokens, steps = replay(runs)
    assert (tokens, steps) == (length - 1 - prompt_len, len(path))

    estimate = evaluate(drafter, target.embed_weight, target.lm_head, head, [example, example],
                        TrainConfig(batch=2, anchors=4), None, drafter.draft_vocab, sets=["code", "code"])
    assert estimate.tau == pytest.approx(tokens / steps)
    assert estimate.by_set == {"code": pytest.approx(tokens / steps)}

    # a reply longer than bench's default -n counts its first 128 tokens only
    extra = 200 - (length - prompt_len)
    long = Example(ids=torch.cat([example.ids, torch.randint(3, vocab_rows, (extra,))]),
                   features=torch.cat([example.features, torch.randn(extra, features.shape[1]).to(torch.bfloat16)]),
                   prompt_len=prompt_len)
    cut, whole = (replay(accepted_runs(drafter, target.embed_weight, draft_ids, e)) for e in (first_tokens(long), long))
    assert cut[0] == 127 and whole[0] == 199
    estimate = evaluate(drafter, target.embed_weight, target.lm_head, head, [long], TrainConfig(batch=1, anchors=4),
                        None, drafter.draft_vocab)
    assert estimate.tau == pytest.approx(cut[0] / cut[1]) != pytest.approx(whole[0] / whole[1])


def test_prompt_categories_align_with_the_built_in_sets(tmp_path):
    from dflash_cli.train.prompts import resolve_prompts, resolve_prompts_with_categories
    from dflash_cli.train.prompts.demo import demo_prompts_with_categories
    from dflash_cli.train.prompts.mix import mix_prompts_with_categories

    for spec, pairs in [("mix:300", mix_prompts_with_categories(300)), ("demo:300", demo_prompts_with_categories(300))]:
        prompts, cats = resolve_prompts_with_categories(spec)
        assert prompts == resolve_prompts(spec) == [p for _, p in pairs]
        assert cats == [c for c, _ in pairs] and set(cats) == {"math", "code", "chat"}
    path = tmp_path / "p.txt"
    path.write_text("one\ntwo\n")
    assert resolve_prompts_with_categories(str(path)) == (["one", "two"], None)
    assert resolve_prompts_with_categories(None) == (resolve_prompts(None), None)


def test_cli_train_prints_the_estimate_per_prompt_set(tmp_path, tiny_target_dir):
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    result = CliRunner().invoke(cli, ["train", "-m", str(tiny_target_dir), "-o", str(tmp_path / "d"),
                                      "--prompts", "mix:50", "--steps", "2", "--block-size", "4",
                                      "--anchors", "4", "--max-new-tokens", "10", "--device", DEVICE,
                                      "--dtype", "float32", "--taps", "1,4"])
    assert result.exit_code == 0, result.output
    training = json.loads((tmp_path / "d" / "config.json").read_text())["training"]
    by_set = training["heldout_tau_by_set"]
    from dflash_cli.train.prompts import resolve_prompts_with_categories

    categories = resolve_prompts_with_categories("mix:50")[1]
    held_ids = (9, 19, 29, 39, 49)  # split_heldout's picks: 2 code prompts, 3 math ones
    held = [categories[i] for i in held_ids]
    assert set(by_set) == set(held)
    # The figures themselves, recomputed independently: greedy speculative decoding walked along each
    # held-out reply the run stored, with the drafter it saved drafting as the engine does (draft() on a
    # fresh cache at each anchor), macro-averaged per reply, then per set.
    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    drafter = load_drafter(tmp_path / "d", device=DEVICE, dtype="float32")
    attach_drafter(target, drafter)
    stored = load_examples(tmp_path / "d" / "data")
    taus: dict[str, list[float]] = {}
    for i in held_ids:
        if i in stored and len(stored[i].ids) - stored[i].prompt_len >= 2:  # what training holds out
            taus.setdefault(categories[i], []).append(_walked_tau(drafter, target, stored[i]))
    assert training["heldout_sequences"] == sum(len(v) for v in taus.values()) >= 4
    assert by_set == {name: pytest.approx(sum(v) / len(v)) for name, v in taus.items()}
    every = [t for v in taus.values() for t in v]
    assert training["heldout_tau"] == pytest.approx(sum(every) / len(every))  # over replies, not over sets
    shown = re.search(r"held-out acceptance estimate tau (\d\.\d\d)((?:, \w+ \d\.\d\d)+) \(greedy, full blocks",
                      result.output)
    assert shown and shown.group(1) == f"{training['heldout_tau']:.2f}"
    assert dict(re.findall(r"(\w+) (\d\.\d\d)", shown.group(2))) == {k: f"{v:.2f}" for k, v in by_set.items()}
