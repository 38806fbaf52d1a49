"""Hybrid targets (Gated DeltaNet + attention): exact rollback of the linear-attention state, on each family.

Tiny random models scaled down from the published configs, saved as the real checkpoints are and loaded
through the real loader: Qwen3.5-4B (dense and MoE), and Qwen3-Next / Qwen3-Coder-Next (gated attention, a
MoE with a shared expert, and its own DeltaNet input projections: tests/test_qwen3_next.py checks those).
fp32, so greedy speculation must equal transformers' own greedy generate token for token.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    VOCAB,
    TargetForwardLog,
    interrupt_on_call,
)
from support.hybrid_models import FAMILIES, load_family, save_family
from support.speculation import hf_greedy
from transformers.models.qwen3_5 import modeling_qwen3_5

from dflash_cli.engine.errors import UnsupportedModelError
from dflash_cli.engine.generate import generate, stream_generate
from dflash_cli.engine.linear_attention import BlockRecord, delta_rule_chunk, l2norm, state_after
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.state import DecodeState


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    return load_family(request.param, tmp_path_factory.mktemp(request.param))


def per_family(cases: str) -> list[tuple[str, int]]:
    """(family, case) for each case the family lists under `cases`: a test's `pair, value` parameters."""
    return [(name, value) for name, family in FAMILIES.items() for value in getattr(family, cases)]


def prompts(n, seed, longest=90):
    rng = random.Random(seed)  # up to 90 tokens: prompts span one or two 64-token chunks
    return [[rng.randrange(3, 140) for _ in range(rng.randrange(1, longest))] for _ in range(n)]


def oracle(pair, prompt, acceptance, seed=1, n=60):
    return OracleDrafter(pair.drafter, prompt + hf_greedy(pair.target, prompt, n), acceptance=acceptance,
                         seed=seed, vocab_size=VOCAB)


def varied_reply(target, n: int, span: range) -> tuple[list[int], list[int], int]:
    """A prompt, its greedy reply of `n` tokens, and the first position of `span` holding a token the reply has
    not had before (a stop token that ends the reply there): many replies of these models settle on one token."""
    for seed in range(20):
        prompt = prompts(1, seed=seed, longest=40)[0]
        reply = hf_greedy(target, prompt, n)
        at = next((i for i in span if reply[i] not in reply[:i]), None)
        if at is not None:
            return prompt, reply, at
    raise AssertionError("no prompt gave a varied reply")


def linear_states(state: DecodeState) -> list[torch.Tensor]:
    """The recurrent and convolution states after all the positions the target cache holds."""
    linear = state.target_cache.linear
    linear.settle(state.target_cache.length)
    convs, states = linear.current()
    return convs + states


def test_block_solution_matches_transformers_recurrence():
    torch.manual_seed(0)
    h, n, dk, dv = 3, 11, 8, 5
    q, k = l2norm(torch.randn(h, n, dk)), l2norm(torch.randn(h, n, dk))
    v, beta = torch.randn(h, n, dv), torch.rand(h, n)
    g, s0 = -torch.rand(h, n), torch.randn(h, dk, dv)
    out, cum_g, delta = delta_rule_chunk(q * dk**-0.5, k, v, g, beta, s0)
    record = BlockRecord(s0, k, cum_g, delta, conv_tail=torch.zeros(1, 1, 1))

    def reference(m):  # transformers' token-by-token recurrence over the first m tokens
        as_btd = lambda x: x.transpose(0, 1)[None]  # noqa: E731 - (h, n, d) -> (1, n, h, d)
        o, s = modeling_qwen3_5.torch_recurrent_gated_delta_rule(
            as_btd(q[:, :m]), as_btd(k[:, :m]), as_btd(v[:, :m]), g=g[:, :m].T[None], beta=beta[:, :m].T[None],
            initial_state=s0[None], output_final_state=True)
        return o[0].transpose(0, 1), s[0]

    ref_out, _ = reference(n)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for m in range(1, n + 1):  # the state after any prefix, from the block's by-products
        torch.testing.assert_close(state_after(record, m), reference(m)[1], rtol=1e-4, atol=1e-5)
    assert torch.equal(state_after(record, 0), s0)


@pytest.mark.parametrize("pair, block_size", per_family("block_sizes"), indirect=["pair"])
def test_greedy_speculation_equals_transformers_generate(pair, block_size):
    for prompt in prompts(3, seed=3):  # the same prompts at every block size: their references are computed once
        reference = hf_greedy(pair.target, prompt, 30)
        assert generate(pair.target, None, prompt, max_new_tokens=30, stop_ids=[]).tokens == reference
        assert generate(pair.target, pair.drafter, prompt, max_new_tokens=30, stop_ids=[],
                        block_size=block_size).tokens == reference
        for acceptance in (0.5, 0.8):  # partial acceptances: every step rolls the state back
            got = generate(pair.target, oracle(pair, prompt, acceptance, n=30), prompt, max_new_tokens=30,
                           stop_ids=[], block_size=block_size, adaptive=False)
            assert got.tokens == reference
            assert 1.3 < got.stats.acceptance_length < block_size


@pytest.mark.parametrize("pair, length", per_family("boundaries"), indirect=["pair"])
def test_prompts_on_a_chunk_boundary_match_transformers(pair, length):
    """Prompts are run in 64-token chunks: a prompt that ends exactly on (or one past) a chunk boundary,
    then speculative steps that roll the state back, give transformers' own greedy tokens. Random
    lengths (1-89) almost never land there."""
    rng = random.Random(length)
    prompt = [rng.randrange(3, 140) for _ in range(length)]
    reference = hf_greedy(pair.target, prompt, 12)
    assert generate(pair.target, None, prompt, max_new_tokens=12, stop_ids=[]).tokens == reference
    drafter = oracle(pair, prompt, 0.6, n=12)
    state = DecodeState(pair.target, drafter)
    got = []
    for step in stream_generate(pair.target, drafter, prompt, max_new_tokens=12, stop_ids=[], block_size=4,
                                state=state):
        state.check()
        got.extend(step.tokens)
    assert got == reference


def test_state_after_every_step_equals_a_fresh_plain_run(pair):
    prompt = prompts(1, seed=7)[0]
    drafter = oracle(pair, prompt, 0.6, seed=4, n=40)
    state = DecodeState(pair.target, drafter)
    accepted = []
    for step in stream_generate(pair.target, drafter, prompt, max_new_tokens=40, stop_ids=[], block_size=8,
                                state=state, adaptive=False):
        state.check()
        accepted.append(step.accepted)
        fresh = DecodeState(pair.target, None, own_caches=True)  # beside the one decoding
        fresh.prefill(state.tokens[: state.start])  # the committed context, read once, no drafts
        for got, want in zip(linear_states(state), linear_states(fresh), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert any(0 < a < 7 for a in accepted)  # some steps rejected part of their block


def test_stop_token_inside_an_accepted_block(pair):
    prompt, reference, at = varied_reply(pair.target, 40, range(10, 40))
    stop = reference[at]
    drafter = oracle(pair, prompt, 1.0, n=40)
    state = DecodeState(pair.target, drafter)
    steps = []
    for step in stream_generate(pair.target, drafter, prompt, max_new_tokens=40, stop_ids=[stop], block_size=8,
                                state=state, adaptive=False):
        state.check()
        steps.append(step)
    got = [t for step in steps for t in step.tokens]
    assert got == reference[: reference.index(stop) + 1] and steps[-1].finish_reason == "stop"
    assert len(steps[-1].tokens) < steps[-1].accepted + 1  # the block went on past the stop: it was cut there
    more = generate(pair.target, drafter, state.tokens, max_new_tokens=10, stop_ids=[], state=state, block_size=8)
    state.check()
    assert got + more.tokens == hf_greedy(pair.target, prompt, len(got) + 10)


def test_chat_turns_reuse_the_state_regenerate_and_edit(pair):
    turn1 = [5, 6, 7, 8, 9, 10]
    state = DecodeState(pair.target, pair.drafter)
    first = generate(pair.target, pair.drafter, turn1, max_new_tokens=15, stop_ids=[], state=state)
    state.check()
    turn2 = turn1 + first.tokens + [33, 44, 55]
    turn3 = turn1[:3] + [99] + turn1[4:]
    reference2, reference3 = hf_greedy(pair.target, turn2, 15), hf_greedy(pair.target, turn3, 8)
    with TargetForwardLog(pair.target) as log:
        second = generate(pair.target, pair.drafter, turn2, max_new_tokens=15, stop_ids=[], state=state)
        state.check()
        assert log.take()[0] == 4  # the new tokens and the last reply token: the state was reused
        assert second.tokens == reference2
        # regenerate: back to just before the prompt's last token (a checkpoint), not to position 0
        again = generate(pair.target, pair.drafter, turn2, max_new_tokens=15, stop_ids=[], state=state)
        state.check()
        assert log.take()[0] == 1 and again.tokens == reference2
        # an edited history: the recurrent state cannot go back to the edit, so all of it is read again
        third = generate(pair.target, pair.drafter, turn3, max_new_tokens=8, stop_ids=[], state=state)
        state.check()
        assert log.take()[0] == len(turn3) and third.tokens == reference3


def test_interrupted_verify_then_continue(pair):
    prompt = [11, 12, 13, 14]
    drafter = oracle(pair, prompt, 0.7, seed=2)
    state = DecodeState(pair.target, drafter)
    attention_layer = next(layer for layer in pair.target.layers if not hasattr(layer, "linear_attn"))
    handle = attention_layer.post_attention_layernorm.register_forward_hook(interrupt_on_call(4))  # after the DeltaNets
    got = []
    try:
        with pytest.raises(KeyboardInterrupt):
            for step in stream_generate(pair.target, drafter, prompt, max_new_tokens=40, stop_ids=[], state=state,
                                        block_size=8):
                got.extend(step.tokens)
    finally:
        handle.remove()
    state.check()
    more = generate(pair.target, drafter, state.tokens, max_new_tokens=10, stop_ids=[], state=state, block_size=8)
    assert got and got + more.tokens == hf_greedy(pair.target, prompt, len(got) + 10)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_compiled_greedy_speculation_equals_transformers_generate(family, tmp_path, tmp_path_factory):
    """The fast path's short forwards compiled by inductor (CPU) on a hybrid target: the Gated DeltaNet
    layers traced whole (fullgraph; Qwen3-Next's regrouping of in_proj_qkvz/in_proj_ba with them), their
    state records returned from the compiled call and settled after it, partial acceptances rolling the state
    back. The reply ends on a stop token, never on the length limit, so every verify is a full block of 8 and
    one shape is compiled (each costs tens of seconds here); greedy output equals transformers' own."""
    import os

    from dflash_cli.engine.compile import compiler_for

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    compiled = load_pair(*save_family(family, tmp_path, block_size=8), device="cpu", dtype="float32")
    notes: list[str] = []
    assert compiled.target.enable_fast_path(400, pad_to=8, compile_step=compiler_for(torch.device("cpu")),
                                            on_fallback=notes.append) is None
    # a stop token that leaves a full block of budget at every step before it
    prompt, reference, end = varied_reply(compiled.target, 60, range(45, 19, -1))
    for drafter_used in (compiled.drafter, oracle(compiled, prompt, 0.6, seed=3)):
        got = generate(compiled.target, drafter_used, prompt, max_new_tokens=60, stop_ids=[reference[end]],
                       block_size=8, adaptive=False)
        assert got.tokens == reference[: end + 1]
        assert got.stats.steps > 1
    assert 1.3 < got.stats.acceptance_length < 8  # the oracle's partial acceptances rolled the state back
    assert notes == [] and compiled.target.fast_compiled
    assert list(compiled.target.fast._compiled) == [True]  # the verify forward (with taps) ran compiled


def test_transformers_forward_is_refused_for_hybrids(pair):
    target = pair.target
    fast = target.fast
    target.disable_fast_path()
    try:
        with pytest.raises(UnsupportedModelError, match="linear-attention"):
            generate(target, None, [1, 2, 3], max_new_tokens=2, stop_ids=[])
    finally:
        target.fast = fast


def test_memory_planner_counts_the_states_the_engine_allocates(pair):
    from dflash_cli.models.memory.sizes import kv_cache_bytes

    config = pair.target.model.config.to_dict()
    linear = DecodeState(pair.target, None).target_cache.linear
    allocated = sum(t.numel() * t.element_size() for group in linear.convs + linear.states for t in group)
    assert kv_cache_bytes(config, 0, dtype_bytes=4) == allocated  # fp32 conv states here; no K/V rows


def test_the_published_qwen3_5_pair_checks_and_plans_from_configs_only():
    from conftest import HF_CONFIGS, read_json

    from dflash_cli.engine.drafter import DrafterConfig
    from dflash_cli.engine.pairing import check_pair, check_target_config
    from dflash_cli.models.memory.plan import plan_memory

    target = read_json(HF_CONFIGS / "Qwen__Qwen3.5-4B" / "config.json")
    drafter = read_json(HF_CONFIGS / "z-lab__Qwen3.5-4B-DFlash" / "config.json")
    check_target_config(target, "Qwen/Qwen3.5-4B")  # no longer refused
    assert check_pair(target, DrafterConfig.from_dict(drafter)) == [1, 5, 9, 13, 17, 21, 25, 29]
    plan = plan_memory(target, drafter, quant="bf16", context_tokens=8192, available_bytes=24 * 2**30)
    assert plan.fits and 8e9 < plan.total < 14e9


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_cli_runs_a_hybrid_pair_even_with_compile_off(family, tmp_path):
    import json

    from click.testing import CliRunner
    from conftest import save_tiny_tokenizer

    from dflash_cli.ui.cli import cli

    target, drafter = save_family(family, tmp_path)
    save_tiny_tokenizer(target)
    base = ["generate", "-m", str(target), "--dtype", "float32", "--device", "cpu", "-n", "12", "--json"]
    runs = {name: CliRunner().invoke(cli, base + args + ["Hello"]) for name, args in
            [("plain", ["--no-draft"]), ("spec", ["--draft", str(drafter)]),
             ("off", ["--draft", str(drafter), "--compile", "off"])]}
    out = {name: json.loads(r.stdout) for name, r in runs.items() if r.exit_code == 0}
    assert out.keys() == runs.keys(), {n: r.stderr for n, r in runs.items()}
    assert out["plain"]["text"] == out["spec"]["text"] == out["off"]["text"]
    assert out["off"]["forward"].startswith("static cache") and "hybrid" in out["off"]["forward"]
