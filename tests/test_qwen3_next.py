"""Qwen3-Next targets (Qwen3-Coder-Next): Gated DeltaNet + gated attention + a MoE with a shared expert. The
speculative decoding checks the Qwen3.5 hybrids pass run on it too (tests/test_hybrid.py's families); here,
what only this family has.

What differs from Qwen3.5 is the DeltaNet's input projections: in_proj_qkvz and in_proj_ba, whose rows are
grouped per key head, where Qwen3.5 has in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (the norms, the
output gate, partial rotary and the MoE block compute the same). The tiny target (conftest.QWEN3_NEXT_CONFIG)
is saved with its config.json in the published form (no layer_types, top-level rope_theta and
partial_rotary_factor, full_attention_interval) and loaded through the real loader, in fp32.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import QWEN3_NEXT_CONFIG, VOCAB, drafter_config
from support.hybrid_models import FAMILIES, load_family

from dflash_cli.engine.linear_attention import (
    conv_after,
    gated_delta_net,
    linear_projections,
    split_inputs,
    state_after,
)
from dflash_cli.engine.state import DecodeState

TAPS = FAMILIES["qwen3_next"].taps


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pair = load_family("qwen3_next", tmp_path_factory.mktemp("qwen3-next"))
    assert type(pair.target.model).__name__ == "Qwen3NextForCausalLM"
    assert pair.target.model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    return pair


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


def test_the_published_form_config_checks_as_a_hybrid(pair):
    from dflash_cli.engine.drafter import DrafterConfig
    from dflash_cli.engine.fast_layers import fast_path_unsupported
    from dflash_cli.engine.pairing import HYBRID_MODEL_TYPES, check_pair, check_target_config

    assert "qwen3_next" in HYBRID_MODEL_TYPES
    check_target_config(dict(QWEN3_NEXT_CONFIG), "Qwen/Qwen3-Coder-Next")
    check_target_config(pair.target.model.config.to_dict(), "Qwen/Qwen3-Coder-Next")  # with layer_types
    drafter = drafter_config(dict(hidden_size=64, vocab_size=VOCAB, num_hidden_layers=8), taps=TAPS)
    assert check_pair(QWEN3_NEXT_CONFIG, DrafterConfig.from_dict(drafter)) == list(TAPS)
    assert fast_path_unsupported(pair.target.model) is None
