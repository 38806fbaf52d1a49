"""Drafts the drafter is unsure of are not verified where a verify row costs: the cut (with injected costs), the
acceptance it must not bias, the loop that applies it (lossless), and the kernel that gives the confidences."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE

from dflash_cli.engine.adaptive import CPU_FIRST_ROW_PRICE, BlockSizeController, first_row_price
from dflash_cli.engine.cpu import native
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.sampling import greedy_ids_with_confidence

B = 8


def round_cost(verify_slope: float):
    """Seconds of a round of n slots: a 1 s decode, a verify that grows by `verify_slope` a row, a 0.3 s draft."""
    return lambda n: 1.0 if n == 1 else 1.0 + verify_slope * (n - 1) + 0.3


def chosen(controller: BlockSizeController, confidence: list[float]) -> int:
    controller.choose()
    return controller.drafts_worth_verifying(confidence)


def trained(verify_slope: float, q: float = 0.8, rounds: int = 40) -> BlockSizeController:
    """A controller that has seen `rounds` full blocks of a drafter accepted at q per position."""
    controller = BlockSizeController(B, cost=round_cost(verify_slope), warmup=0)
    rng = random.Random(0)
    for _ in range(rounds):
        n = controller.choose()
        accepted = 0
        while accepted < n - 1 and rng.random() < q:
            accepted += 1
        controller.observe(n, accepted, 1.0)
    return controller


def test_unsure_drafts_are_cut_where_verify_rows_cost_and_kept_where_they_do_not():
    steep, flat = trained(0.25), trained(0.005)
    unsure_tail = [0.9, 0.9, 0.3, 0.3, 0.3, 0.3, 0.3]
    cut = chosen(steep, unsure_tail)
    assert 1 <= cut < 4  # the chance that drafts 1..4 are all accepted (0.07) does not pay a quarter decode
    assert chosen(flat, unsure_tail) > cut  # on a GPU-like curve a row costs next to nothing
    assert chosen(steep, [0.99] * 7) == 7  # sure drafts are all verified
    assert chosen(steep, [0.01] * 7) == 1  # the first always is: its acceptance stays measured


def test_a_drafter_is_asked_how_sure_it_is_only_where_a_verify_row_costs():
    assert trained(0.25).wants_confidence()
    assert not trained(0.005).wants_confidence()  # a GPU-like curve: nothing to cut, no confidence to wait for


def test_every_draft_is_verified_until_what_a_verify_row_costs_is_measured():
    controller = BlockSizeController(B)  # costs measured as rounds run; three warm-up blocks
    assert controller.choose() == B and not controller.wants_confidence()
    assert controller.drafts_worth_verifying([0.1] * 7) == 7  # no costs yet
    controller.observe(B, 0, 0.0055, 0.0005)  # a full block: its verify 5 ms (a decode 2 ms, 0.43 ms a row)
    assert controller.choose() == 1  # then a plain round, to measure it
    assert not controller.wants_confidence()  # one verify size measured: no cost per row yet
    controller.observe(1, 0, 0.002)
    assert controller.choose() == B  # the warm-up goes on, its blocks cut now
    assert controller.wants_confidence()
    assert controller.drafts_worth_verifying([0.1] * 7) == 1  # a draft at 0.01 does not pay 0.43 ms


def test_on_a_cpu_the_first_blocks_are_cut_at_a_rows_usual_price_until_it_is_measured():
    controller = BlockSizeController(B, first_row_price=CPU_FIRST_ROW_PRICE)
    assert controller.choose() == B and controller.wants_confidence()
    # 0.5, 0.25, 0.125 of drafts 1..3 all holding pay a tenth of a decode; 0.0625 does not
    assert controller.drafts_worth_verifying([0.5] * 7) == 3
    assert controller.drafts_worth_verifying([0.99] * 7) == 7


def test_a_first_block_is_cut_before_its_rows_are_priced_only_for_long_blocks_on_a_cpu():
    """Cutting a first block of 8 saves little (the demo's rows cost a tenth of a decode) and hides how its last
    drafts fare from the warm-up; a block of 16 of a big pair on a CPU costs several decodes more verified whole.
    A GPU's rows cost next to nothing."""
    assert first_row_price("cpu", 16) == CPU_FIRST_ROW_PRICE
    assert first_row_price("cpu", 8) is None and first_row_price("cuda", 16) is None


def test_the_loop_gives_a_fresh_controller_its_devices_first_price_and_keeps_a_short_first_block_whole(
        pair, monkeypatch):
    from dflash_cli.engine.state import DecodeState

    device = pair.target.device.type
    state = DecodeState(pair.target, pair.drafter, own_caches=True)
    assert state.block_controller(16).first_row_price == first_row_price(device, 16)
    rounds = []
    observe = BlockSizeController.observe

    def recording(self, n, accepted, seconds, draft_seconds=None, confidence=(), drafted=None):
        rounds.append((n, drafted))
        observe(self, n, accepted, seconds, draft_seconds, confidence, drafted)

    monkeypatch.setattr(BlockSizeController, "observe", recording)
    prompt = [5, 9, 14, 20, 33]
    plain = generate(pair.target, None, prompt, max_new_tokens=30, stop_ids=[])
    oracle = OracleDrafter(pair.drafter, prompt + plain.tokens + [0] * 32, acceptance=0.5)  # new: no costs kept
    got = generate(pair.target, oracle, prompt, max_new_tokens=30, stop_ids=[], adaptive=True)
    assert got.tokens == plain.tokens
    block = pair.drafter.block_size
    assert block < 16 and rounds[0] == (block, block), rounds  # the whole block verified, on any device


def calibrated_rounds(cut: bool, rounds: int = 3000) -> BlockSizeController:
    """A drafter whose confidence is the chance the target accepts its draft, each position's drawn from
    0.05..0.95: cutting the unsure drafts verifies only the likely ones, which must not make the later
    positions look more often accepted than they are."""
    rng = random.Random(7)
    controller = BlockSizeController(B, cost=round_cost(0.25), warmup=0, decay=1.0)
    for _ in range(rounds):
        controller.choose()  # the rate a cut is priced at; every round drafts a full block
        confidence = [rng.uniform(0.05, 0.95) for _ in range(B - 1)]
        verified = controller.drafts_worth_verifying(confidence) if cut else B - 1
        accepted = 0
        while accepted < verified and rng.random() < confidence[accepted]:
            accepted += 1
        controller.observe(verified + 1, accepted, 1.0, confidence=confidence if cut else (), drafted=B)
    return controller


def test_cut_drafts_count_at_what_the_drafter_expected_of_them():
    truth = calibrated_rounds(cut=False)
    with_cut = calibrated_rounds(cut=True)
    for k in (2, 3):  # the mean acceptance at a position given the earlier ones: about 0.5 either way
        assert abs(truth.acceptance(k) - 0.5) < 0.05
        assert abs(with_cut.acceptance(k) - truth.acceptance(k)) < 0.05


def test_without_the_expected_counts_the_cut_would_flatter_the_drafter():
    """The check above is sharp: the same rounds recorded without the cut drafts' expected acceptance read the
    later positions well above their true 0.5."""
    rng = random.Random(7)
    controller = BlockSizeController(B, cost=round_cost(0.25), warmup=0, decay=1.0)
    for _ in range(3000):
        controller.choose()
        confidence = [rng.uniform(0.05, 0.95) for _ in range(B - 1)]
        verified = controller.drafts_worth_verifying(confidence)
        accepted = 0
        while accepted < verified and rng.random() < confidence[accepted]:
            accepted += 1
        controller.observe(verified + 1, accepted, 1.0)
    assert controller.acceptance(2) > 0.6


def test_a_row_is_priced_by_the_verifys_slope_not_by_two_noisy_neighbours():
    """Rounds of 2 and 4 measured a little off the line (2 rows cheap, 4 dear): the difference of two neighbours
    made the third row look four times what a row costs and cut drafts that pay. A row costs the least-squares
    slope over the sizes measured."""
    controller = BlockSizeController(B, warmup=0)
    for n, verify in ((1, 0.0020), (2, 0.0022), (4, 0.0031), (B, 0.0041)):  # ~0.3 ms a row; 2 -> 4: 0.45 ms
        controller.observe(n, n - 1, verify + (0.0004 if n > 1 else 0.0), 0.0004 if n > 1 else None)
    controller.choose()
    rate = max(controller.rates().values())
    slope = 0.0003  # seconds a row, about: the fit through the four sizes
    low, high = rate * slope * 0.8, rate * 0.00045 * 0.95  # below the neighbours' price, above the slope's
    assert low < high
    chance = (low + high) / 2
    assert controller.drafts_worth_verifying([1.0, chance, 0.01]) == 2  # the second draft pays for its row


def test_what_a_drafted_round_pays_beyond_a_plain_one_is_not_charged_to_its_rows():
    """A drafted round pays a fixed part a plain one does not (0.8 ms here); its rows cost 0.2 ms each. A fit
    through the plain round would make a row look dearer and cut drafts that pay for 0.2 ms."""
    controller = BlockSizeController(B, warmup=0)
    for n, verify in ((1, 0.0020), (2, 0.0030), (4, 0.0034), (B, 0.0042)):
        controller.observe(n, n - 1, verify + (0.0004 if n > 1 else 0.0), 0.0004 if n > 1 else None)
    controller.choose()
    rate = max(controller.rates().values())
    chance = rate * 0.0002 * 1.2  # pays for its 0.2 ms row; not for the 0.28 ms a fit through plain gives
    assert controller.drafts_worth_verifying([1.0, chance, 0.01]) == 2


def test_a_drafter_surer_than_its_drafts_hold_is_believed_less():
    """Behind a long prompt the demo drafter is surer than it should be: its verified drafts' record scales
    what it says, before a cut and in what the cut drafts count for."""
    controller = trained(0.25)
    rng = random.Random(3)
    for _ in range(400):
        controller.choose()
        confidence = [0.9] * (B - 1)  # it says 0.9; each draft holds half the time
        verified = controller.drafts_worth_verifying(confidence)
        accepted = 0
        while accepted < verified and rng.random() < 0.45:
            accepted += 1
        controller.observe(verified + 1, accepted, 1.0, confidence=confidence, drafted=B)
    assert abs(controller.calibrated([0.9])[0] - 0.45) < 0.08
    assert abs(controller.acceptance(3) - 0.45) < 0.1  # the cut drafts counted at 0.45, not 0.9
    assert chosen(controller, [0.9] * 7) < 7


def test_a_cut_round_prices_its_draft_at_the_size_verified():
    """The draft of a cut round ran its head on every drafted row: it is timed as a draft of the block drafted,
    and the round is counted as what a round of the size verified costs (its draft priced at that size)."""
    controller = BlockSizeController(B, warmup=0)
    controller.observe(2, 1, 0.010, 0.002)  # a round of 2: draft 2 ms
    controller.observe(B, 3, 0.020, 0.004)  # a round of 8: draft 4 ms
    controller.observe(3, 2, 0.016, 0.004, confidence=[0.9, 0.9, 0.2, 0.1, 0.1, 0.1, 0.1], drafted=B)
    table = controller.shared.seconds[0]
    assert table[-B] == pytest.approx(0.004) and -3 not in table  # the draft: the block drafted
    # the round: 16 ms less the 4 ms draft plus a draft of 3 slots on the line between 2 and 8 (2.33 ms)
    assert table[3] == pytest.approx(0.016 - 0.004 + 0.002 + 0.002 / 6)


def test_a_drafter_is_not_asked_where_it_cannot_tell_or_nothing_would_be_cut(pair):
    """A drafter is asked how sure it is only where it says it can (reports_confidence) and a verify row costs;
    a drafter written before the keyword would fail if it were asked."""

    class Unasked(OracleDrafter):
        reports_confidence = False

        def draft(self, *args, keep=None, sampler=None, **kwargs):
            assert not kwargs, "asked for its confidence"
            return super().draft(*args, keep=keep, sampler=sampler)

    class AskedWhereItCounts(Unasked):
        reports_confidence = True

    prompt = [5, 9, 14, 20, 33]
    plain = generate(pair.target, None, prompt, max_new_tokens=40, stop_ids=[])
    reference = prompt + plain.tokens + [0] * 32
    for drafter, slope in ((Unasked(pair.drafter, reference, 0.7), 0.25),
                           (AskedWhereItCounts(pair.drafter, reference, 0.7), 0.005)):
        controller = BlockSizeController(pair.drafter.block_size, cost=round_cost(slope), warmup=0)
        got = generate(pair.target, drafter, prompt, max_new_tokens=40, stop_ids=[], controller=controller)
        assert got.tokens == plain.tokens and got.stats.drafted > 0


def test_the_drafter_reports_one_confidence_per_draft_and_drafts_the_same(pair):
    """DFlashDrafter.draft with and without `confidence`, over the whole vocabulary and a draft vocabulary."""
    import copy

    drafter, target = pair.drafter, pair.target
    vocab = drafter.draft_vocab
    try:
        for draft_vocab in (None, torch.arange(3, target.embed_table.shape[0], 2)):
            drafter.draft_vocab = draft_vocab
            context = torch.randn(1, 4, drafter.config.hidden_size * len(drafter.config.target_layer_ids or [1]))
            runs = []
            for confidence in (None, []):
                cache = drafter.new_cache()
                drafts = drafter.draft(copy.deepcopy(context), torch.tensor([7]), 4, drafter.block_size, cache,
                                       target.embed_table, target.logits_head, keep=5, confidence=confidence)
                runs.append((drafts.tolist(), confidence))
            assert runs[0][0] == runs[1][0] and len(runs[1][1]) == 5
            assert all(0.0 < p <= 1.0 for p in runs[1][1])
    finally:
        drafter.draft_vocab = vocab


class SureOfTheRightDrafts(OracleDrafter):
    """The reference's continuation with wrong tokens at a rate, reporting 0.95 for right drafts and 0.05 for
    wrong ones: a drafter that knows when it guesses."""

    reports_confidence = True

    def __init__(self, drafter, reference: list[int], acceptance: float):
        super().__init__(drafter, reference, acceptance=acceptance, seed=3)
        self.truth = torch.tensor(reference)

    def draft(self, context, anchor, start, block_len, cache, embed_weight, lm_head, *, keep=None, sampler=None,
              confidence=None):
        drafts = super().draft(context, anchor, start, block_len, cache, embed_weight, lm_head, keep=keep,
                               sampler=sampler)
        if confidence is not None:
            right = drafts.cpu() == self.truth[start + 1 : start + 1 + drafts.shape[0]]
            confidence.extend(0.95 if r else 0.05 for r in right.tolist())
        return drafts


@pytest.fixture(scope="module")
def pair(tiny_models):
    return load_pair(tiny_models["qwen3"], tiny_models["qwen3-drafter"], device=DEVICE, dtype="float32")


def test_the_loop_verifies_the_sure_drafts_and_stays_lossless(pair):
    prompt = [5, 9, 14, 20, 33]
    plain = generate(pair.target, None, prompt, max_new_tokens=120, stop_ids=[])
    reference = prompt + plain.tokens + [0] * 32
    runs = {}
    for sure in (False, True):
        drafter = SureOfTheRightDrafts(pair.drafter, reference, acceptance=0.7)
        controller = BlockSizeController(pair.drafter.block_size, cost=round_cost(0.25), warmup=0)
        if not sure:
            controller.drafts_worth_verifying = lambda confidence: len(confidence)  # type: ignore[method-assign]
        runs[sure] = generate(pair.target, drafter, prompt, max_new_tokens=120, stop_ids=[], controller=controller)
        assert runs[sure].tokens == plain.tokens
    every, sure_only = runs[False].stats, runs[True].stats
    # only the first draft of a round is verified whatever its confidence: every later draft verified was one
    # the drafter was sure of, and accepted; verifying them all, many were not
    assert sure_only.drafted < every.drafted and sum(sure_only.position_drafted[1:]) > 0
    assert sure_only.position_accepted[1:] == sure_only.position_drafted[1:]
    assert every.position_accepted[1] < every.position_drafted[1]


@pytest.mark.skipif(native.unavailable() is not None, reason="the C kernels cannot be built here")
def test_the_kernel_gives_torch_argmax_and_the_top_probability():
    built = native.library()
    assert built is not None
    torch.manual_seed(0)
    for scale, width in ((0.5, 21902), (3.0, 1003), (40.0, 64), (1.0, 5)):  # flat to peaked; tails past 8 lanes
        wide = torch.randn(7, width + 9) * scale
        logits = wide[:, :width]  # rows apart by more than their width
        got = native.argmax_confidence_rows(built.lib, logits)
        assert got is not None
        ids, top = got
        assert torch.equal(ids, logits.argmax(dim=-1))
        expected = (logits.amax(dim=-1) - torch.logsumexp(logits, dim=-1)).exp()
        assert torch.allclose(top, expected, rtol=1e-2, atol=0)
    logits = logits.contiguous()
    logits[2, 1] = float("nan")  # torch's choice then: the C kernel gives way, and the row tells nothing
    ids, top = greedy_ids_with_confidence(logits)
    assert torch.equal(ids, logits.argmax(dim=-1)) and top[2] == 0.0 and top[3] > 0.0


def after_a_rejected_first_block(sure: float, decode: float, row: float, draft: float) -> list[int]:
    """The blocks a fresh CPU controller chooses when its first block's first draft is rejected, the drafter
    `sure` of each of its drafts: the first (cut), a plain round to time, then what comes next. A round of n
    verified rows costs a decode plus `row` a row after the first, plus the draft."""
    controller = BlockSizeController(B, first_row_price=CPU_FIRST_ROW_PRICE)
    chosen = [controller.choose()]
    confidence = [sure] * (B - 1)
    n = 1 + controller.drafts_worth_verifying(confidence)
    controller.observe(n, 0, decode + row * (n - 1) + draft, draft, confidence, drafted=B)
    chosen.append(controller.choose())
    controller.observe(1, 0, decode)
    return [*chosen, controller.choose()]


def test_a_weak_drafters_warm_up_ends_after_one_block_and_an_unlucky_sure_ones_goes_on():
    """Where a full block costs about two decodes (the demo on a CPU), a drafter unsure of the drafts the target
    rejected is weak and its warm-up ends (the rates choose: a paused drafter is re-probed as usual), one sure of
    them was unlucky and drafts the rest of its warm-up; where a full block would cost more than four decodes
    (a Qwen3-1.7B-shaped pair, estimated from the cut block) the warm-up ends either way."""
    demo = dict(decode=4.4e-3, row=0.5e-3, draft=1.3e-3)
    weak = after_a_rejected_first_block(0.02, **demo)
    assert weak[:2] == [B, 1] and weak[2] < B, weak
    assert after_a_rejected_first_block(0.9, **demo) == [B, 1, B]
    big = dict(decode=34.6e-3, row=8e-3, draft=54.7e-3)
    assert after_a_rejected_first_block(0.9, **big)[2] < B


def test_a_later_process_of_a_big_pair_skips_its_warm_up_block_though_no_full_block_was_ever_timed():
    """Cut blocks never time a full one; the next process estimates a full block's cost from the sizes timed
    (draft of the trained block, verifies of the rows kept) and, at more than four decodes, lets the rates
    choose from its first round instead of drafting one (a paused drafter is re-probed as usual)."""
    import json

    from dflash_cli.engine.adaptive import RoundCosts

    shared = RoundCosts()
    controller = BlockSizeController(B, shared=shared, first_row_price=CPU_FIRST_ROW_PRICE)
    for _ in range(30):
        n = controller.choose()
        confidence = [0.02] * (B - 1) if n > 1 else []
        kept = 1 + controller.drafts_worth_verifying(confidence) if confidence else n
        draft = 54.7e-3 if n > 1 else None
        controller.observe(kept, 0, 34.6e-3 + 8e-3 * (kept - 1) + (draft or 0.0), draft, confidence, drafted=n)
    assert B not in shared.seconds[0]  # every drafted block was cut
    again = RoundCosts.from_dict(json.loads(json.dumps(shared.to_dict())))
    assert BlockSizeController(B, shared=again, first_row_price=CPU_FIRST_ROW_PRICE).choose() < B


def re_probe_gaps(sure: float | None, shared=None, rounds: int = 400) -> list[int]:
    """Plain rounds between a demo-like CPU pair's drafted rounds (a decode 4.4 ms, a verify row 0.5, a draft
    1.3), its drafter `sure` of each draft (None: it does not say) and every draft rejected: the warm-up, then
    the re-probes."""
    from dflash_cli.engine.adaptive import RoundCosts

    controller = BlockSizeController(B, shared=shared if shared is not None else RoundCosts())
    drafted = []
    for i in range(rounds):
        n = controller.choose()
        confidence = [sure] * (n - 1) if n > 2 and sure is not None else []
        draft = 1.3e-3 if n > 1 else None
        controller.observe(n, 0, 4.4e-3 + 0.5e-3 * (n - 1) + (draft or 0.0), draft, confidence)
        if n > 1:
            drafted.append(i)
    return [b - a - 1 for a, b in zip(drafted, drafted[1:])]


def test_a_drafter_unsure_of_its_warm_up_drafts_is_re_probed_more_rarely_than_an_unlucky_sure_one():
    """Both see every draft rejected; the one whose own confidence said no block pays, and that was never worth
    drafting, waits for its re-probes until they cost at most DOUBTED_PROBE_SHARE of the time (a probe here
    costs 0.41 decodes more than a plain round: 82 plain rounds at 0.5%), the sure one, or one that does not
    say, only PROBE_SHARE's (24, then doubling). A later process keeps the verdict where its own warm-up does
    not give one (a big pair's skips its warm-up), and the count of rounds worth drafting: one that drafted for
    a while had a bad stretch, and keeps the usual share."""
    import json
    import math

    from dflash_cli.engine.adaptive import DOUBTED_PROBE_SHARE, RoundCosts

    extra = 0.5e-3 + 1.3e-3  # a probe (a verify of 2 and a draft) beyond a plain round
    doubted_gap = math.ceil(extra / (DOUBTED_PROBE_SHARE * 4.4e-3))
    shared = RoundCosts()
    weak = re_probe_gaps(0.02, shared)
    assert weak[0] == 1 and min(weak[1:]) >= doubted_gap > 24, weak  # the warm-up times a plain round
    for unknown in (re_probe_gaps(0.9), re_probe_gaps(None)):
        assert 24 in unknown and min(unknown) < doubted_gap, unknown
    again = RoundCosts.from_dict(json.loads(json.dumps(shared.to_dict())))
    assert min(re_probe_gaps(None, again)) >= doubted_gap
    shared.worth = 50.0  # as if an earlier request drafted for a while: a bad stretch, not a weak drafter
    assert 24 in re_probe_gaps(0.02, RoundCosts.from_dict(json.loads(json.dumps(shared.to_dict()))))


def test_a_draft_position_not_reached_yet_is_expected_at_what_the_drafter_said_of_it():
    """The acceptance of a position the target has not ruled on starts from the drafter's own (calibrated)
    confidence in its warm-up drafts there, not from 1/2: a sure drafter whose first draft was rejected is still
    expected to hold its later drafts about as often as it said, a drafter that says nothing gets 1/2."""
    sure = BlockSizeController(B, first_row_price=CPU_FIRST_ROW_PRICE)
    sure.choose()
    sure.observe(B, 0, 0.012, 0.001, [0.9] * (B - 1))
    assert sure.acceptance(3) == pytest.approx(0.9)  # as calibrated then: nothing verified before it
    assert sure.acceptance(1) == pytest.approx(0.9 / 2.0)  # reached once, rejected
    silent = BlockSizeController(B)
    silent.choose()
    silent.observe(B, 0, 0.012, 0.001)
    assert silent.acceptance(3) == pytest.approx(0.5)
