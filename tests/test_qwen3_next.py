"""Qwen3-Next targets (Qwen3-Coder-Next): Gated DeltaNet + gated attention + a MoE with a shared expert, on the
fast path with the exact linear-attention rollback of the Qwen3.5 hybrids (tests/test_hybrid.py).

What differs from Qwen3.5 is the DeltaNet's input projections: in_proj_qkvz and in_proj_ba, whose rows are
grouped per key head, where Qwen3.5 has in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (the norms, the
output gate, partial rotary and the MoE block compute the same). A tiny random target, scaled down from the
published Qwen3-Next config and saved with its config.json in the published form (no layer_types, top-level
rope_theta and partial_rotary_factor, full_attention_interval), is loaded through the real loader; fp32, so
greedy speculation must equal transformers' own greedy generate token for token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, TargetForwardLog, drafter_config, interrupt_on_call, save_random_drafter
from test_speculative import hf_greedy

from dflash_cli.engine.generate import generate, stream_generate
from dflash_cli.engine.linear_attention import (
    conv_after,
    gated_delta_net,
    linear_projections,
    split_inputs,
    state_after,
)
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.state import DecodeState

# Qwen3-Next-80B-A3B / Qwen3-Coder-Next's config.json (48 layers, hidden 2048, 16/2 heads of 256, 512 experts
# top 10, DeltaNet 16 key / 32 value heads of 128) scaled down: 8 layers, so two full-attention layers (3 and
# 7, the last one as there) among six DeltaNets; 2 key heads shared by 4 value heads as there, and a key
# head dim unlike the value head dim, so that a misplaced channel shows; one dense-MLP layer (mlp_only_layers)
# beside the MoE ones.
PUBLISHED_FORM = dict(
    architectures=["Qwen3NextForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=1,
    decoder_sparse_step=1, eos_token_id=2, full_attention_interval=4, head_dim=32, hidden_act="silu",
    hidden_size=64, initializer_range=0.02, intermediate_size=96, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=8, max_position_embeddings=512,
    mlp_only_layers=[5], model_type="qwen3_next", moe_intermediate_size=32, norm_topk_prob=True,
    num_attention_heads=4, num_experts=8, num_experts_per_tok=3, num_hidden_layers=8, num_key_value_heads=2,
    output_router_logits=False, partial_rotary_factor=0.25, rms_norm_eps=1e-6, rope_scaling=None,
    rope_theta=5000000, router_aux_loss_coef=0.001, shared_expert_intermediate_size=32, tie_word_embeddings=False,
    torch_dtype="float32", use_cache=True, use_sliding_window=False, vocab_size=VOCAB)
TAPS = (1, 3, 6, 7)


def save_qwen3_next_target(folder: Path, seed: int = 0, scale: float = 3.0) -> Path:
    """A random tiny Qwen3-Next saved with save_pretrained, its config.json then put back in the published
    form (transformers 5 writes layer_types and rope_parameters instead)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PUBLISHED_FORM), dtype=torch.float32)
    with torch.no_grad():  # larger weights: a state error of a rejected draft then changes the output
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(scale)
            elif name.endswith("norm.weight"):  # zero-centred norms (1 + weight): not all ones
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    (Path(folder) / "config.json").write_text(json.dumps(PUBLISHED_FORM, indent=2))
    return Path(folder)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-next")
    target = save_qwen3_next_target(root / "target", seed=3)
    drafter = save_random_drafter(root / "drafter", drafter_config(dict(hidden_size=64, vocab_size=VOCAB,
                                                                         num_hidden_layers=8), taps=TAPS,
                                                                         block_size=16), seed=2)
    pair = load_pair(target, drafter, device="cpu", dtype="float32")
    assert type(pair.target.model).__name__ == "Qwen3NextForCausalLM"
    assert pair.target.model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    assert pair.target.hybrid and pair.target.enable_fast_path(400, pad_to=16) is None
    return pair


def prompts(n, seed, longest=90):
    rng = random.Random(seed)  # up to 90 tokens: prompts span one or two 64-token chunks
    return [[rng.randrange(3, 140) for _ in range(rng.randrange(1, longest))] for _ in range(n)]


def oracle(pair, prompt, acceptance, seed=1, n=60):
    return OracleDrafter(pair.drafter, prompt + hf_greedy(pair.target, prompt, n), acceptance=acceptance,
                         seed=seed, vocab_size=VOCAB)


def linear_states(state: DecodeState) -> list[torch.Tensor]:
    linear = state.target_cache.linear
    linear.settle(state.target_cache.length)
    convs, states = linear.current()
    return convs + states


def test_input_projections_are_regrouped_as_transformers_does(pair):
    """in_proj_qkvz / in_proj_ba's per-key-head groups give exactly transformers' q, k, v, z, b, a."""
    net = next(layer.linear_attn for layer in pair.target.layers if hasattr(layer, "linear_attn"))
    assert net.num_v_heads // net.num_k_heads == 2 and net.head_k_dim != net.head_v_dim
    x = torch.randn(1, 7, 64)
    qkvz, ba = net.in_proj_qkvz(x), net.in_proj_ba(x)
    q, k, v, z, b, a = net.fix_query_key_value_ordering(qkvz, ba)
    mixed, z2, b2, a2 = split_inputs(net, (qkvz, ba))
    assert torch.equal(mixed, torch.cat([t.reshape(1, 7, -1) for t in (q, k, v)], dim=-1))
    assert torch.equal(z2, z.reshape(1, 7, -1)) and torch.equal(b2, b) and torch.equal(a2, a)


@pytest.mark.parametrize("n", [5, 64, 70])
def test_a_delta_net_layer_equals_transformers(pair, n):
    """One layer from a zero state, one chunk and more than one: outputs and the state after the tokens."""
    from transformers.cache_utils import DynamicCache

    layer = next(layer for layer in pair.target.layers if hasattr(layer, "linear_attn"))
    net = layer.linear_attn
    torch.manual_seed(n)
    x = torch.randn(1, n, 64)
    conv = torch.zeros(1, net.conv_dim, net.conv_kernel_size - 1)
    state = torch.zeros(net.num_v_heads, net.head_k_dim, net.head_v_dim)
    with torch.no_grad():
        got, record = gated_delta_net(net, linear_projections(layer, lambda *m: None), x, conv, state)
        cache = DynamicCache(config=pair.target.model.config)
        want = net(x, cache=cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state_after(record, record.tokens)[None], cache.get_recurrent_state(net.layer_idx, 0),
                               rtol=1e-4, atol=1e-5)
    # transformers keeps the last K inputs (the first is never read again), the engine the last K-1
    kept = cache.get_conv_state(net.layer_idx, 0)[..., 1:]
    torch.testing.assert_close(conv_after(record, record.tokens, net.conv_kernel_size), kept, rtol=0, atol=0)


def test_fast_forward_logits_equal_transformers_forward(pair):
    """The whole model over a 100-token prompt (two chunks), then 3 tokens on top: fast path against
    transformers' forward (attention gate, partial rotary, 1 + weight norms, MoE with shared expert)."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, 140) for _ in range(103)]
    with torch.no_grad():
        want = pair.target.model(torch.tensor([prompt])).logits[0]
    state = DecodeState(pair.target, None, own_caches=True)
    first, _ = pair.target.forward(torch.tensor([prompt[:100]]), state.target_cache, 0)
    more, _ = pair.target.forward(torch.tensor([prompt[100:]]), state.target_cache, 100)
    torch.testing.assert_close(torch.cat([first, more]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [3, 8, 16])
def test_greedy_speculation_equals_transformers_generate(pair, block_size):
    for prompt in prompts(3, seed=block_size):
        reference = hf_greedy(pair.target, prompt, 30)
        assert generate(pair.target, None, prompt, max_new_tokens=30, stop_ids=[]).tokens == reference
        assert generate(pair.target, pair.drafter, prompt, max_new_tokens=30, stop_ids=[],
                        block_size=block_size).tokens == reference
        for acceptance in (0.5, 0.85):  # partial acceptances: every step rolls the state back
            got = generate(pair.target, oracle(pair, prompt, acceptance, n=30), prompt, max_new_tokens=30,
                           stop_ids=[], block_size=block_size, adaptive=False)
            assert got.tokens == reference
            assert 1.3 < got.stats.acceptance_length < block_size


@pytest.mark.parametrize("length", [63, 64, 65, 127, 128, 129])
def test_prompts_on_a_chunk_boundary_match_transformers(pair, length):
    """Prompts run in 64-token chunks: ending exactly on (or one past) a chunk boundary, then speculative
    steps that roll the state back, give transformers' own greedy tokens."""
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
    prompt = [9, 8, 7, 6, 5]
    reference = hf_greedy(pair.target, prompt, 40)
    stop = next(t for i, t in enumerate(reference) if i >= 10 and t not in reference[:i])
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
    handle = attention_layer.post_attention_layernorm.register_forward_hook(interrupt_on_call(4))
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


def test_compiled_greedy_speculation_equals_transformers_generate(tmp_path, tmp_path_factory):
    """The short forwards compiled by inductor (CPU, fullgraph), the regrouping of in_proj_qkvz/in_proj_ba
    traced with the rest: one verify shape (full blocks of 8 up to a stop token), partial acceptances
    rolling the state back; greedy output equals transformers' own. About 25 s of compiling here."""
    import os

    from dflash_cli.engine.compile import compiler_for

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    target = save_qwen3_next_target(tmp_path / "target", seed=3)
    drafter = save_random_drafter(tmp_path / "drafter", drafter_config(dict(hidden_size=64, vocab_size=VOCAB,
                                                                             num_hidden_layers=8), taps=TAPS), seed=2)
    compiled = load_pair(target, drafter, device="cpu", dtype="float32")
    notes: list[str] = []
    assert compiled.target.enable_fast_path(400, pad_to=8, compile_step=compiler_for(torch.device("cpu")),
                                            on_fallback=notes.append) is None
    for seed in range(20):  # a varied reply with a stop token that leaves a full block of budget at every step
        prompt = prompts(1, seed=seed, longest=40)[0]
        reference = hf_greedy(compiled.target, prompt, 60)
        end = next((i for i in range(45, 19, -1) if reference[i] not in reference[:i]), None)
        if end is not None:
            break
    assert end is not None
    for drafter_used in (compiled.drafter, oracle(compiled, prompt, 0.6, seed=3)):
        got = generate(compiled.target, drafter_used, prompt, max_new_tokens=60, stop_ids=[reference[end]],
                       block_size=8, adaptive=False)
        assert got.tokens == reference[: end + 1]
        assert got.stats.steps > 1
    assert 1.3 < got.stats.acceptance_length < 8  # the oracle's partial acceptances rolled the state back
    assert notes == [] and compiled.target.fast_compiled
    assert list(compiled.target.fast._compiled) == [True]  # the verify forward (with taps) ran compiled


def test_memory_planner_counts_the_states_the_engine_allocates(pair):
    from dflash_cli.models.sizes import kv_cache_bytes

    config = pair.target.model.config.to_dict()
    linear = DecodeState(pair.target, None).target_cache.linear
    allocated = sum(t.numel() * t.element_size() for group in linear.convs + linear.states for t in group)
    assert kv_cache_bytes(config, 0, dtype_bytes=4) == allocated  # fp32 conv states here; no K/V rows


def test_the_published_form_config_checks_as_a_hybrid(pair):
    from dflash_cli.engine.drafter import DrafterConfig
    from dflash_cli.engine.fast import fast_path_unsupported
    from dflash_cli.engine.pairing import HYBRID_MODEL_TYPES, check_pair, check_target_config

    assert "qwen3_next" in HYBRID_MODEL_TYPES
    check_target_config(dict(PUBLISHED_FORM), "Qwen/Qwen3-Coder-Next")
    check_target_config(pair.target.model.config.to_dict(), "Qwen/Qwen3-Coder-Next")  # with layer_types
    drafter = drafter_config(dict(hidden_size=64, vocab_size=VOCAB, num_hidden_layers=8), taps=TAPS)
    assert check_pair(PUBLISHED_FORM, DrafterConfig.from_dict(drafter)) == list(TAPS)
    assert fast_path_unsupported(pair.target.model) is None


def test_cli_runs_a_qwen3_next_pair_even_with_compile_off(tmp_path):
    from click.testing import CliRunner
    from conftest import save_tiny_tokenizer

    from dflash_cli.ui.cli import cli

    target = save_qwen3_next_target(tmp_path / "target", seed=3)
    save_tiny_tokenizer(target)
    drafter = save_random_drafter(tmp_path / "drafter", drafter_config(dict(hidden_size=64, vocab_size=VOCAB,
                                                                             num_hidden_layers=8), taps=TAPS))
    base = ["generate", "-m", str(target), "--dtype", "float32", "--device", "cpu", "-n", "12", "--json"]
    runs = {name: CliRunner().invoke(cli, base + args + ["Hello"]) for name, args in
            [("plain", ["--no-draft"]), ("off", ["--draft", str(drafter), "--compile", "off"])]}
    out = {name: json.loads(r.stdout) for name, r in runs.items() if r.exit_code == 0}
    assert out.keys() == runs.keys(), {n: r.stderr for n, r in runs.items()}
    assert out["plain"]["text"] == out["off"]["text"]
    assert out["off"]["forward"].startswith("static cache") and "hybrid" in out["off"]["forward"]
