"""The drafter module: attention masks and KV injection against a dense reference written out here."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import drafter_config, target_config

from dflash_cli.engine.drafter import DFlashDrafter, block_mask
from dflash_cli.engine.hf_config import DrafterConfig, fallback_taps


def make_drafter(**overrides) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = drafter_config(target_config(), layers=3, taps=(1, 3), **overrides)
    model = DFlashDrafter(DrafterConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.init_rotary(torch.device("cpu"))
    return model.eval()


def rms(x, weight, eps=1e-6):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, position, theta):
    """Rotate-half RoPE of one vector (..., d) at one integer position."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.cat([position * inv, position * inv]).to(x.dtype)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * angle.cos() + rotated * angle.sin()


def visible(q_pos, k_pos, kind, window, is_causal):
    causal = (kind == "sliding_attention") if is_causal is None else is_causal
    ok = True
    if causal:
        ok = ok and k_pos <= q_pos
    if kind == "sliding_attention":
        ok = ok and q_pos - k_pos < window
        if not causal:
            ok = ok and k_pos - q_pos < window
    return ok


def dense_reference(model: DFlashDrafter, context, block, theta):
    """The forward pass of docs/format.md section 4, one query and one head at a time."""
    cfg = model.config
    T, B = context.shape[1], block.shape[1]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = rms(model.fc(context)[0], model.hidden_norm.weight)  # (T, H)
    h = block[0]
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        x = rms(h, layer.input_layernorm.weight)
        rows = torch.cat([ctx, x])  # context first, then the block
        q = a.q_proj(x).view(B, nh, hd)
        k = a.k_proj(rows).view(T + B, nkv, hd)
        v = a.v_proj(rows).view(T + B, nkv, hd)
        q = rms(q, a.q_norm.weight)
        k = rms(k, a.k_norm.weight)
        out = torch.zeros(B, nh, hd)
        for qi in range(B):
            q_pos = T + qi
            for head in range(nh):
                kv = head // (nh // nkv)
                qv = rope(q[qi, head], q_pos, theta)
                keys = [j for j in range(T + B)
                        if visible(q_pos, j, cfg.layer_types[i], cfg.sliding_window, cfg.is_causal)]
                scores = torch.stack([qv @ rope(k[j, kv], j, theta) for j in keys]) / math.sqrt(hd)
                weights = torch.softmax(scores, 0)
                out[qi, head] = sum(w * v[j, kv] for w, j in zip(weights, keys))
        h = h + a.o_proj(out.reshape(B, nh * hd))
        h = h + layer.mlp(rms(h, layer.post_attention_layernorm.weight))
    return rms(h, model.norm.weight)


CASES = {
    "full (bidirectional)": dict(),
    "sliding + full": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           sliding_window=5, use_sliding_window=True),
    "is_causal=true": dict(is_causal=True),
    "is_causal=false on sliding": dict(layer_types=["sliding_attention"] * 3, sliding_window=4,
                                       use_sliding_window=True, is_causal=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_drafter_matches_dense_reference(case):
    model = make_drafter(**CASES[case])
    torch.manual_seed(1)
    T, B = 11, 6
    context = torch.randn(1, T, 2 * 64)
    block = torch.randn(1, B, 64)
    with torch.no_grad():
        fast = model(context, block, T, model.new_cache())[0]
        slow = dense_reference(model, context, block, theta=1e6)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


def test_context_fed_in_pieces_equals_context_fed_at_once():
    model = make_drafter(**CASES["sliding + full"])
    torch.manual_seed(2)
    context = torch.randn(1, 13, 128)
    block = torch.randn(1, 6, 64)
    with torch.no_grad():
        whole = model(context, block, 13, model.new_cache())
        cache = model.new_cache()
        model(context[:, :4], block, 4, cache)
        model(context[:, 4:9], block, 9, cache)
        pieces = model(context[:, 9:], block, 13, cache)
    assert cache.length == 13  # committed context only: the blocks' own K/V were not kept
    torch.testing.assert_close(whole, pieces, rtol=1e-5, atol=1e-5)


def test_block_mask_rules():
    full = block_mask(10, 4, 14, causal=False, window=None, device=torch.device("cpu"))
    assert full is None  # everything visible: no mask at all (fast attention path)
    causal = block_mask(10, 4, 14, causal=True, window=3, device=torch.device("cpu"))
    for qi in range(4):
        for k in range(14):
            assert bool(causal[qi, k]) == (k <= 10 + qi and 10 + qi - k < 3)


def test_rope_parameters_and_rope_theta_spellings_agree():
    a = make_drafter(rope_theta=5e5)
    b_cfg = drafter_config(target_config(), layers=3, taps=(1, 3))
    b_cfg.pop("rope_theta"), b_cfg.pop("rope_scaling")
    b_cfg["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    b = DFlashDrafter(DrafterConfig.from_dict(b_cfg))
    b.load_state_dict(a.state_dict())
    b.init_rotary(torch.device("cpu"))
    x, block = torch.randn(1, 5, 128), torch.randn(1, 4, 64)
    with torch.no_grad():
        torch.testing.assert_close(a(x, block, 5, a.new_cache()), b(x, block, 5, b.new_cache()))
        c = make_drafter(rope_theta=1e4)
        c.load_state_dict(a.state_dict())
        assert not torch.allclose(a(x, block, 5, a.new_cache()), c(x, block, 5, c.new_cache()))


def test_fallback_tap_layers():
    assert fallback_taps(5, 36) == [1, 9, 17, 25, 33]
    assert fallback_taps(1, 36) == [18]
    cfg = drafter_config(target_config(), layers=5)
    del cfg["dflash_config"]["target_layer_ids"]
    cfg["num_target_layers"] = 36
    assert DrafterConfig.from_dict(cfg).tap_layers() == [1, 9, 17, 25, 33]
    del cfg["num_target_layers"]
    assert DrafterConfig.from_dict(cfg).tap_layers(32) == fallback_taps(5, 32)


def test_block_size_top_level_or_nested():
    target = target_config()
    assert DrafterConfig.from_dict(drafter_config(target, block_size=10)).block_size == 10
    nested = drafter_config(target, block_size=12, nested_block=True)
    nested["block_size"] = 99  # nested wins over top level
    assert DrafterConfig.from_dict(nested).block_size == 12
    plain = drafter_config(target)
    del plain["block_size"]
    assert DrafterConfig.from_dict(plain).block_size == 16
