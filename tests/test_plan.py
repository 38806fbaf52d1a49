"""The memory planner against real published configs and known checkpoint sizes (data/hf-configs/SOURCES.md)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from dflash_cli.engine.config import drafter_block_size
from dflash_cli.models import plan as P
from dflash_cli.models import sizes as S
from dflash_cli.models.plan import GIB, choose_quant, format_plan, plan_memory
from dflash_cli.models.sizes import drafter_kv_cache_bytes, drafter_weight_bytes, kv_cache_bytes, target_weight_bytes

DATA = Path(__file__).parent / "data" / "hf-configs"

# z-lab/Qwen3-8B-DFlash-b16 @9b41424b: only these fields are published (SOURCES.md, "Partial")
QWEN3_8B_DRAFTER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "num_hidden_layers": 5, "hidden_size": 4096, "intermediate_size": 12288,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "sliding_window": None, "use_sliding_window": False,
    "num_target_layers": 36,
}


def cfg(name: str) -> dict:
    return json.loads((DATA / name / "config.json").read_text())


def within(estimate: float, real: float, tol: float = 0.10) -> bool:
    return abs(estimate - real) / real <= tol


@pytest.mark.parametrize("module", [P, S])
def test_module_does_not_import_torch(module):
    assert "torch" not in module.__dict__
    source = Path(module.__file__).read_text()
    assert "import torch" not in source and "from torch" not in source


# --- drafters: exact parameter counts and safetensors sizes -------------------------------------------


@pytest.mark.parametrize("config, params, file_bytes", [
    (lambda: cfg("z-lab__Qwen3-4B-DFlash-b16"), 537_427_200, 1_074_860_568),
    (lambda: QWEN3_8B_DRAFTER, 1_048_626_432, 2_097_259_104),
    (lambda: cfg("z-lab__Qwen3.5-4B-DFlash"), 634_425_856, 1_268_859_081),
])
def test_drafter_sizes_match_published_checkpoints(config, params, file_bytes):
    est = drafter_weight_bytes(config(), "bf16")
    assert est.total_params == params
    assert est.total == 2 * params
    assert est.disk_bytes == 2 * params
    # the file adds only its safetensors header (a few KiB)
    assert 0 < file_bytes - est.disk_bytes < 16_384
    assert within(est.total, file_bytes, 0.001)
    assert est.embeddings == 0 and est.lm_head == 0


def test_qwen3_8b_drafter_is_accepted_by_the_engine_parser():
    from dflash_cli.engine.drafter import DrafterConfig

    parsed = DrafterConfig.from_dict(QWEN3_8B_DRAFTER)
    assert parsed.block_size == 16 and parsed.tap_layers() == [1, 9, 17, 25, 33]
    assert drafter_block_size(QWEN3_8B_DRAFTER) == parsed.block_size
    assert drafter_block_size(cfg("z-lab__Qwen3.5-4B-DFlash")) == 16  # nested dflash_config.block_size


def test_drafter_components():
    est = drafter_weight_bytes(cfg("z-lab__Qwen3-4B-DFlash-b16"))
    assert est.fc == 5 * 2560 * 2560 * 2
    assert est.norms_other == (5 * (2 * 2560 + 2 * 128) + 2 * 2560) * 2
    # drafter quantization touches the draft layers only: fc and norms stay 16-bit
    q = drafter_weight_bytes(cfg("z-lab__Qwen3-4B-DFlash-b16"), "int8")
    assert q.fc == est.fc and q.norms_other == est.norms_other
    assert q.layers_linear < 0.51 * est.layers_linear


# --- targets: against the Hub listings ----------------------------------------------------------------


def test_qwen3_8b_bf16_matches_listing():
    est = target_weight_bytes(cfg("Qwen__Qwen3-8B"), "bf16")
    assert est.total_params == 8_190_735_360  # "8.2B"
    assert within(est.total, 16.4e9, 0.01)
    assert within(est.total, 16.4e9)
    assert est.disk_bytes == est.total
    assert est.embeddings == est.lm_head == 151936 * 4096 * 2  # untied


def test_smollm2_bf16_matches_listing():
    est = target_weight_bytes(cfg("HuggingFaceTB__SmolLM2-135M-Instruct"), "bf16")
    assert est.lm_head == 0  # tied
    assert within(est.total, 269e6, 0.01)


def test_gpt_oss_20b_on_disk_mxfp4_vs_in_memory_bf16():
    est = target_weight_bytes(cfg("openai__gpt-oss-20b"), "bf16")
    assert 20.8e9 < est.total_params < 21.0e9  # "21B parameters"
    listing = (4.79 + 4.8 + 4.17) * 1e9
    assert within(est.disk_bytes, listing, 0.01)
    assert "MXFP4" in est.disk_format
    # in memory, dequantized to bf16: about twice a bf16 copy of everything
    assert est.total == 2 * est.total_params
    assert est.total > 3 * est.disk_bytes
    assert est.approximate and any("MXFP4" in n for n in est.notes)
    # router, sinks and expert biases are counted
    assert est.experts > 0.9 * est.total


def test_moe_counts_experts_and_keeps_them_16bit_under_bnb():
    c = cfg("Qwen__Qwen3-Coder-30B-A3B-Instruct")
    bf = target_weight_bytes(c, "bf16")
    assert 30.4e9 < bf.total_params < 30.6e9  # "30.5B"
    assert bf.params["experts"] == 48 * 128 * 3 * 768 * 2048
    nf = target_weight_bytes(c, "nf4")
    assert nf.experts == bf.experts  # fused 3-D parameters: not nn.Linear, not quantized
    assert nf.layers_linear < bf.layers_linear
    assert any("fused" in n for n in nf.notes)


def test_llama_and_qwen3_4b_param_counts():
    assert target_weight_bytes(cfg("meta-llama__Llama-3.1-8B-Instruct")).total_params == 8_030_261_248
    assert target_weight_bytes(cfg("Qwen__Qwen3-4B")).total_params == 4_022_468_096


def test_qwen3_5_hybrid_text_model_is_counted_approximately():
    est = target_weight_bytes(cfg("Qwen__Qwen3.5-4B"))
    assert est.approximate
    assert 4.0e9 < est.total_params < 4.4e9


# --- quantization -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Qwen__Qwen3-8B", "HuggingFaceTB__SmolLM2-135M-Instruct",
                                  "meta-llama__Llama-3.1-8B-Instruct", "openai__gpt-oss-20b"])
def test_nf4_lt_int8_lt_bf16_lt_fp32(name):
    c = cfg(name)
    t = {q: target_weight_bytes(c, q).total for q in ("nf4", "int8", "bf16", "fp32")}
    assert t["nf4"] < t["int8"] < t["bf16"] < t["fp32"]
    assert target_weight_bytes(c, "fp16").total == t["bf16"]
    assert target_weight_bytes(c, "none").total == t["bf16"]


def test_embeddings_lm_head_and_norms_stay_16bit_under_quantization():
    c = cfg("Qwen__Qwen3-8B")
    bf = target_weight_bytes(c, "bf16")
    for q in ("int8", "nf4"):
        est = target_weight_bytes(c, q)
        assert est.embeddings == bf.embeddings == 151936 * 4096 * 2
        assert est.lm_head == bf.lm_head
        assert est.norms_other == bf.norms_other


def test_bitsandbytes_byte_rules_on_one_linear():
    c = S._Counts()
    c.add(4096, 1024)
    lin = c.linears[0]
    n = 4096 * 1024
    assert S._linear_bytes(lin, "int8", False) == n + 4 * 1024
    assert S._linear_bytes(lin, "nf4", False) == n // 2 + (n // 64) * 4
    assert S._linear_bytes(lin, "nf4", True) < S._linear_bytes(lin, "nf4", False)


def test_layers_linear_ratios():
    c = cfg("Qwen__Qwen3-8B")
    bf, i8, nf = (target_weight_bytes(c, q).layers_linear for q in ("bf16", "int8", "nf4"))
    assert i8 / bf == pytest.approx(0.5, abs=0.01)
    assert nf / bf == pytest.approx(0.5625 / 2, abs=0.01)  # 4 bits + fp32 absmax per 64


def test_unknown_quant_is_refused():
    with pytest.raises(ValueError):
        target_weight_bytes(cfg("Qwen__Qwen3-8B"), "int4")


# --- KV caches ------------------------------------------------------------------------------------------


def test_kv_cache_hand_computed():
    # Qwen3-8B: 36 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes = 147,456 B per token
    assert kv_cache_bytes(cfg("Qwen__Qwen3-8B"), 1000) == 36 * 8 * 128 * 2 * 2 * 1000 == 147_456_000
    assert kv_cache_bytes(cfg("Qwen__Qwen3-8B"), 1000, dtype_bytes=4) == 2 * 147_456_000


def test_kv_cache_caps_sliding_layers_at_their_window():
    c = cfg("openai__gpt-oss-20b")  # 12 sliding (window 128) + 12 full, 8 KV heads x 64
    per_row = 2 * 8 * 64 * 2
    assert kv_cache_bytes(c, 100) == 24 * per_row * 100
    assert kv_cache_bytes(c, 10_000) == 12 * per_row * 10_000 + 12 * per_row * 128


def test_drafter_kv_cache_is_not_capped():
    d = cfg("z-lab__Qwen3.5-4B-DFlash")  # 5 sliding (4096) + 1 full; DraftCache keeps every row
    per_row = 2 * 8 * 128 * 2
    assert drafter_kv_cache_bytes(d, 10_000) == 6 * per_row * 10_000
    assert kv_cache_bytes(d, 10_000) == 5 * per_row * 4096 + per_row * 10_000
    assert drafter_kv_cache_bytes(QWEN3_8B_DRAFTER, 8192) == 5 * 8 * 128 * 2 * 2 * 8192


# --- plans ------------------------------------------------------------------------------------------------


def test_plan_components_add_up():
    p = plan_memory(cfg("Qwen__Qwen3-8B"), QWEN3_8B_DRAFTER, quant="int8", context_tokens=4096,
                    block_size=16, available_bytes=80 * GIB)
    assert p.fits and p.suggestions == []
    assert p.total == sum(p.components.values())
    assert p.target_kv == kv_cache_bytes(cfg("Qwen__Qwen3-8B"), 4096 + 16)
    assert p.drafter_weights == 2 * 1_048_626_432
    parts = p.activation_parts
    assert parts["logits"] == 2 * 16 * 151936 * 4
    assert parts["cuda_context"] == GIB // 2
    assert parts["margin"] == int(0.1 * (p.target_weights + p.drafter_weights))


def test_12gib_gpu_qwen3_8b_with_drafter_at_8k_is_quantized():
    t, d = cfg("Qwen__Qwen3-8B"), QWEN3_8B_DRAFTER
    q = choose_quant(t, d, context_tokens=8192, block_size=16, available_bytes=12 * GIB)
    assert q in ("int8", "nf4")
    chosen = plan_memory(t, d, quant=q, context_tokens=8192, block_size=16, available_bytes=12 * GIB)
    assert chosen.fits
    assert not plan_memory(t, d, quant="bf16", context_tokens=8192, block_size=16,
                           available_bytes=12 * GIB).fits
    auto = plan_memory(t, d, quant="auto", context_tokens=8192, available_bytes=12 * GIB)
    assert auto.quant == q and auto.block_size == 16


KNOBS = ("--quant", "--block-size", "context", "drafter quant", "--no-draft")


def test_4gib_does_not_fit_and_suggests_concrete_knobs():
    t, d = cfg("Qwen__Qwen3-8B"), QWEN3_8B_DRAFTER
    p = plan_memory(t, d, quant="bf16", context_tokens=8192, block_size=16, available_bytes=4 * GIB)
    assert not p.fits
    assert p.suggestions
    for s in p.suggestions:
        assert any(k in s for k in KNOBS), s
        assert "GiB total" in s
    knobs = {a.knob for a in p.alternatives}
    assert {"quant", "block_size", "drafter_quant"} <= knobs
    for a in p.alternatives:  # each total is a real re-plan
        assert a.total > 0 and a.fits == (a.total <= 4 * GIB)
    nf4 = next(a for a in p.alternatives if a.knob == "quant" and a.value == "nf4")
    assert nf4.total == plan_memory(t, d, quant="nf4", context_tokens=8192, block_size=16,
                                    available_bytes=4 * GIB).total


def test_shorter_context_suggestion_is_computed_and_fits():
    t = cfg("Qwen__Qwen3-4B")
    d = cfg("z-lab__Qwen3-4B-DFlash-b16")
    budget = 14 * GIB
    p = plan_memory(t, d, quant="bf16", context_tokens=131072, block_size=16, available_bytes=budget)
    assert not p.fits
    ctx = next(a for a in p.alternatives if a.knob == "context_tokens")
    assert ctx.fits and 0 < ctx.value < 131072
    assert plan_memory(t, d, quant="bf16", context_tokens=ctx.value, block_size=16, available_bytes=budget).fits
    assert not plan_memory(t, d, quant="bf16", context_tokens=ctx.value + 1, block_size=16,
                           available_bytes=budget).fits
    assert f"{ctx.value:,} tokens" in ctx.text


def test_choose_quant_none_when_nothing_fits():
    t, d = cfg("Qwen__Qwen3-8B"), QWEN3_8B_DRAFTER
    assert choose_quant(t, d, context_tokens=8192, block_size=16, available_bytes=4 * GIB) is None
    assert choose_quant(t, d, context_tokens=8192, block_size=16, available_bytes=80 * GIB) == "bf16"
    small = cfg("HuggingFaceTB__SmolLM2-135M-Instruct")
    assert choose_quant(small, None, context_tokens=2048, available_bytes=2 * GIB) == "bf16"


def test_format_plan_lines():
    p = plan_memory(cfg("Qwen__Qwen3-8B"), QWEN3_8B_DRAFTER, quant="bf16", context_tokens=8192,
                    block_size=16, available_bytes=12 * GIB)
    lines = format_plan(p)
    assert all(isinstance(x, str) for x in lines)
    table = lines[:7]
    assert table[0].startswith("target weights (bf16)") and table[0].endswith("GiB")
    assert table[5].startswith("total")
    assert "does not fit" in table[6]
    ends = {len(line) for line in table[:6]}
    assert len(ends) == 1  # values right-aligned in one column
    assert f"{p.total / GIB:.1f} GiB" in table[5]
    assert "alternatives:" in lines and any("--quant nf4" in x for x in lines)


def test_no_drafter_plan():
    p = plan_memory(cfg("HuggingFaceTB__SmolLM2-135M-Instruct"), None, quant="bf16", context_tokens=2048,
                    available_bytes=2 * GIB)
    assert p.fits and p.drafter_weights == 0 and p.drafter_kv == 0 and p.block_size == 1
    assert any("drafter weights (none)" in x for x in format_plan(p))


def test_real_size_table(capsys):
    """Not an assertion beyond 10%: prints the estimate-vs-known table (pytest -s) for the report."""
    rows = [
        ("z-lab/Qwen3-4B-DFlash-b16", drafter_weight_bytes(cfg("z-lab__Qwen3-4B-DFlash-b16")).disk_bytes,
         1_074_860_568),
        ("z-lab/Qwen3-8B-DFlash-b16", drafter_weight_bytes(QWEN3_8B_DRAFTER).disk_bytes, 2_097_259_104),
        ("z-lab/Qwen3.5-4B-DFlash", drafter_weight_bytes(cfg("z-lab__Qwen3.5-4B-DFlash")).disk_bytes,
         1_268_859_081),
        ("Qwen/Qwen3-8B", target_weight_bytes(cfg("Qwen__Qwen3-8B")).disk_bytes, 16.4e9),
        ("SmolLM2-135M-Instruct", target_weight_bytes(cfg("HuggingFaceTB__SmolLM2-135M-Instruct")).disk_bytes,
         269e6),
        ("openai/gpt-oss-20b (disk)", target_weight_bytes(cfg("openai__gpt-oss-20b")).disk_bytes,
         (4.79 + 4.8 + 4.17) * 1e9),
    ]
    for name, est, real in rows:
        assert within(est, real), name
        print(f"{name:28} {est:>16,.0f} {real:>16,.0f} {100 * (est - real) / real:+.3f}%", file=sys.stderr)


def test_dflash2_drafter_is_counted_tensor_for_tensor_against_its_published_header():
    header = json.loads((DATA / "z-lab__dflash2-muse-glimmer-fixture" / "safetensors-header.json").read_text())
    published = sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    estimate = drafter_weight_bytes(cfg("z-lab__dflash2-muse-glimmer-fixture"))
    assert estimate.total_params == published  # layers, convolutions, selector and codebooks
    # quantizing the drafter leaves the codebooks 16-bit (quantized codebooks drop acceptance to ~0)
    assert drafter_weight_bytes(cfg("z-lab__dflash2-muse-glimmer-fixture"), "nf4").total > 2 * 202048 * 256 * 2
