"""Adaptive block sizes: decisions (not timings), with drafters of controlled quality and injected costs."""

from __future__ import annotations

import random

import pytest
from conftest import DEVICE

from dflash_cli.engine.adaptive import BlockSizeController
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.oracle import OracleDrafter

B = 16


def round_cost(draft: float, verify_slope: float):
    """Seconds of a round of n slots: a 1.0 s plain decode, a verify that grows with n, a draft."""
    return lambda n: 1.0 if n == 1 else 1.0 + verify_slope * (n - 1) + draft


def run_rounds(controller: BlockSizeController, q: float, cost, rounds: int, rng: random.Random) -> list[int]:
    """Each round: the controller picks n, drafts are accepted left to right with probability q."""
    chosen = []
    for _ in range(rounds):
        n = controller.choose()
        accepted = 0
        while accepted < n - 1 and rng.random() < q:
            accepted += 1
        controller.observe(n, accepted, cost(n))
        chosen.append(n)
    return chosen


def simulate(q: float, cost, rounds: int = 600, seed: int = 0) -> list[int]:
    chosen = run_rounds(BlockSizeController(B, cost=cost), q, cost, rounds, random.Random(seed))
    return chosen[100:]  # after the learning phase


def best_block(q: float, cost) -> int:
    def rate(n):
        return sum(q**k for k in range(n)) / cost(n)
    return max(range(1, B + 1), key=rate)


def test_a_useless_drafter_ends_up_drafting_rarely():
    chosen = simulate(0.0, round_cost(draft=0.3, verify_slope=0.05))
    drafting = sum(n > 1 for n in chosen) / len(chosen)
    assert drafting < 0.1  # paused, with an occasional re-probe


def test_a_good_drafter_keeps_full_blocks():
    chosen = simulate(0.95, round_cost(draft=0.2, verify_slope=0.01))
    assert sum(n == B for n in chosen) / len(chosen) > 0.9


def test_a_mediocre_drafter_settles_on_a_shorter_block():
    cost = round_cost(draft=0.1, verify_slope=0.12)
    best = best_block(0.6, cost)
    assert 2 <= best < B // 2
    chosen = simulate(0.6, cost)
    typical = max(set(chosen), key=chosen.count)
    assert abs(typical - best) <= 1 and sum(n > 1 for n in chosen) / len(chosen) > 0.9


def test_a_drafter_that_starts_to_pay_is_picked_up_again():
    rng = random.Random(1)
    cost = round_cost(draft=0.2, verify_slope=0.01)
    controller = BlockSizeController(B, cost=cost)
    for phase_q, rounds in ((0.0, 300), (0.95, 300)):
        chosen = run_rounds(controller, phase_q, cost, rounds, rng)
        if phase_q == 0.0:
            assert chosen[-50:].count(1) > 40
        else:
            assert chosen[-50:].count(B) > 40  # a re-probe noticed the better drafter


@pytest.fixture(scope="module")
def pair(tiny_models):
    return load_pair(tiny_models["qwen3"], tiny_models["qwen3-drafter"], device=DEVICE, dtype="float32")


@pytest.mark.parametrize("acceptance, expect_drafting", [(0.0, False), (1.0, True)])
def test_the_loop_follows_the_controller_and_stays_lossless(pair, acceptance, expect_drafting):
    prompt = [5, 9, 14, 20, 33]
    plain = generate(pair.target, None, prompt, max_new_tokens=150, stop_ids=[])
    oracle = OracleDrafter(pair.drafter, prompt + plain.tokens + [0] * 32, acceptance=acceptance)
    controller = BlockSizeController(pair.drafter.block_size, cost=round_cost(draft=0.3, verify_slope=0.02))
    got = generate(pair.target, oracle, prompt, max_new_tokens=150, stop_ids=[], controller=controller)
    assert got.tokens == plain.tokens
    stats = got.stats
    assert stats.adaptive and sum(stats.block_rounds) == stats.steps
    if expect_drafting:
        assert stats.block_rounds[-1] > 0.8 * stats.steps
    else:
        assert stats.block_rounds[0] > 0.7 * stats.steps  # mostly plain steps
        # why, in the measured costs and acceptance (-v's "paused because", --json's pause_reason)
        assert "tokens of context a block of" in stats.pause_reason and "plain decoding 1 in 1000.0 ms" in \
            stats.pause_reason
        from dflash_cli.ui.stats_text import stats_block, stats_json

        assert stats_json(stats)["pause_reason"] == stats.pause_reason
        assert any(line.startswith("paused because:") for line in stats_block(stats))


def test_a_fixed_block_size_turns_adaptation_off(pair):
    got = generate(pair.target, pair.drafter, [1, 2, 3], max_new_tokens=20, stop_ids=[], block_size=4)
    assert not got.stats.adaptive and got.stats.block_rounds[3] >= got.stats.steps - 3  # the tail is clamped


def test_a_decode_state_keeps_its_block_size_choice_across_replies(pair):
    """A chat or a server passes only its DecodeState: the controller that state keeps chooses each reply's
    blocks and carries what it learned to the next one; a fixed block size bypasses it."""
    from dflash_cli.engine.state import DecodeState

    state = DecodeState(pair.target, pair.drafter)
    first = generate(pair.target, pair.drafter, [5, 9, 14], max_new_tokens=30, stop_ids=[], state=state)
    controller = state.block_controller(pair.drafter.block_size)
    after_first = controller.rounds
    second = generate(pair.target, pair.drafter, [5, 9, 14, 20], max_new_tokens=30, stop_ids=[], state=state)
    assert first.stats.adaptive and second.stats.adaptive
    assert after_first > 0 and controller.rounds > after_first
    assert state.block_controller(pair.drafter.block_size) is controller
    fixed = generate(pair.target, pair.drafter, [5, 9], max_new_tokens=10, stop_ids=[], state=state, block_size=4)
    assert not fixed.stats.adaptive and state.block_controller(pair.drafter.block_size) is controller


def length_cost(n: int, length: int) -> float:
    """Seconds of a round at a context of `length` tokens: a decode and a verify that read every cached
    position (a verify for each of its n rows), and a draft."""
    return 1.0 + length / 8000 if n == 1 else 1.2 + 0.05 * (n - 1) + n * length / 8000


def run_context(controller: BlockSizeController, q: float, start: int, stop: int,
                rng: random.Random) -> list[tuple[int, int]]:
    """Rounds from `start` to `stop` tokens of context, each round's cost measured at its length:
    (length, block) per round."""
    chosen, length = [], start
    while length < stop:
        n = controller.choose(length)
        accepted = 0
        while accepted < n - 1 and rng.random() < q:
            accepted += 1
        controller.observe(n, accepted, length_cost(n, length))
        chosen.append((length, n))
        length += accepted + 1
    return chosen


def test_speculation_pauses_past_the_break_even_length_and_resumes_at_a_short_one():
    rng = random.Random(3)
    controller = BlockSizeController(8)
    best = {length: max(range(1, 9), key=lambda n: sum(0.7**k for k in range(n)) / length_cost(n, length))
            for length in (100, 14000)}
    assert best[100] > 1 and best[14000] == 1  # the break-even lies between (about 12k tokens)
    long_reply = run_context(controller, 0.7, 50, 20000, rng)
    short = [n for length, n in long_reply if length < 400]
    far = [n for length, n in long_reply if length > 14000]
    assert sum(n > 1 for n in short) / len(short) > 0.8  # drafting pays near the start
    assert sum(n == 1 for n in far) / len(far) > 0.85  # paused past the break-even (a re-probe now and then)
    # the next reply starts short again (a chat's state keeps its controller): drafting resumes at once, from
    # the costs measured at that length, not after a re-probe of the long context's
    again = [n for _, n in run_context(controller, 0.7, 50, 120, rng)][:10]
    assert sum(n > 1 for n in again) >= 8, again


def test_a_new_request_starts_from_the_costs_and_acceptance_earlier_requests_measured():
    """bench's prompts, serve's requests: a controller sharing a drafter's RoundCosts skips the warm-up where
    drafting was measured not to pay, and drafts at once where it was measured to pay."""
    from dflash_cli.engine.adaptive import RoundCosts

    cost = round_cost(draft=0.3, verify_slope=0.05)
    for q, drafting in ((0.0, False), (0.9, True)):
        shared = RoundCosts()
        run_rounds(BlockSizeController(8, shared=shared), q, cost, 200, random.Random(1))
        fresh = run_rounds(BlockSizeController(8), q, cost, 10, random.Random(2))
        again = run_rounds(BlockSizeController(8, shared=shared), q, cost, 10, random.Random(2))
        assert fresh[0] == 8  # nothing known: a full block first
        if drafting:
            assert all(n > 1 for n in again), again
        else:
            assert all(n == 1 for n in again), again


def test_costs_kept_by_an_earlier_process_start_the_next_one_and_count_as_one_round():
    """RoundCosts through to_dict/JSON/from_dict (runtime/round_costs.py keeps them in the cache folder): the
    next process measures no costs again (each read counts as one round: a faster round replaces it), drafts
    one full block to measure its own request, and then decides. A drafter that did not pay stays paused; one
    whose last request paused it but that pays on this one drafts again at once (with the pause and its
    backed-off re-probes carried over, it would wait 192 plain rounds)."""
    import json

    from dflash_cli.engine.adaptive import RoundCosts

    cost = round_cost(draft=0.3, verify_slope=0.05)
    shared = RoundCosts()
    run_rounds(BlockSizeController(8, shared=shared), 0.0, cost, 400, random.Random(1))
    assert shared.probe_gap > 24

    def restored() -> RoundCosts:
        return RoundCosts.from_dict(json.loads(json.dumps(shared.to_dict())))

    again = restored()
    assert again.seconds == shared.seconds and again.reached[1] <= 1.0
    assert all(count == 1 for table in again.samples.values() for count in table.values())
    useless = run_rounds(BlockSizeController(8, shared=again), 0.0, cost, 40, random.Random(2))
    assert useless[0] == 8 and sum(n > 1 for n in useless[1:]) <= 2, useless  # one block, then paused
    good = run_rounds(BlockSizeController(8, shared=restored()), 1.0, cost, 40, random.Random(2))
    assert sum(n > 1 for n in good) >= 30, good
    controller = BlockSizeController(8, shared=restored())
    controller.observe(1, 0, 0.5 * shared.seconds[0][1])
    assert controller.cost(1) == pytest.approx(0.5 * shared.seconds[0][1])


@pytest.mark.parametrize("damage", [
    lambda d: d["seconds"]["0"].update({"1": -1.0}),
    lambda d: d["seconds"]["0"].update({"1": float("nan")}),
    lambda d: d.update(accepted=[x + 5.0 for x in d["reached"]]),
    lambda d: d.update(reached=d["reached"][:2]),
    lambda d: d.pop("accepted"),
    lambda d: d.update(seconds=[1, 2]),
    lambda d: d["seconds"]["0"].update({"0": 0.01}),  # the one draft key of version 1's files
    lambda d: d.update(forecast_pays="no"),
    lambda d: d.update(worth=-1.0),
    lambda d: d.update(worth=1e9),
])
def test_costs_kept_out_of_range_are_refused(damage):
    from dflash_cli.engine.adaptive import RoundCosts

    shared = RoundCosts()
    run_rounds(BlockSizeController(8, shared=shared), 0.5, round_cost(0.3, 0.05), 30, random.Random(1))
    data = shared.to_dict()
    RoundCosts.from_dict(data)  # as kept: fine
    damage(data)
    with pytest.raises((ValueError, TypeError, KeyError, AttributeError)):
        RoundCosts.from_dict(data)


def test_a_failing_re_probe_waits_longer_for_the_next():
    """A paused drafter is re-probed after 24 plain rounds, then 48, 96, ... up to 8 times that: a probe costs
    more than the plain round it replaces (a draft plus a verify of two rows)."""
    controller = BlockSizeController(8, cost=round_cost(draft=0.3, verify_slope=0.05))
    chosen = run_rounds(controller, 0.0, round_cost(draft=0.3, verify_slope=0.05), 1200, random.Random(0))
    probes = [i for i, n in enumerate(chosen) if n > 1 and i > 10]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == sorted(gaps[:3]) and gaps[0] < gaps[2], gaps
    assert max(gaps) <= 8 * 24 + 1 and gaps[-1] > 4 * 24, gaps


def test_a_paused_drafter_is_re_probed_with_one_draft():
    """A drafter that stopped paying keeps its good record at the later positions (a failing first draft never
    reaches them), so the best block on paper stays long; a re-probe drafts one token all the same: whether
    the first draft is accepted again is what it asks, and a longer verify would only cost more."""
    cost = round_cost(draft=0.2, verify_slope=0.01)
    controller = BlockSizeController(B, cost=cost)
    rng = random.Random(3)
    run_rounds(controller, 0.9, cost, 100, rng)
    failing = run_rounds(controller, 0.0, cost, 600, rng)
    paused_from = failing.index(1)
    probes = [n for n in failing[paused_from:] if n > 1]
    assert len(probes) >= 3 and set(probes) == {2}, probes
    rates = controller.rates()
    assert max((n for n in rates if n > 1), key=rates.__getitem__) > 2  # the block a probe drafted before


def test_short_requests_keep_the_re_probe_schedule_of_the_ones_before():
    """Replies of 40 tokens from a drafter that never pays, each request a new controller over the drafter's
    shared costs: the probes back off across requests as they do within one long reply, instead of each
    reply paying its own probe after 24 plain rounds."""
    from dflash_cli.engine.adaptive import RoundCosts

    cost = round_cost(draft=0.3, verify_slope=0.05)
    shared = RoundCosts()
    chosen = [n for seed in range(30)
              for n in run_rounds(BlockSizeController(8, shared=shared), 0.0, cost, 40, random.Random(seed))]
    one_reply = run_rounds(BlockSizeController(8), 0.0, cost, len(chosen), random.Random(0))
    probes, alone = sum(n > 1 for n in chosen[10:]), sum(n > 1 for n in one_reply[10:])
    assert probes <= alone + 1 and probes < 15, (probes, alone)


def test_a_first_plain_round_that_carried_a_one_time_cost_is_measured_again():
    """A plain round costs 1.0 s, but the first one measured took 1.6 s (a one-time cost: a first call, a page
    fault). Drafting at q = 0.5 commits 1.9 tokens per 2.1 s block of 4 (0.9 tokens/s): between the two.
    The controller measures plain decoding again while drafting, keeps the lower time, and pauses."""
    cost = round_cost(draft=0.5, verify_slope=0.2)
    controller, rng, chosen, plain_rounds = BlockSizeController(8), random.Random(4), [], 0
    for _ in range(300):
        n = controller.choose()
        accepted = 0
        while accepted < n - 1 and rng.random() < 0.5:
            accepted += 1
        plain_rounds += n == 1
        controller.observe(n, accepted, 1.6 if n == 1 and plain_rounds == 1 else cost(n), 0.5 if n > 1 else None)
        chosen.append(n)
    assert controller.cost(1) == pytest.approx(1.0)
    assert sum(n == 1 for n in chosen[-100:]) > 90, chosen[-100:]


@pytest.mark.parametrize("full_block_cost, warm_up_blocks", [(14.0, 1), (2.5, 3)])
def test_the_warm_up_stops_after_one_full_block_where_a_block_costs_many_decodes(full_block_cost, warm_up_blocks):
    """A fresh controller (a one-shot `generate`) measures acceptance with full blocks first: three where a block
    costs a few decodes, one where it costs many (a big drafter on a CPU: each more would cost 10+ decodes),
    and a plain round right after the first, so it knows what a block is compared with."""
    def cost(n: int) -> float:
        return 1.0 if n == 1 else 1.0 + (full_block_cost - 1.0) * (n - 1) / 15

    controller, chosen = BlockSizeController(16), []
    for _ in range(6):
        n = controller.choose()
        controller.observe(n, 1 if n > 1 else 0, cost(n), 0.3 * full_block_cost if n > 1 else None)
        chosen.append(n)
    assert chosen[:2] == [16, 1]
    assert sum(n == 16 for n in chosen) == warm_up_blocks, chosen


def test_an_unmeasured_block_is_estimated_with_the_draft_it_needs():
    """A drafted round costs the whole block's draft plus a verify that grows with its rows: after one full
    block and one plain round, a block of 2 is estimated at draft + a verify between the two, not on a
    line from the plain round (which would underestimate it by most of a draft and try it for nothing)."""
    controller = BlockSizeController(8)
    controller.observe(8, 0, 0.040, draft_seconds=0.007)
    controller.observe(1, 0, 0.009)
    assert controller.cost(2) == pytest.approx(0.007 + 0.009 + (0.033 - 0.009) / 7)
    assert controller.cost(8) == pytest.approx(0.040)


def head_heavy_costs(n: int) -> tuple[float, float]:
    """(round, draft) seconds of a round of n slots, shaped as a Qwen3-1.7B pair on 2 Zen 4 cores at 1k tokens
    (benchmarks/README.md): a 68 ms decode, a verify that grows ~5 ms a row, a draft whose 311 MB LM head (read
    per draft, on the rows kept) makes it 24 ms at 2 slots and 58 at 16."""
    if n == 1:
        return 0.068, 0.0
    draft = 0.0216 + 0.0024 * (n - 1)
    return 0.064 + 0.0048 * n + draft, draft


def head_heavy_rounds(q: float, seed: int, rounds: int = 60) -> tuple[BlockSizeController, list[int]]:
    controller, rng, chosen = BlockSizeController(16), random.Random(seed), []
    for _ in range(rounds):
        n = controller.choose()
        accepted = 0
        while accepted < n - 1 and rng.random() < q:
            accepted += 1
        seconds, draft = head_heavy_costs(n)
        controller.observe(n, accepted, seconds, draft if n > 1 else None)
        chosen.append(n)
    return controller, chosen


def test_a_draft_timed_at_one_size_is_timed_at_two_before_drafting_pauses():
    """At q = 0.5 blocks of 3-4 pay (1.13x plain) while a full block's draft alone costs most of a decode: taken
    as the draft of every size, the controller paused after the warm-up and drafted again only on a re-probe
    (the 1k cells of #48). Now a block of 2 is timed first, which draws the draft's line: most runs that were
    about to pause draft on, and a useless drafter pauses right after that one block."""
    _, useless = head_heavy_rounds(0.0, 0)
    assert useless[:6] == [16, 1, 16, 16, 2, 1] and sum(n > 1 for n in useless[6:]) <= 3, useless
    timed, drafted_on = 0, 0
    for seed in range(8):
        controller, chosen = head_heavy_rounds(0.5, seed)
        assert controller.draft_cost(4) == pytest.approx(head_heavy_costs(4)[1])
        if chosen[4] == 2:  # the warm-up's estimates said pause
            timed += 1
            drafted_on += chosen[5] > 1
    assert timed >= 3 and drafted_on >= timed / 2, (timed, drafted_on)


def test_drafts_timed_per_size_are_kept_for_the_next_process():
    import json

    from dflash_cli.engine.adaptive import RoundCosts

    shared = RoundCosts()
    controller = BlockSizeController(16, shared=shared)
    for n in (16, 1, 2):
        seconds, draft = head_heavy_costs(n)
        controller.observe(n, 0, seconds, draft if n > 1 else None)
    again = RoundCosts.from_dict(json.loads(json.dumps(shared.to_dict())))
    restored = BlockSizeController(16, shared=again)
    assert restored.draft_cost(4) == pytest.approx(head_heavy_costs(4)[1])
    assert restored.cost(4) == pytest.approx(head_heavy_costs(4)[0])


def test_the_draft_is_not_drawn_on_past_the_sizes_timed():
    """Two close sizes' drafts differ by noise as much as by size: a line drawn on past them made a block of 2
    look free on the demo (its drafts cost about the same at any size) and chose short blocks that lost."""
    controller = BlockSizeController(8)
    controller.observe(8, 3, 0.012, draft_seconds=0.0009)
    controller.observe(6, 3, 0.010, draft_seconds=0.0006)
    controller.observe(1, 0, 0.004)
    assert controller.draft_cost(2) == pytest.approx(0.0006)
    assert controller.draft_cost(7) == pytest.approx(0.00075)
    assert controller.cost(2) == pytest.approx(0.0006 + 0.004 + (0.0094 - 0.004) / 5)


def test_the_oracle_says_how_sure_it_is_so_unlikely_drafts_are_cut_as_a_trained_drafters_are(pair):
    """The oracle reports its acceptance as its confidence in each draft (a calibrated drafter that cannot tell
    which of its drafts hold), so where verify rows cost, a round verifies the drafts worth their rows only, as
    for any drafter the CLI loads; the output stays that of plain decoding."""
    prompt = [5, 9, 14, 20, 33]
    plain = generate(pair.target, None, prompt, max_new_tokens=60, stop_ids=[])
    oracle = OracleDrafter(pair.drafter, prompt + plain.tokens + [0] * 32, acceptance=0.6)
    rounds = []

    class Recording(BlockSizeController):
        def observe(self, n, accepted, seconds, draft_seconds=None, confidence=(), drafted=None):
            rounds.append((n, n if drafted is None else drafted, list(confidence)))
            super().observe(n, accepted, seconds, draft_seconds, confidence, drafted)

    controller = Recording(pair.drafter.block_size, cost=round_cost(draft=0.05, verify_slope=0.15))
    got = generate(pair.target, oracle, prompt, max_new_tokens=60, stop_ids=[], controller=controller)
    assert got.tokens == plain.tokens
    cut = [(n, drafted) for n, drafted, _ in rounds if drafted > n]
    assert cut, rounds
    assert all(c == pytest.approx(0.6) for _, _, confidence in rounds for c in confidence)


@pytest.mark.parametrize("probe, gap", [(1.3, 48), (2.5, 75)])
def test_a_paused_drafter_is_re_probed_no_oftener_than_its_probes_can_be_afforded(probe, gap):
    """Once a re-probe (a draft and a verify of 2) is timed: one costing 1.3 plain rounds comes 48 plain rounds
    after the first (24, then doubling); one costing 2.5 (a big drafter on a CPU) waits at least 75, so that
    probes cost at most 2% of the time."""
    def cost(n: int) -> float:
        return 1.0 if n == 1 else probe + 0.25 * (n - 2)

    chosen = run_rounds(BlockSizeController(8), 0.0, cost, 600, random.Random(0))
    drafted = [i for i, n in enumerate(chosen) if n > 1]
    first_probe = next(i for i, (a, b) in enumerate(zip(drafted, drafted[1:])) if b - a - 1 >= 24)
    gaps = [b - a - 1 for a, b in zip(drafted[first_probe + 1:], drafted[first_probe + 2:])]
    assert gaps and min(gaps) == gap, gaps


def test_a_slow_round_moves_a_cost_little_and_a_lasting_change_is_followed():
    """A busy VM slows a round 2-3x now and then: once a cost is measured, one such round moves it by at most a
    twentieth, where a moving average alone moved it by 40% (and a paused drafter's plain rounds then looked
    dear enough to draft again); a cost that stays doubled is followed within twenty rounds."""
    controller = BlockSizeController(8)
    for _ in range(5):
        controller.observe(1, 0, 0.004)
    controller.observe(1, 0, 0.012)
    assert controller.cost(1) == pytest.approx(0.004 * (0.8 + 0.2 * 1.25))
    for _ in range(20):
        controller.observe(1, 0, 0.008)
    assert controller.cost(1) > 0.0075


def test_a_drafter_that_does_not_pay_stays_paused_though_some_rounds_run_slow():
    """Drafts accepted 30% of the time do not pay for a block of 2 here (1.3 tokens for 1.38 plain rounds); with
    one round in 25 slowed 2.5x, the plain rounds' cost must not follow the slow ones up so far that drafting
    looks worth it: the median seed drafts in fewer than 8% of its rounds after the first 100 (re-probes)."""
    cost = round_cost(draft=0.3, verify_slope=0.08)
    drafted = []
    for seed in range(5):
        rng, controller, chosen = random.Random(seed), BlockSizeController(B), []
        for _ in range(600):
            n = controller.choose()
            accepted = 0
            while accepted < n - 1 and rng.random() < 0.3:
                accepted += 1
            controller.observe(n, accepted, cost(n) * (2.5 if rng.random() < 0.04 else 1.0))
            chosen.append(n)
        drafted.append(sum(n > 1 for n in chosen[100:]))
    assert sorted(drafted)[2] < 40, drafted


def test_a_paused_drafters_rates_are_priced_every_few_rounds_and_a_dearer_plain_round_is_still_followed(
        monkeypatch):
    """While drafting stays paused only the plain round's cost moves, so the rates (every block size priced,
    20-70 us of a 4-5 ms decode) are worked out again every PAUSED_RECHECK_ROUNDS plain rounds, not every
    round. When plain decoding turns dearer for good (here 1.0 -> 1.6 s, drafting's rounds unchanged), drafting
    resumes at most that many rounds later than when the rates ran every round."""
    from dflash_cli.engine import adaptive

    def rounds_until_drafting(recheck: int) -> tuple[int, int]:
        monkeypatch.setattr(adaptive, "PAUSED_RECHECK_ROUNDS", recheck)
        controller, rng = BlockSizeController(8), random.Random(7)
        priced = []
        real_rates = controller.rates
        monkeypatch.setattr(controller, "rates", lambda *a: priced.append(len(priced)) or real_rates(*a))
        chosen: list[int] = []
        for i in range(400):
            plain = 1.0 if i < 200 else 1.6
            n = controller.choose()
            accepted = 0
            while accepted < n - 1 and rng.random() < 0.6:
                accepted += 1
            controller.observe(n, accepted, plain if n == 1 else 1.5 + 0.3 * (n - 1), 0.5 if n > 1 else None)
            chosen.append(n)
            if i == 199:
                assert chosen[100:].count(1) > 90, chosen[100:]  # paused (re-probes aside)
                priced_while_paused = len(priced)
        # the first run of two drafted rounds after the change: drafting resumed (a re-probe is one round)
        resumed = next(i for i in range(200, 399) if chosen[i] > 1 and chosen[i + 1] > 1)
        return resumed, priced_while_paused

    recheck = adaptive.PAUSED_RECHECK_ROUNDS
    every_round, priced_every = rounds_until_drafting(1)
    every_few, priced_few = rounds_until_drafting(recheck)
    assert every_round <= every_few <= min(every_round, 200) + 2 * recheck, (every_round, every_few)
    assert priced_few * 3 < priced_every, (priced_few, priced_every)
