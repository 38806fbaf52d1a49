"""Drafts the drafter is unsure of are not verified where a verify row costs: the cut (with injected costs), the
acceptance it must not bias, the loop that applies it (lossless), and the kernel that gives the confidences."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE

from dflash_cli.engine.adaptive import BlockSizeController
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
    controller = BlockSizeController(B)  # costs measured as rounds run
    assert controller.choose() == B and controller.drafts_worth_verifying([0.1] * 7) == 7  # no costs yet
    controller.observe(B, 0, 0.0055, 0.0005)  # a full block: its verify 5 ms (a decode 2 ms, 0.43 ms a row)
    assert controller.choose() == 1  # then a plain round, to measure it
    controller.observe(1, 0, 0.002)
    controller.choose()
    assert controller.drafts_worth_verifying([0.1] * 7) == 1  # a draft at 0.01 does not pay 0.43 ms


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
        controller.observe(verified + 1, accepted, 1.0, unverified=confidence[verified:] if cut else ())
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
    native.library()
    torch.manual_seed(0)
    for scale, width in ((0.5, 21902), (3.0, 1003), (40.0, 64), (1.0, 5)):  # flat to peaked; tails past 8 lanes
        logits = torch.randn(7, width) * scale
        ids, top = greedy_ids_with_confidence(logits)
        assert torch.equal(ids, logits.argmax(dim=-1))
        expected = (logits.amax(dim=-1) - torch.logsumexp(logits, dim=-1)).exp()
        assert torch.allclose(top, expected, rtol=2e-3, atol=0)
    logits[2, 1] = float("nan")  # torch's choice then: the C kernel gives way
    ids, _ = greedy_ids_with_confidence(logits)
    assert torch.equal(ids, logits.argmax(dim=-1))
