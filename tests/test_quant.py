"""bitsandbytes nf4/int8 loading of the target and the drafter (CPU backend)."""

from __future__ import annotations

import pytest
import torch
from conftest import drafter_config, save_random_drafter, save_target, target_config

from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_drafter, load_pair

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    cfg = target_config("qwen3")
    # bitsandbytes' CPU kernels need input widths that are multiples of its 64-wide blocks
    drafter = save_random_drafter(root / "d", drafter_config(cfg, intermediate_size=128), seed=2)
    return save_target(root / "t", cfg, seed=1, scale=3.0), drafter


@pytest.mark.parametrize("quant, layer_type", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_quantized_pair_loads_and_generates(folders, quant, layer_type):
    target, drafter = folders
    pair = load_pair(target, drafter, device="cpu", dtype="bfloat16", quant=quant, drafter_quant=quant)
    assert type(pair.target.model.model.layers[0].mlp.down_proj).__name__ == layer_type
    assert type(pair.drafter.layers[0].self_attn.q_proj).__name__ == layer_type
    # embeddings and the LM head stay 16-bit, as the drafter reads them directly
    assert pair.target.embed_weight.dtype == torch.bfloat16
    assert isinstance(pair.target.lm_head, torch.nn.Linear) and type(pair.target.lm_head).__name__ == "Linear"
    out = generate(pair.target, pair.drafter, [5, 6, 7, 8], max_new_tokens=20, stop_ids=[])
    assert out.stats.generated_tokens == 20 and out.stats.drafted > 0
    # the fast path calls the quantized layers as they are (never packs or compiles them)
    assert pair.target.enable_fast_path(200, pad_to=pair.drafter.block_size) is None
    assert type(pair.target.fast.projections[0]["down"]).__name__ == layer_type
    fast = generate(pair.target, pair.drafter, [5, 6, 7, 8], max_new_tokens=20, stop_ids=[], block_size=1)
    plain = generate(pair.target, None, [5, 6, 7, 8], max_new_tokens=20, stop_ids=[])
    assert fast.stats.generated_tokens == 20 and fast.tokens == plain.tokens


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_a_quantized_target_can_offload_layers(folders, quant):
    """A split the planner may choose: quantized layers in memory, the rest offloaded to disk."""
    target, drafter = folders
    pair = load_pair(target, drafter, device="cpu", dtype="bfloat16", quant=quant, drafter_quant=quant,
                     layer_devices=["cpu"] * 4 + ["disk"] * 2)
    assert pair.target.offloaded
    out = generate(pair.target, pair.drafter, [5, 6, 7, 8], max_new_tokens=12, stop_ids=[])
    assert out.stats.generated_tokens == 12


def test_quantized_drafter_drafts_like_the_dense_one(folders):
    target, drafter = folders
    dense = load_pair(target, drafter, device="cpu", dtype="bfloat16")
    quantized = load_drafter(drafter, device="cpu", dtype="bfloat16", quant="int8")
    context = torch.randn(1, 6, 3 * 64, dtype=torch.bfloat16)
    block = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        a = dense.drafter(context, block, 6, dense.drafter.new_cache()).float()
        b = quantized(context, block, 6, quantized.new_cache()).float()
    cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cosine > 0.98


def test_unknown_quantization_is_refused(folders):
    with pytest.raises(InvalidSettingError, match="unknown quantization 'fp3'"):
        load_drafter(folders[1], device="cpu", quant="fp3")
