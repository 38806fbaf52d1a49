"""Losslessness and bookkeeping of the speculative loop, on tiny fp32 targets (greedy == target alone)."""

from __future__ import annotations

import pytest
import torch
from conftest import MASK_ID, TargetForwardLog, interrupt_on_call
from support.speculation import hf_greedy, oracle_for, random_prompts, tiny_pair

from dflash_cli.engine.generate import generate, stream_generate
from dflash_cli.engine.state import DecodeState


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3-fast", "llama-fast"])
def pair(request, tiny_models):
    """Each tiny pair on transformers' forward and on the fast path (static cache, eager)."""
    return tiny_pair(tiny_models, request.param)


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_greedy_speculative_equals_transformers_generate(pair, block_size):
    for prompt in random_prompts(6, seed=block_size):
        expected = hf_greedy(pair.target, prompt, 30)
        got = generate(pair.target, pair.drafter, prompt, max_new_tokens=30, block_size=block_size, stop_ids=[])
        assert got.tokens == expected
        assert got.stats.steps >= 1 and got.stats.drafted > 0


@pytest.mark.parametrize("acceptance", [1.0, 0.7, 0.3])
def test_partially_right_drafts_stay_lossless(pair, acceptance):
    for i, prompt in enumerate(random_prompts(4, seed=11)):
        expected = hf_greedy(pair.target, prompt, 40)
        oracle = oracle_for(pair, prompt, 40, acceptance=acceptance, seed=i)
        got = generate(pair.target, oracle, prompt, max_new_tokens=40, stop_ids=[], adaptive=False)
        assert got.tokens == expected
        if acceptance < 1.0:
            assert 0 < got.stats.accepted < got.stats.drafted  # both paths ran: accepts and rejections


def test_oracle_drafter_is_accepted_in_full(pair):
    prompt = [7, 21, 9, 64, 3]
    B = pair.drafter.block_size
    n_new = 1 + 4 * B  # the prefill token, then exactly four full blocks
    oracle = oracle_for(pair, prompt, n_new)
    got = generate(pair.target, oracle, prompt, max_new_tokens=n_new, stop_ids=[], adaptive=False)
    assert got.tokens == hf_greedy(pair.target, prompt, n_new)
    assert got.stats.steps == 4
    assert got.stats.acceptance_length == B
    assert got.stats.draft_acceptance == 1.0
    assert got.stats.committed_histogram[B - 1] == 4
    assert got.stats.per_position_acceptance == (1.0,) * (B - 1)


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_max_new_tokens_is_exact_around_the_block_size(pair, offset):
    B = pair.drafter.block_size
    prompt = [4, 8, 15, 16, 23, 42]
    for n_new in {1, B + offset}:
        for drafter in (pair.drafter, oracle_for(pair, prompt, n_new)):
            got = generate(pair.target, drafter, prompt, max_new_tokens=n_new, stop_ids=[])
            assert got.tokens == hf_greedy(pair.target, prompt, n_new)
            assert got.stats.generated_tokens == n_new
            assert got.stats.finish_reason == "length"


def test_stop_token_inside_an_accepted_block(pair):
    prompt = [12, 34, 56, 78]
    continuation = hf_greedy(pair.target, prompt, 60)
    B = pair.drafter.block_size
    # a token whose first occurrence sits strictly inside a block, so the stop cuts an accepted block
    position = next(i for i, t in enumerate(continuation)
                    if continuation.index(t) == i and i > 2 and (i - 1) % B not in (0, B - 1))
    stop = continuation[position]
    oracle = oracle_for(pair, prompt, 60)
    state = DecodeState(pair.target, oracle)
    steps = list(stream_generate(pair.target, oracle, prompt, max_new_tokens=60, stop_ids=[stop], state=state,
                                 adaptive=False))
    tokens = [t for s in steps for t in s.tokens]
    assert tokens == hf_greedy(pair.target, prompt, 60, eos=stop)
    assert tokens[-1] == stop and len(tokens) == position + 1
    assert steps[-1].finish_reason == "stop" and steps[-1].accepted > 0
    state.check()  # the tokens after the stop were rolled back out of both caches
    assert state.tokens == prompt + tokens


def test_caches_hold_exactly_the_committed_context_after_every_step(pair):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    oracle = oracle_for(pair, prompt, 50, acceptance=0.6, seed=3)
    state = DecodeState(pair.target, oracle)
    for step in stream_generate(pair.target, oracle, prompt, max_new_tokens=50, stop_ids=[], state=state):
        state.check()
    # the drafter's cached K/V equal those of a fresh pass over the whole committed context
    target, drafter = pair.target, pair.drafter
    start = state.start
    fresh_target = target.new_cache()
    ids = torch.tensor([state.tokens[:start]], device=target.device)
    _, hidden = target.forward(ids, fresh_target, 0, taps=True)
    fresh = drafter.new_cache()
    block = torch.zeros(1, 1, drafter.config.hidden_size, device=target.device)
    drafter(hidden, block, start, fresh)
    n = state.draft_cache.length
    for layer in range(len(drafter.layers)):
        torch.testing.assert_close(state.draft_cache._k[layer][:, :, :n], fresh._k[layer][:, :, :n],
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state.draft_cache._v[layer][:, :, :n], fresh._v[layer][:, :, :n],
                                   rtol=1e-4, atol=1e-5)


def test_block_size_one_is_plain_decoding(pair):
    prompt = [10, 20, 30]
    got = generate(pair.target, pair.drafter, prompt, max_new_tokens=12, block_size=1, stop_ids=[])
    assert got.tokens == hf_greedy(pair.target, prompt, 12)
    assert got.stats.drafted == 0 and got.stats.steps == 11


def test_plain_decoding_matches_transformers(pair):
    for prompt in random_prompts(3, seed=5):
        got = generate(pair.target, None, prompt, max_new_tokens=20, stop_ids=[])
        assert got.tokens == hf_greedy(pair.target, prompt, 20)
        assert got.stats.block_size == 1 and got.stats.acceptance_length == 1.0


def test_interrupt_mid_forward_leaves_caches_consistent(pair):
    prompt = [9, 8, 7, 6, 5]
    oracle = oracle_for(pair, prompt, 40, acceptance=0.8, seed=1)
    state = DecodeState(pair.target, oracle)
    # mid-forward, on either path
    handle = pair.target.layers[2].mlp.act_fn.register_forward_hook(interrupt_on_call(5))
    got = []
    try:
        with pytest.raises(KeyboardInterrupt):
            for step in stream_generate(pair.target, oracle, prompt, max_new_tokens=40, stop_ids=[], state=state):
                got.extend(step.tokens)
    finally:
        handle.remove()
    state.check()
    assert state.tokens == prompt + got
    # the interrupted state is reusable: continuing gives what an uninterrupted run gives
    more = generate(pair.target, oracle, state.tokens, max_new_tokens=10, stop_ids=[], state=state)
    assert got + more.tokens == hf_greedy(pair.target, prompt, len(got) + 10)


def test_breaking_out_of_the_loop_leaves_caches_consistent(pair):
    prompt = [1, 2, 3]
    state = DecodeState(pair.target, pair.drafter)
    got = []
    for i, step in enumerate(stream_generate(pair.target, pair.drafter, prompt, max_new_tokens=30, stop_ids=[],
                                             state=state)):
        got.extend(step.tokens)
        if i == 3:
            break
    state.check()
    assert state.tokens == prompt + got
    # continuing from the interrupted state gives what one uninterrupted run gives
    with TargetForwardLog(pair.target) as log:
        more = generate(pair.target, pair.drafter, state.tokens, max_new_tokens=12, stop_ids=[], state=state)
    assert log.sizes[0] == more.stats.prefilled_tokens == 1  # the caches were reused, not rebuilt
    assert got + more.tokens == hf_greedy(pair.target, prompt, len(got) + 12)


def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_run(pair):
    turn1 = [5, 6, 7, 8, 9, 10]
    state = DecodeState(pair.target, pair.drafter)
    with TargetForwardLog(pair.target) as log:
        first = generate(pair.target, pair.drafter, turn1, max_new_tokens=15, stop_ids=[], state=state)
        state.check()
        assert log.take()[0] == len(turn1)
        turn2 = turn1 + first.tokens + [33, 44, 55]
        second = generate(pair.target, pair.drafter, turn2, max_new_tokens=15, stop_ids=[], state=state)
        state.check()
        # measured inside the model: the prefill read the three new tokens and the last reply token (never
        # run through the target), and every later forward was one verify block
        prefill, *verifies = log.take()
        assert prefill == second.stats.prefilled_tokens == 4
        assert verifies and max(verifies) <= pair.drafter.block_size
        fresh = generate(pair.target, pair.drafter, turn2, max_new_tokens=15, stop_ids=[],
                         state=DecodeState(pair.target, pair.drafter, own_caches=True))  # leaves `state` its caches
        assert second.tokens == fresh.tokens == hf_greedy(pair.target, turn2, 15)
        log.take()
        # an edited history re-reads only from the first changed token
        turn3 = turn1[:3] + [99] + turn1[4:]
        third = generate(pair.target, pair.drafter, turn3, max_new_tokens=5, stop_ids=[], state=state)
        state.check()
        assert log.take()[0] == third.stats.prefilled_tokens == len(turn3) - 3
        assert third.tokens == hf_greedy(pair.target, turn3, 5)


def test_mask_token_is_read_from_the_target_embedding(pair):
    # the drafter must embed its mask slots with the target's row `mask_token_id`: changing that row
    # changes the drafts (but never the output)
    prompt = [11, 12, 13]
    anchor = torch.tensor([5], device=pair.target.device)
    before = pair.drafter.draft(None, anchor, 0, 8, pair.drafter.new_cache(),
                                pair.target.embed_table, pair.target.lm_head)
    saved = pair.target.embed_weight[MASK_ID].clone()
    try:
        with torch.no_grad():
            pair.target.embed_weight[MASK_ID] += 5.0
        after = pair.drafter.draft(None, anchor, 0, 8, pair.drafter.new_cache(),
                                   pair.target.embed_table, pair.target.lm_head)
        assert not torch.equal(before, after)
    finally:
        with torch.no_grad():
            pair.target.embed_weight[MASK_ID] = saved
    assert generate(pair.target, pair.drafter, prompt, max_new_tokens=8, stop_ids=[]).tokens == \
        hf_greedy(pair.target, prompt, 8)


def test_the_prompt_is_read_into_the_drafter_with_the_prefill(pair):
    """The drafter's context for the prompt is made while reading the prompt (it counts as prefill, and a
    first draft after a pause does not carry the whole prompt); the drafts that follow equal those of
    reading it at the first draft."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    target, drafter = pair.target, pair.drafter
    state = DecodeState(target, drafter)
    steps = stream_generate(target, drafter, prompt, max_new_tokens=8, stop_ids=[], state=state)
    next(steps)  # the prompt read and the first token chosen
    assert state.draft_cache.length == len(prompt) and state.pending_rows == 0
    lazy = DecodeState(target, drafter, own_caches=True)
    lazy.prefill(prompt)
    lazy.commit(state.tokens[-1:], None, anchor=state.anchor)
    assert lazy.pending_rows == len(prompt)
    block = drafter.block_size
    eager_drafts = drafter.draft(state.pending, state.anchor, state.start, block, state.draft_cache,
                                 target.embed_table, target.logits_head)
    lazy_drafts = drafter.draft(lazy.pending, lazy.anchor, lazy.start, block, lazy.draft_cache,
                                target.embed_table, target.logits_head)
    assert eager_drafts.tolist() == lazy_drafts.tolist()
    steps.close()


def test_the_verify_head_takes_few_rows_first_for_a_weak_drafter_and_more_for_a_strong_one():
    from dflash_cli.engine.speculative import first_head_rows

    assert first_head_rows(8, 0.0) == 1  # never right: one row, whose token is the bonus
    assert first_head_rows(2, 5.0) == 2  # too short to split
    firsts = [first_head_rows(16, m) for m in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)]
    assert firsts == sorted(firsts) and firsts[0] == 1 and 4 <= firsts[-1] < 16


def test_the_verify_heads_first_piece_follows_the_measured_costs():
    """Where the head's first rows come almost free (a memory-bound head: a flat cost up to several rows) the
    first piece takes them; where every row costs as much as a call, the split stays small; past the measured
    rows the cost goes on with its last step."""
    from dflash_cli.engine.speculative import first_head_rows

    flat = (0.0, 1.0, 1.02, 1.05, 1.08, 2.0, 2.3, 2.6, 2.9)  # Zen 4's shape: flat to 4 rows, then a step
    linear = (0.0, *(1.0 + k for k in range(1, 9)))  # Zen 1's: each row a call's worth
    assert first_head_rows(8, 1.5, flat) == 4
    assert first_head_rows(8, 1.5, linear) < 4
    assert first_head_rows(8, 0.5, flat) == 4 and first_head_rows(8, 0.5, linear) <= 2
    fixed = (0.0, *(10.0 + 0.1 * k for k in range(1, 9)))  # a call's own cost dominates: one call
    assert first_head_rows(16, 8.0, fixed) == 16  # past the measured 8 rows, their last step
