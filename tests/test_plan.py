"""The memory planner against real published configs and known checkpoint sizes (data/hf-configs/SOURCES.md)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from support.hf_configs import DATA, QWEN3_CODER_NEXT, cfg

from dflash_cli.engine.hf_config import drafter_block_size
from dflash_cli.models.memory import params, split
from dflash_cli.models.memory import plan as P
from dflash_cli.models.memory import sizes as S
from dflash_cli.models.memory.plan import GIB, choose_quant, format_plan, plan_memory
from dflash_cli.models.memory.sizes import (
    drafter_kv_cache_bytes,
    drafter_weight_bytes,
    kv_cache_bytes,
    target_weight_bytes,
)

# z-lab/Qwen3-8B-DFlash-b16 @9b41424b: only these fields are published (SOURCES.md, "Partial")
QWEN3_8B_DRAFTER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "num_hidden_layers": 5, "hidden_size": 4096, "intermediate_size": 12288,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "sliding_window": None, "use_sliding_window": False,
    "num_target_layers": 36,
}


def within(estimate: float, real: float, tol: float = 0.10) -> bool:
    return abs(estimate - real) / real <= tol


@pytest.mark.parametrize("module", [P, S, params, split])
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
    c = params.Counts()
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


def test_a_q4a8_pair_counts_the_4_bit_copy_of_the_head_its_greedy_drafts_read():
    t, d = cfg("Qwen__Qwen3-8B"), QWEN3_8B_DRAFTER
    with_copy = plan_memory(t, d, quant="q4a8", drafter_quant="q8a8", context_tokens=4096, available_bytes=0)
    assert with_copy.drafter_estimate.components["head_shortlist"] == 151936 * 4096 * 5 // 8
    assert with_copy.drafter_weights == with_copy.drafter_estimate.total
    assert any("4-bit copy of the LM head" in note for note in with_copy.notes)
    for quant in ("q4", "int8"):  # no shortlist beside other formats
        plan = plan_memory(t, d, quant=quant, drafter_quant="q8a8", context_tokens=4096, available_bytes=0)
        assert "head_shortlist" not in plan.drafter_estimate.components


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


# --- issue 27: gpt-oss-120b (MXFP4), the giants (MLA mixture-of-experts), Gemma 4, Qwen3-Next ----------------
# Each count below is written out from the stored config.json by hand, term by term, as transformers 5.24
# builds the model (modeling_gpt_oss / deepseek_v3 / glm_moe_dsa / gemma4 / qwen3_next).


def gpt_oss_120b_by_hand() -> dict[str, int]:
    h, layers, vocab, experts, inter = 2880, 36, 201088, 128, 2880
    attn = (h * 64 * 64 + 64 * 64) + 2 * (h * 8 * 64 + 8 * 64) + (64 * 64 * h + h) + 64  # q, k, v, o (biased), sinks
    expert_w = experts * (2 * inter * h + h * inter)  # gate_up_proj + down_proj
    expert_b = experts * (2 * inter + h)
    router = experts * h + experts
    norms = 2 * h
    return {"expert_w": layers * expert_w, "expert_b": layers * expert_b,
            "rest": 2 * vocab * h + layers * (attn + router + norms) + h}


def test_gpt_oss_120b_parameters_disk_and_memory_by_hand():
    c = cfg("openai__gpt-oss-120b")
    hand = gpt_oss_120b_by_hand()
    total = sum(hand.values())
    est = target_weight_bytes(c)  # bf16, MXFP4 dequantized (a CPU, or a GPU without triton + kernels)
    assert est.total_params == total == 116_829_156_672  # "117B"
    # on disk: fp4 pairs in bytes + one uint8 scale per 32 values, the rest (expert biases included) bf16
    disk = hand["expert_w"] // 2 + hand["expert_w"] // 32 + 2 * (hand["expert_b"] + hand["rest"])
    assert est.disk_bytes == disk and within(disk, 65.25e9, 0.01)  # the Hub lists about 65.3 GB
    assert est.total == 2 * total and est.mxfp4 == "dequantized"  # dequantized: every parameter bf16
    packed = target_weight_bytes(c, mxfp4_packed=True)  # transformers' Mxfp4GptOssExperts: fp32 biases
    assert packed.experts == hand["expert_w"] // 2 + hand["expert_w"] // 32 + 4 * hand["expert_b"]
    assert packed.total == packed.experts + 2 * hand["rest"] and packed.mxfp4 == "packed"
    assert 60 * GIB < packed.total < 62 * GIB < 200 * GIB < est.total
    # 18 full-attention layers keep every row; 18 sliding layers (window 128) at most 128: 8 KV heads x 64
    per_row = 2 * 8 * 64 * 2
    assert kv_cache_bytes(c, 10_000) == 18 * per_row * 10_000 + 18 * per_row * 128


def test_gpt_oss_120b_on_an_80gib_gpu_fits_only_with_the_mxfp4_kernels():
    c = cfg("openai__gpt-oss-120b")
    d = GPT_OSS_120B_DRAFTER
    kept = plan_memory(c, d, quant="bf16", context_tokens=8192, available_bytes=80 * GIB, mxfp4_packed=True)
    assert kept.fits and kept.block_size == 10
    dequantized = plan_memory(c, d, quant="bf16", context_tokens=8192, available_bytes=80 * GIB)
    assert not dequantized.fits
    # the way out is the kernels, never bitsandbytes (transformers refuses it on an MXFP4 checkpoint)
    assert dequantized.alternatives[0].knob == "mxfp4" and dequantized.alternatives[0].fits
    assert not any(a.knob == "quant" or "--quant" in a.text for a in dequantized.alternatives)
    assert choose_quant(c, d, context_tokens=8192, available_bytes=80 * GIB, mxfp4_packed=True) == "bf16"
    assert choose_quant(c, d, context_tokens=8192, available_bytes=80 * GIB) is None
    assert plan_memory(c, d, quant="auto", context_tokens=8192, available_bytes=80 * GIB).quant == "bf16"


# z-lab/gpt-oss-120b-DFlash: the fields SOURCES.md lists ("New pairs"); no copy of the file was found
GPT_OSS_120B_DRAFTER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 10,
    "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 9, 17, 25, 33]}, "num_target_layers": 36,
    "num_hidden_layers": 8, "hidden_size": 2880, "intermediate_size": 7680, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "layer_types": ["full_attention"] * 8,
}


def test_gpt_oss_120b_drafter_is_the_size_its_card_gives():
    est = drafter_weight_bytes(GPT_OSS_120B_DRAFTER)
    assert 0.75e9 < est.total_params < 0.85e9  # "0.8B parameters"
    assert within(est.disk_bytes, 1.46 * GIB, 0.02)  # the spec table's 1.46 GiB


def kimi_k25_by_hand() -> dict[str, int]:
    h, layers, vocab = 7168, 61, 163840
    heads, q_lora, kv_lora, nope, rope, v = 64, 1536, 512, 128, 64, 128
    attn = (h * q_lora + q_lora * heads * (nope + rope)            # q_a_proj, q_b_proj
            + h * (kv_lora + rope) + kv_lora * heads * (nope + v)  # kv_a_proj_with_mqa, kv_b_proj
            + heads * v * h)                                       # o_proj
    attn_norms = q_lora + kv_lora                                  # q_a_layernorm, kv_a_layernorm
    dense = 3 * h * 18432                                          # layer 0 (first_k_dense_replace 1)
    experts, moe_inter = 384, 2048
    routed = experts * 3 * moe_inter * h
    shared = 3 * h * moe_inter                                     # n_shared_experts 1
    router = experts * h + experts                                 # weight + e_score_correction_bias
    return {"routed": 60 * routed, "routed_matrices": 60 * experts * 3,
            "rest": 2 * vocab * h + layers * (attn + attn_norms + 2 * h) + dense + 60 * (shared + router) + h}


def test_kimi_k25_text_model_by_hand():
    c = cfg("moonshotai__Kimi-K2.5")
    hand = kimi_k25_by_hand()
    est = target_weight_bytes(c)
    assert est.total_params == hand["routed"] + hand["rest"] == 1_026_408_232_448  # "1T"
    # on disk: the routed experts in int4 groups of 32 (compressed-tensors pack-quantized: 4 bits a weight, a
    # bf16 scale per group, an int32 pair giving each matrix's shape); everything the ignore list names bf16
    scales = 60 * 384 * (2 * 2048 * (7168 // 32) + 7168 * (2048 // 32)) * 2
    assert est.disk_bytes == hand["routed"] // 2 + scales + 8 * hand["routed_matrices"] + 2 * hand["rest"]
    assert 550 * GIB < est.disk_bytes < 554.3 * GIB  # a spec table: 554.30 GiB with the vision tower
    assert est.disk_format.startswith("int4")
    # multi-head latent attention caches the latent: kv_lora_rank + qk_rope_head_dim values a row and layer
    assert kv_cache_bytes(c, 1000) == 61 * (512 + 64) * 2 * 1000
    # transformers refuses bitsandbytes on a quantized checkpoint: auto never picks it, nor do the knobs
    assert choose_quant(c, None, context_tokens=8192, available_bytes=80 * GIB) is None
    plan = plan_memory(c, None, quant="auto", context_tokens=8192, available_bytes=80 * GIB)
    assert plan.quant == "bf16" and not plan.fits
    assert not any("--quant" in a.text for a in plan.alternatives)


def glm_51_by_hand() -> dict[str, int]:
    h, layers, vocab = 6144, 78, 154880
    heads, q_lora, kv_lora, nope, rope, v = 64, 2048, 512, 192, 64, 256
    attn = (h * q_lora + q_lora * heads * (nope + rope) + h * (kv_lora + rope) + kv_lora * heads * (nope + v)
            + heads * v * h)
    indexer = q_lora * 32 * 128 + h * 128 + h * 32 + 2 * 128     # wq_b, wk, weights_proj, k_norm (LayerNorm)
    norms = q_lora + kv_lora + 2 * h
    dense = 3 * h * 12288                                         # layers 0-2 (first_k_dense_replace 3)
    routed = 256 * 3 * 2048 * h
    moe_rest = 3 * h * 2048 + 256 * h + 256                       # shared expert, router weight and bias
    return {"routed": 75 * routed, "rest": 2 * vocab * h + layers * (attn + indexer + norms) + 3 * dense
            + 75 * moe_rest + h}


def test_glm_51_by_hand():
    c = cfg("zai-org__GLM-5.1")
    hand = glm_51_by_hand()
    est = target_weight_bytes(c)
    assert est.total_params == hand["routed"] + hand["rest"] == 743_911_218_432  # "744B"
    assert est.disk_bytes == 2 * est.total_params  # this file is the bf16 release
    assert any("multi-token-prediction" in n for n in est.notes)  # layer 78 is on disk, not loaded: not counted
    # the latent (512 + 64) and every layer's indexer key (128; index_topk_freq 1: all layers run one)
    assert kv_cache_bytes(c, 1000) == 78 * (512 + 64 + 128) * 2 * 1000
    # the FP8 release (the drafter's target): the same file plus a block-wise fp8 quantization_config
    fp8 = dict(c, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    est8 = target_weight_bytes(fp8)
    quantized = est.params["layers_linear"] + est.params["experts"]
    assert est8.total_params == est.total_params
    assert quantized < est8.disk_bytes - 2 * (est.total_params - quantized) < 1.001 * quantized  # + fp32 scales
    assert 690 * GIB < est8.disk_bytes < 700 * GIB


def test_a_giant_needs_a_server_and_the_estimate_says_how_many_gpus():
    est = P.server_estimate(cfg("moonshotai__Kimi-K2.5"), None, context_tokens=8192)
    assert est.target_bytes == target_weight_bytes(cfg("moonshotai__Kimi-K2.5")).disk_bytes
    assert est.kv_bytes == kv_cache_bytes(cfg("moonshotai__Kimi-K2.5"), 8192) and est.drafter_bytes is None
    assert dict(est.gpus) == {80 * GIB: math.ceil(est.total / (0.9 * 80 * GIB)), 141 * GIB: 5}
    assert dict(est.gpus)[80 * GIB] == 8
    lines = P.format_server(est, "kimi-k2.5", 8)
    assert lines[0].startswith("needs a multi-GPU server: weights 553.4 GiB as published (int4")
    assert "at least 8 x 80 GiB or 5 x 141 GiB GPUs" in lines[0]
    assert "dflash-cli serve-cmd kimi-k2.5 --engine vllm --tp 8 (or --engine sglang)" in lines[1]
    assert "--engine http://SERVER:8000 -m kimi-k2.5" in lines[2]
    assert P.format_server(None, "glm-5.1")[0] == "needs a multi-GPU server (its config.json gives the numbers)"


def gemma4_config(name: str) -> dict:
    """The stored Gemma 4 config; the 31B stand-in without its NVFP4 block (SOURCES.md: the google file is
    expected to be this one minus `quantization_config`)."""
    c = cfg(name)
    c.pop("quantization_config", None)
    return c


def test_gemma_4_26b_a4b_by_hand():
    c = gemma4_config("google__gemma-4-26B-A4B-it")
    h, heads, vocab = 2816, 16, 262144
    sliding = h * heads * 256 + 2 * h * 8 * 256 + heads * 256 * h + 2 * 256  # q, k, v, o; q_norm, k_norm
    full = h * heads * 512 + h * 2 * 512 + heads * 512 * h + 2 * 512  # attention_k_eq_v: no v_proj, 2 KV heads
    mlp = 3 * h * 2112
    moe = h * 128 + h + 128 + 3 * h + 128 * 3 * 704 * h  # router proj, scale, per-expert scale; 3 norms; experts
    per_layer = mlp + moe + 4 * h + 1  # four norms and layer_scalar
    total = vocab * h + 25 * sliding + 5 * full + 30 * per_layer + h  # tied embeddings
    assert target_weight_bytes(c).total_params == total == 25_233_141_790  # "25.2B" (text)
    # sliding layers: 8 KV heads x 256, at most window + 2 x 512 rows (the fast path's ring); full layers:
    # 2 KV heads x 512, every row
    assert kv_cache_bytes(c, 4096) == 25 * 2 * 8 * 256 * (1024 + 1024) * 2 + 5 * 2 * 2 * 512 * 4096 * 2


def test_gemma_4_31b_by_hand():
    c = gemma4_config("nvidia__Gemma-4-31B-IT-NVFP4")
    h, heads, vocab = 5376, 32, 262144
    sliding = h * heads * 256 + 2 * h * 16 * 256 + heads * 256 * h + 2 * 256
    full = h * heads * 512 + h * 4 * 512 + heads * 512 * h + 2 * 512
    per_layer = 3 * h * 21504 + 4 * h + 1
    total = vocab * h + 50 * sliding + 10 * full + 60 * per_layer + h
    assert target_weight_bytes(c).total_params == total == 30_697_345_340  # "30.7B"
    assert kv_cache_bytes(c, 1000) == 50 * 2 * 16 * 256 * 1000 * 2 + 10 * 2 * 4 * 512 * 1000 * 2
    # the stand-in as stored says NVFP4: its size is then flagged approximate
    assert target_weight_bytes(cfg("nvidia__Gemma-4-31B-IT-NVFP4")).approximate


# Qwen/Qwen3-Coder-Next: QWEN3_CODER_NEXT (support/hf_configs.py) holds the fields SOURCES.md lists.
def test_qwen3_next_layers_follow_the_interval_and_its_attention_is_gated():
    from dflash_cli.models.memory.params import count_target, target_layer_kinds

    kinds = target_layer_kinds(QWEN3_CODER_NEXT)
    assert kinds.count("full_attention") == 12 and kinds[3::4] == ["full_attention"] * 12
    c = count_target(QWEN3_CODER_NEXT)
    q_projs = [lin for lin in c.linears if lin.role == "attn" and lin.inp == 2048 and lin.count == 1]
    assert q_projs[0].out == 16 * 256 * 2  # q and its output gate
    est = target_weight_bytes(QWEN3_CODER_NEXT)
    assert 79e9 < est.total_params < 81e9  # "80B total"
    # 12 attention layers (2 KV heads x 256) plus 36 Gated DeltaNet states that do not grow
    grows = kv_cache_bytes(QWEN3_CODER_NEXT, 2000) - kv_cache_bytes(QWEN3_CODER_NEXT, 1000)
    assert grows == 12 * 2 * 2 * 256 * 1000 * 2


@pytest.mark.parametrize(("capability", "triton", "kernels"), [
    ((9, 0), True, True), ((9, 0), False, True), ((9, 0), True, False), ((7, 0), True, True), ((7, 5), True, True),
])
def test_mxfp4_kept_agrees_with_transformers_own_decision(monkeypatch, capability, triton, kernels):
    """models/memory/preflight.mxfp4_kept against transformers 5.24's Mxfp4HfQuantizer on a (simulated) CUDA GPU:
    the experts stay packed exactly when transformers does not set `dequantize`."""
    import torch
    import transformers.quantizers.quantizer_mxfp4 as quantizer_module
    import transformers.utils.import_utils as import_utils
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer
    from transformers.utils.quantization_config import Mxfp4Config

    from dflash_cli.models.memory.preflight import mxfp4_kept

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(quantizer_module, "get_current_accelerator", lambda: torch.device("cuda"))
    for module in (quantizer_module, import_utils):
        monkeypatch.setattr(module, "is_triton_available", lambda *_: triton)
        monkeypatch.setattr(module, "is_kernels_available", lambda *_: kernels)
    theirs = Mxfp4HfQuantizer(Mxfp4Config(), pre_quantized=True)
    theirs.validate_environment()
    kept, why = mxfp4_kept("cuda:0")
    assert kept == (not theirs.quantization_config.dequantize)
    assert ("triton 3.4 or later is not installed" in why) == (not triton and capability >= (7, 5))


def test_mxfp4_is_dequantized_on_a_cpu():
    from dflash_cli.models.memory.preflight import mxfp4_kept

    assert mxfp4_kept("cpu") == (False, "transformers dequantizes them on cpu")


def test_the_preflight_counts_fp32_caches_where_the_target_runs_fp32_activations(monkeypatch):
    """q4a8/q8a8 targets and fp32 models cache 4 bytes a value (the planner used to count 2 everywhere): a
    budget between the two totals is refused for q4a8 and in fp32, one above fits; DFLASH_KV_CACHE=f16 (the C
    layers' fp16 caches) plans 2 bytes again for q4a8 on a CPU."""
    from dflash_cli.engine.dtypes import KV_CACHE_ENV
    from dflash_cli.models.memory.preflight import MemoryBudget, MemoryPlanError, preflight_memory

    monkeypatch.delenv(KV_CACHE_ENV, raising=False)
    smol, context = cfg("HuggingFaceTB__SmolLM2-135M-Instruct"), 65536
    for planned in ("q4a8", "none"):  # "none" in the budget's dtype, fp32
        two, four = (plan_memory(smol, None, quant="fp32" if planned == "none" else planned, context_tokens=context,
                                 available_bytes=0, kv_dtype_bytes=size).total for size in (2, 4))
        held = kv_cache_bytes(smol, context + 1, 4)  # (one row for a block: no drafter)
        assert four - two == held / 2 > GIB
        budget = MemoryBudget((two + four) // 2, context, "fp32", "system memory", "cpu")
        with pytest.raises(MemoryPlanError, match=rf"KV caches {held / GIB:.1f} "):
            preflight_memory(smol, None, planned, budget, "smol")
        roomy = MemoryBudget(four + 2**20, context, "fp32", "system memory", "cpu")
        assert preflight_memory(smol, None, planned, roomy, "smol") == planned
    monkeypatch.setenv(KV_CACHE_ENV, "f16")
    two = plan_memory(smol, None, quant="q4a8", context_tokens=context, available_bytes=0).total
    assert preflight_memory(smol, None, "q4a8", MemoryBudget(two + 2**20, context, "fp32", "system memory", "cpu"),
                            "smol") == "q4a8"
