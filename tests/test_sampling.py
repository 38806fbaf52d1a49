"""Sampling: speculative sampling follows the target's own distribution; seeds reproduce runs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from conftest import (
    dflash2_config,
    drafter_config,
    repeating_dflash2_drafter,
    save_random_drafter,
    save_target,
    target_config,
)

from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair, save_drafter
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.sampling import Sampler, sampling_probs

PROMPT = [17, 42, 99, 5]
N_NEW = 4  # the prefill samples token 1; one verify step of 3 slots samples tokens 2-4
SETTINGS = dict(temperature=0.8, top_k=2, top_p=0.99)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A two-layer target: this test samples thousands of short generations."""
    root = tmp_path_factory.mktemp("sampling")
    cfg = target_config("llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    target = save_target(root / "target", cfg, seed=5, scale=6.0)
    drafter = save_random_drafter(root / "drafter", drafter_config(cfg, layers=1, taps=(0, 1)), seed=6)
    return load_pair(target, drafter, device="cpu", dtype="float32")


@pytest.fixture(params=["transformers forward", "fast path"])
def either_path(request, pair):
    """The pair on transformers' forward, then on the fast path (static cache, packed weights)."""
    if request.param == "fast path":
        assert pair.target.enable_fast_path(64, pad_to=pair.drafter.block_size) is None
    yield pair
    pair.target.disable_fast_path()


def reference_probs(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> dict[int, float]:
    """The filtered next-token distribution written out by hand (independent of the code under test):
    temperature, then the top_k likeliest, then the smallest set whose mass reaches top_p."""
    scores = [x / temperature for x in logits]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    kept = order[:top_k] if top_k else order
    top = scores[kept[0]]
    weights = {i: math.exp(scores[i] - top) for i in kept}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += probs[i]
    return {i: probs[i] / mass for i in nucleus}


def exact_distribution(target, settings, prompt=PROMPT) -> dict[tuple[int, ...], float]:
    """P(x1..x4) under the target alone, by enumerating every sequence the filters allow."""
    dist = {(): 1.0}
    for _ in range(N_NEW):
        nxt = {}
        for prefix, p in dist.items():
            logits = target.model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double().tolist()
            for token, q in reference_probs(logits, **settings).items():
                nxt[prefix + (token,)] = p * q
        dist = nxt
        assert len(dist) < 5000, "the filters let through far more sequences than top_k allows"
    return dist


def chi_square_p_value(counts: Counter, dist: dict, n: int) -> float:
    """Pearson's test, cells with expected count < 5 pooled; p = upper tail of chi-square."""
    observed, expected, pool_o, pool_e = [], [], 0.0, 0.0
    for cell, p in dist.items():
        if p * n >= 5:
            observed.append(counts[cell])
            expected.append(p * n)
        else:
            pool_o, pool_e = pool_o + counts[cell], pool_e + p * n
    observed.append(pool_o + sum(c for cell, c in counts.items() if cell not in dist))
    expected.append(max(pool_e, 1e-9))
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    dof = len(observed) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def test_speculative_sampling_matches_the_target_distribution(either_path):
    pair = either_path
    dist = exact_distribution(pair.target, SETTINGS)
    greedy = generate(pair.target, None, PROMPT, max_new_tokens=N_NEW + 4, stop_ids=[]).tokens
    oracle = OracleDrafter(pair.drafter, PROMPT + greedy, acceptance=1.0)  # argmax drafts: often accepted
    n = 1500
    counts: Counter = Counter()
    accepted = drafted = 0
    for seed in range(n):
        out = generate(pair.target, oracle, PROMPT, max_new_tokens=N_NEW, stop_ids=[], seed=seed, adaptive=False,
                       **SETTINGS)
        counts[tuple(out.tokens)] += 1
        accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
    assert accepted > 200 and drafted - accepted > 200  # both the accept and the reject paths ran
    assert chi_square_p_value(counts, dist, n) > 1e-3
    # the same test has the power to see a wrong distribution
    wrong = exact_distribution(pair.target, dict(SETTINGS, temperature=0.4))
    assert chi_square_p_value(counts, wrong, n) < 1e-6


def test_seeded_runs_reproduce_whatever_the_block_sizes(pair):
    from dflash_cli.engine.adaptive import BlockSizeController

    kwargs = dict(max_new_tokens=30, stop_ids=[], temperature=1.0, top_p=0.9, seed=7)
    full = generate(pair.target, pair.drafter, PROMPT, adaptive=False, **kwargs).tokens
    plain = generate(pair.target, None, PROMPT, **kwargs).tokens
    # two controllers whose injected costs force different block-size sequences
    short = BlockSizeController(pair.drafter.block_size, cost=lambda n: 1.0 + 0.5 * n)
    long = BlockSizeController(pair.drafter.block_size, cost=lambda n: 1.0 + 0.01 * n)
    a = generate(pair.target, pair.drafter, PROMPT, controller=short, **kwargs)
    b = generate(pair.target, pair.drafter, PROMPT, controller=long, **kwargs)
    assert a.stats.block_rounds != b.stats.block_rounds
    assert full == plain == a.tokens == b.tokens
    other = generate(pair.target, pair.drafter, PROMPT, **dict(kwargs, seed=8)).tokens
    assert other != full


def test_sampling_probs_match_the_hand_written_reference():
    torch.manual_seed(4)
    logits = torch.randn(3, 40) * 3
    for settings in (dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=0.8, top_p=0.6),
                     dict(temperature=0.8, top_k=2, top_p=0.99)):
        got = sampling_probs(logits, **settings)
        for row, probs in zip(logits, got):
            ref = reference_probs(row.double().tolist(), **settings)
            expected = torch.zeros(40, dtype=torch.float64)
            for i, q in ref.items():
                expected[i] = q
            torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-6)


def test_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    top2 = sampling_probs(logits, 1.0, top_k=2)[0]
    assert (top2[2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    nucleus = sampling_probs(logits, 1.0, top_p=0.5)[0]
    assert nucleus[0] == 1.0  # the top token alone already holds more than half the mass
    assert Sampler(0.0)(logits).item() == 0 and Sampler(1.0, top_k=1, seed=0)(logits).item() == 0
    # the draw for a position depends on (seed, position) only, not on the rows sampled with it
    rows = torch.randn(6, 50)
    sampler = Sampler(1.0, seed=3)
    assert sampler(rows, 10).tolist() == [sampler(rows[i:i + 1], 10 + i).item() for i in range(6)]
    assert Sampler(1.0).seed != Sampler(1.0).seed  # unseeded runs draw a fresh seed


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(InvalidSettingError):
        Sampler(**{"temperature": 1.0, **bad})


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory):
    """A two-layer 8-token target and a DFlash 2 drafter whose selector favours repeating the previous token
    (so its sampled drafts are often accepted and often rejected)."""
    root = tmp_path_factory.mktemp("sampling-dflash2")
    vocab = 8
    cfg = target_config("llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=vocab)
    target = save_target(root / "target", cfg, seed=5, scale=4.0)
    dcfg = dflash2_config(cfg, layers=1, taps=(0, 1), top_k=vocab)
    dcfg["dflash_config"].update(mask_token_id=vocab - 1, selector_rank=vocab)
    model = repeating_dflash2_drafter(dcfg, vocab, seed=6, weight=3)
    return load_pair(target, save_drafter(model, root / "drafter"), device="cpu", dtype="float32")


DFLASH2_PROMPT = [1, 3, 5, 2]


def test_sampled_dflash2_drafts_keep_the_target_distribution(dflash2_pair):
    """Sampled DFlash 2 drafts (the selector's q, coupled to the target's noise) through the real loop."""
    pair = dflash2_pair
    settings = dict(temperature=1.0, top_k=2, top_p=1.0)
    dist = exact_distribution(pair.target, settings, DFLASH2_PROMPT)
    n = 1500
    counts: Counter = Counter()
    accepted = drafted = 0
    for seed in range(n):
        out = generate(pair.target, pair.drafter, DFLASH2_PROMPT, max_new_tokens=N_NEW, stop_ids=[], seed=seed,
                       adaptive=False, **settings)
        counts[tuple(out.tokens)] += 1
        accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
    assert accepted > 200 and drafted - accepted > 200  # both the accept and the reject paths ran
    assert chi_square_p_value(counts, dist, n) > 1e-3
    wrong = exact_distribution(pair.target, dict(settings, temperature=0.4), DFLASH2_PROMPT)
    assert chi_square_p_value(counts, wrong, n) < 1e-6


class TargetAsDrafter:
    """A drafter whose draft distribution is exactly the target's: it runs the real drafter (caches stay
    consistent), then proposes what the target itself picks with the sampler it is given, one position at
    a time after the committed tokens. With the sampler's own noise every draft must be accepted."""

    def __init__(self, drafter, target):
        self.drafter, self.target, self.config = drafter, target, drafter.config
        self.state = None

    block_size = property(lambda self: self.drafter.block_size)
    mask_token_id = property(lambda self: self.drafter.mask_token_id)

    def new_cache(self, capacity=256):
        return self.drafter.new_cache(capacity)

    def draft(self, context, anchor, start, block_len, cache, embed_weight, lm_head, *, keep=None, sampler=None):
        self.drafter.draft(context, anchor, start, block_len, cache, embed_weight, lm_head, keep=keep)
        ids = list(self.state.tokens)
        assert len(ids) == start + 1
        for i in range(keep):
            logits = self.target.model(torch.tensor([ids])).logits[0, -1:]
            ids.append(int(sampler(logits, start + 1 + i)[0]) if sampler is not None else int(logits.argmax()))
        return torch.tensor(ids[start + 1:])


def test_a_drafter_with_the_targets_distribution_is_always_accepted_when_sampling(pair):
    """Coupled drafts: the loop hands the drafter the target's sampler, and the noise of draft d_i is the
    noise of the target's choice at the same position, so q = p means every draft is accepted."""
    from dflash_cli.engine.state import DecodeState

    drafter = TargetAsDrafter(pair.drafter, pair.target)
    for seed in range(3):
        drafter.state = DecodeState(pair.target, drafter)
        kwargs = dict(max_new_tokens=20, stop_ids=[], temperature=1.0, top_p=0.95, seed=seed)
        out = generate(pair.target, drafter, PROMPT, adaptive=False, state=drafter.state, **kwargs)
        assert out.stats.drafted > 10 and out.stats.accepted == out.stats.drafted
        assert out.tokens == generate(pair.target, None, PROMPT, **kwargs).tokens


def test_gumbel_coupling_accepts_at_least_one_minus_tv_over_one_plus_tv():
    """The bound the docs state (Daliri, Musco, Suresh 2024): P(argmax(log q + g) = argmax(log p + g))
    >= (1 - TV) / (1 + TV) with g the sampler's noise, and at most 1 - TV (the optimal coupling)."""
    torch.manual_seed(3)
    sampler = Sampler(temperature=1.0, seed=11)
    n, V = 4000, 30
    noise = sampler.gumbel(0, n, V, torch.device("cpu"))
    for spread in (0.3, 1.0, 3.0):
        p = torch.softmax(torch.randn(V) * 2, 0)
        q = torch.softmax(p.log() + torch.randn(V) * spread, 0)
        tv = 0.5 * (p - q).abs().sum().item()
        agree = ((p.log() + noise).argmax(-1) == (q.log() + noise).argmax(-1)).double().mean().item()
        bound = (1 - tv) / (1 + tv)
        assert agree >= bound - 3 * math.sqrt(bound * (1 - bound) / n), (spread, agree, bound)
        assert agree <= 1 - tv + 3 * math.sqrt((1 - tv) * tv / n)  # no coupling beats the optimal one


def test_v1_sampled_drafts_are_the_samplers_choice_from_the_draft_logits(pair):
    """At T > 0 a v1 drafter proposes the sampler's own pick from its (post-processed) draft logits, with the
    noise of the position each draft stands for (start + 1 for slot 1); at T = 0 the argmax."""
    drafter, target = pair.drafter, pair.target
    torch.manual_seed(0)
    context, anchor, start = torch.randn(1, 6, 2 * 32), torch.tensor([9]), 6
    args = (anchor, start, drafter.block_size, None, target.embed_weight, target.lm_head)
    with torch.no_grad():
        _, logits = drafter.draft_logits(context, *args[:3], drafter.new_cache(), *args[4:], None)
    differs = False
    for seed in range(5):
        sampler = Sampler(temperature=1.0, top_p=0.9, seed=seed)
        got = drafter.draft(context, anchor, start, drafter.block_size, drafter.new_cache(), target.embed_table,
                            target.lm_head, sampler=sampler)
        probs = sampling_probs(logits, 1.0, 0.9)
        noise = torch.stack([-torch.log(-torch.log(sampler.uniform(start + 1 + i, probs.shape[-1], probs.device)))
                             for i in range(probs.shape[0])])
        assert got.tolist() == (probs.log() + noise).argmax(-1).tolist()
        differs |= got.tolist() != logits.argmax(-1).tolist()
    assert differs
    greedy = drafter.draft(context, anchor, start, drafter.block_size, drafter.new_cache(), target.embed_table,
                           target.lm_head, sampler=Sampler(temperature=0.0))
    assert greedy.tolist() == logits.argmax(-1).tolist()
