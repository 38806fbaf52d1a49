"""Bytes for the memory planner: weights per quantization, on disk, KV caches and working memory, counted
from `config.json` dicts only (the parameters they count: models/memory/params.py).

Used before any weights are downloaded, so it is pure arithmetic: no torch, no transformers.

What is counted
---------------
On disk (``disk_bytes``): the checkpoint's own format: 16/32-bit, or its ``quantization_config``:
gpt-oss's MXFP4 experts, compressed-tensors integer groups (Kimi K2.5's int4 experts; the ``ignore``
patterns keep the rest 16-bit), block-wise fp8 (GLM-5.1-FP8). In memory a checkpoint published quantized
counts dequantized to the compute dtype, except MXFP4 with ``mxfp4_packed`` (transformers keeps it packed
on a CUDA GPU with its kernels: models/memory/preflight.mxfp4_kept); bitsandbytes cannot apply on top of such a
checkpoint (transformers refuses), so the planner never offers it.

Bytes per quantization (``quant``):

* ``bf16`` / ``fp16`` (``none`` is an alias of bf16): 2 bytes per parameter; ``fp32``: 4.
* ``int8`` (bitsandbytes LLM.int8()): every ``nn.Linear`` inside the decoder layers stores 1 byte per
  weight plus one fp32 scale per output row; biases stay 16-bit.
* ``nf4`` (bitsandbytes 4-bit): 0.5 byte per weight plus one absmax per 64-weight block, fp32
  (4 bytes, this project's setting: ``bnb_4bit_use_double_quant=False``) or, with double quantization,
  1 byte per block plus one fp32 per 256 blocks.
* ``q4`` / ``q8`` (CPU weight-only kernels): the 16-bit weights as loaded plus the codes (q4: 0.5 byte per
  weight and a bf16 scale and zero per 32; q8: 1 byte per weight and a bf16 scale per row), and an 8-bit
  copy of the LM head (of the embedding when tied). MoE experts count 16-bit: the fast path replaces them by
  4/8-bit experts and frees the 16-bit tensors (engine/moe.py), but only after loading held them at 16 bits
  (a checkpoint of one tensor per expert is merged into new fused tensors), and the memory check needs that
  peak; a note gives their size once loaded.
* Under int8/nf4 the embeddings, ``lm_head``, norms, routers and other plain parameters stay 16-bit.
  So do *fused* MoE expert tensors: transformers 5 stores them as 3-D ``nn.Parameter``s, not
  ``nn.Linear``, and bitsandbytes only replaces ``nn.Linear`` modules.
* Drafters: only the linears of the draft layers are quantized (``engine.load.load_drafter``);
  ``fc`` and the norms stay 16-bit. A drafter has no embeddings and no LM head (it borrows the target's).

KV caches (``kv_cache_bytes``): ``2 (K and V) * kv_heads * head_dim * rows * dtype_bytes`` per
attention layer; the target's sliding-window layers keep at most ``sliding_window`` rows; gated-DeltaNet
layers keep a fixed recurrent state; latent attention keeps ``kv_lora_rank + qk_rope_head_dim`` values a
row (+ GLM-5's indexer keys). The drafter's context cache (``engine.drafter.DraftCache``) keeps
every committed row in every layer (the window is applied by the mask, not by trimming), so it is not capped.

Activations / working margin (``activation_bytes``), a deliberately simple rule:

* logits: ``2 * block_size * vocab * 4`` (target verification and drafter proposals, fp32);
* prefill working set: the fast path reads a prompt in pieces of ``PREFILL_CHUNK`` tokens (engine/hf_config.py),
  so per piece ``piece * (3 * intermediate + 4 * hidden) * 2`` (one layer's MLP intermediates,
  residual/q/k/v copies) plus its attention mask and the bias a fused kernel makes of it,
  ``heads / kv_heads * piece * context_tokens * 3``; and for the whole prompt the tapped hidden states
  handed to the drafter, ``context_tokens * n_taps * hidden * 2``;
* 10% of all weight bytes (allocator fragmentation, temporary buffers, dequantization scratch);
* 0.5 GiB for the CUDA context.

Approximate, on purpose: the activation rule above; gpt-oss (its checkpoint is MXFP4: the on-disk size
is reported separately from the in-memory size, packed or dequantized as transformers will load it);
other quantized checkpoints (counted dequantized in memory: an upper bound);
Qwen3.5 hybrids (text model only, vision tower and MTP head not counted); allocator rounding;
the drafter cache grows by doubling, so its real allocation can reach up to twice the estimate.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from dflash_cli.engine.hf_config import PREFILL_CHUNK, drafter_tap_count, text_config
from dflash_cli.models.memory.params import (
    Counts,
    Linear,
    checkpoint_quantization,
    count_drafter,
    count_target,
    gemma4_kv_shape,
    head_dim,
    is_gemma4,
    is_mla,
    mla_indexer_layers,
    prequantized,
    target_layer_kinds,
)

GIB = 1024**3
CUDA_CONTEXT_BYTES = GIB // 2
WEIGHT_MARGIN = 0.10
NF4_BLOCK = 64
NF4_DOUBLE_QUANT_GROUP = 256
MXFP4_BLOCK = 32  # one uint8 scale per 32 fp4 values
Q4_GROUP = 32  # q4: a bf16 scale and zero per 32 weights

QUANT_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "none": "bf16", "fp16": "fp16", "float16": "fp16",
                 "fp32": "fp32", "float32": "fp32", "int8": "int8", "nf4": "nf4",
                 "q4": "q4", "q8": "q8", "q4a8": "q4a8", "q8a8": "q8a8"}
#: `--quant auto` order: best quality first
AUTO_ORDER = ("bf16", "int8", "nf4")

LINEAR_STATE_COPIES = 3  # per linear-attention layer: two buffers to roll back, one checkpoint


def normalize_quant(quant: str | None) -> str:
    key = "bf16" if quant is None else str(quant).lower()
    if key not in QUANT_ALIASES:
        raise ValueError(f"unknown quantization {quant!r}: use bf16, fp16, fp32, int8, nf4, q4, q8, q4a8 or q8a8")
    return QUANT_ALIASES[key]


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB"


# ---------------------------------------------------------------------------------------------------
# bytes


def _plain_bytes(quant: str) -> int:
    """Bytes per parameter of what bitsandbytes does not quantize (the compute dtype)."""
    return 4 if quant in ("fp32", "q4a8", "q8a8") else 2


def _linear_bytes(lin: Linear, quant: str, double_quant: bool, dense_held: bool = True) -> int:
    """Bytes of one kind of linear under `quant`; `dense_held` False: the codes alone (a target quantized layer
    by layer as it loads never holds its full-precision linears beside them)."""
    per = lin.inp * lin.out
    held = 1 if dense_held else 0
    bias = lin.biases * _plain_bytes(quant)
    if quant in ("bf16", "fp16"):
        w = 2 * per
    elif quant == "fp32":
        w = 4 * per
    elif quant == "int8":
        w = per + 4 * lin.out  # int8 weights + fp32 row scales (SCB)
    elif quant in ("q4", "q8"):
        # weight-only CPU kernels (engine/cpu/weightonly.py): the 16-bit weights loaded stay beside the codes
        codes = math.ceil(per / 2) + 4 * math.ceil(per / Q4_GROUP) if quant == "q4" else per + 2 * lin.out
        w = held * 2 * per + codes
    elif quant in ("q4a8", "q8a8"):
        # 8-bit-activation kernels (engine/cpu/int8act.py): fp32 weights as loaded plus the codes, with fp32 d
        # (and q4's m) per block of 32
        blocks = math.ceil(per / Q4_GROUP)
        codes = math.ceil(per / 2) + 8 * blocks if quant == "q4a8" else per + 4 * blocks
        w = held * 4 * per + codes
    elif quant == "nf4":
        blocks = math.ceil(per / NF4_BLOCK)
        absmax = (blocks + 4 * math.ceil(blocks / NF4_DOUBLE_QUANT_GROUP) + 4) if double_quant else 4 * blocks
        w = math.ceil(per / 2) + absmax
    else:  # pragma: no cover - normalize_quant guards this
        raise ValueError(quant)
    return w * lin.count + bias


def _expert_code_bytes(mats: list[tuple[int, int, int]], quant: str) -> int:
    """Fused experts (matrices, rows, columns) as the fast path's q4/q8 experts hold them (engine/moe.py):
    q8 an int8 code per weight and a bf16 scale per row; q4 half a byte per weight and a bf16 scale and zero
    per group of 32, when every matrix takes q4 (the engine's rule), else as q8."""
    if quant in ("q8", "q8a8"):
        return sum(m * rows * cols + 2 * m * rows for m, rows, cols in mats)
    if any(cols % Q4_GROUP or rows % 16 for _, rows, cols in mats):  # q4 cannot take them: the engine uses q8
        return _expert_code_bytes(mats, "q8")
    return sum(m * rows * cols // 2 + 4 * (m * rows * cols // Q4_GROUP) for m, rows, cols in mats)


# Dense targets that load one decoder layer at a time under q4/q8/q4a8/q8a8 (engine/layerwise.py; its
# fast_layers.FAMILIES): their full-precision linears never sit beside the codes, one layer's at most.
LAYERWISE_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def _loads_by_layer(config: dict[str, Any], quant: str) -> bool:
    return (quant in ("q4", "q8", "q4a8", "q8a8") and text_config(config).get("model_type") in LAYERWISE_TYPES
            and prequantized(config) is None)


# MoE model types whose experts the q4/q8 fast path turns into 4/8-bit ones (engine/moe.py, engine/fast.py)
WEIGHT_ONLY_MOE_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "gemma4", "gemma4_text")


def _weight_only_experts_note(c: Counts, config: dict[str, Any], quant: str) -> str:
    """Why the experts count 16-bit under q4/q8: loading holds them so (a checkpoint of one tensor per expert is
    merged into new fused tensors; a fused one is read from the file's pages) before the fast path quantizes
    them, so the peak, which the memory check needs, is the 16-bit one."""
    if text_config(config).get("model_type") not in WEIGHT_ONLY_MOE_TYPES:
        return f"experts stay 16-bit under {quant} (the fast path quantizes those of Qwen3-MoE, Qwen3.5-MoE, " \
               "Qwen3-Next and Gemma 4 only)"
    codes = _expert_code_bytes(c.expert_mats, quant)
    return f"experts counted 16-bit, as loading holds them; {quant} keeps them in {codes / 2**30:.1f} GiB once loaded"


@dataclass(frozen=True)
class WeightEstimate:
    """Weight bytes of one model under one quantization, by component.

    `components` (bytes) for targets: embeddings, lm_head, layers_linear (the nn.Linear weights inside
    decoder layers, with their biases and quantization scales), experts (fused MoE tensors; 0 for dense
    models), norms_other (norms, routers, sinks, ...). For drafters: fc, layers_linear, norms_other.
    `disk_bytes` is the size of the tensors in the published checkpoint (safetensors header not counted).
    """

    quant: str
    components: dict[str, int]
    params: dict[str, int]
    disk_bytes: int
    disk_format: str
    approximate: bool = False
    notes: tuple[str, ...] = ()
    mxfp4: str | None = None  # an MXFP4 checkpoint's experts in memory: "packed" or "dequantized"

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def total_params(self) -> int:
        return sum(self.params.values())

    @property
    def embeddings(self) -> int:
        return self.components.get("embeddings", 0)

    @property
    def lm_head(self) -> int:
        return self.components.get("lm_head", 0)

    @property
    def layers_linear(self) -> int:
        return self.components.get("layers_linear", 0)

    @property
    def experts(self) -> int:
        return self.components.get("experts", 0)

    @property
    def norms_other(self) -> int:
        return self.components.get("norms_other", 0)

    @property
    def fc(self) -> int:
        return self.components.get("fc", 0)


def _checkpoint_dtype_bytes(config: dict[str, Any]) -> int:
    dtype = str(text_config(config).get("torch_dtype") or text_config(config).get("dtype")
                or config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 4 if "32" in dtype else 2


def _pattern_matches(pattern: str, name: str) -> bool:
    """compressed-tensors' `ignore` entries: "re:REGEX" against a module name, else a name or a suffix."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


# a module name of each role, for compressed-tensors' `ignore` patterns
_ROLE_NAMES = {"attn": "model.layers.1.self_attn.q_proj", "mlp": "model.layers.0.mlp.gate_proj",
               "shared": "model.layers.1.mlp.shared_experts.gate_proj",
               "linear_attn": "model.layers.0.linear_attn.in_proj_qkv", "other": "model.layers.1.mlp.gate",
               "experts": "model.layers.1.mlp.experts.0.gate_proj", "lm_head": "lm_head"}


def _disk_bytes(c: Counts, config: dict[str, Any], params: dict[str, int]) -> tuple[int, str]:
    """(bytes of the published tensors, a word on their format): 16/32-bit, or the checkpoint's own
    quantization: MXFP4 experts (gpt-oss), compressed-tensors integer groups (Kimi K2.5's int4 experts:
    packed codes plus a 16-bit scale per group; the `ignore` patterns keep the rest 16-bit), block-wise fp8
    (one byte a weight plus an fp32 scale per block)."""
    disk_dt = _checkpoint_dtype_bytes(config)
    total = sum(params.values())
    qc = checkpoint_quantization(config)
    method = qc.get("quant_method")
    if c.mxfp4_experts:
        mx = c.experts // 2 + c.experts // MXFP4_BLOCK  # fp4 pairs in uint8 blocks + one uint8 scale per 32
        return mx + (total - c.experts) * disk_dt, "MXFP4 experts + bf16 rest"
    if method == "compressed-tensors":
        groups = [g for g in (qc.get("config_groups") or {}).values()
                  if isinstance(g, dict) and "Linear" in (g.get("targets") or [])]
        weights = (groups[0].get("weights") or {}) if groups else {}
        if weights.get("type", "int") == "int" and weights.get("num_bits") and weights.get("group_size"):
            bits, group = int(weights["num_bits"]), int(weights["group_size"])
            zero = 0 if weights.get("symmetric", True) else 1
            ignore = [str(p) for p in qc.get("ignore") or []]
            kept = lambda role: any(_pattern_matches(p, _ROLE_NAMES[role]) for p in ignore)  # noqa: E731
            mats = [(m, r, k) for m, r, k in c.expert_mats] if not kept("experts") else []
            mats += [(lin.count, lin.out, lin.inp) for lin in c.linears if not kept(lin.role)]
            if c.lm_head and not kept("lm_head"):
                vocab = int(text_config(config)["vocab_size"])
                mats.append((1, vocab, c.lm_head // vocab))
            quantized = sum(m * r * k for m, r, k in mats)
            per_group = 2 + zero * 2  # a 16-bit scale (and zero point) per group
            packed = sum(m * (r * k * bits // 8 + r * math.ceil(k / group) * per_group + 8) for m, r, k in mats)
            return packed + (total - quantized) * disk_dt, f"int{bits} groups of {group} + 16-bit rest"
    if method == "fp8":
        block = qc.get("weight_block_size") or []
        mats = list(c.expert_mats) + [(lin.count, lin.out, lin.inp) for lin in c.linears]
        quantized = sum(m * r * k for m, r, k in mats)
        if len(block) == 2:
            scales = sum(m * math.ceil(r / block[0]) * math.ceil(k / block[1]) for m, r, k in mats)
        else:
            scales = sum(m for m, _, _ in mats)
        return quantized + 4 * scales + (total - quantized) * disk_dt, "fp8 linears + 16-bit rest"
    return total * disk_dt, "fp32" if disk_dt == 4 else "bf16/fp16"


def _estimate(c: Counts, config: dict[str, Any], quant: str, double_quant: bool, drafter: bool,
              mxfp4_packed: bool = False) -> WeightEstimate:
    quant = normalize_quant(quant)
    plain = _plain_bytes(quant)
    linear_w = sum(lin.weights for lin in c.linears)
    linear_b = sum(lin.biases for lin in c.linears)
    notes = list(c.notes)
    if not drafter and _loads_by_layer(config, quant):
        layers = max(int(text_config(config).get("num_hidden_layers") or 1), 1)
        one_layer = sum(lin.weights * plain for lin in c.linears) // layers  # read, quantized, then freed
        linear_bytes = sum(_linear_bytes(lin, quant, double_quant, dense_held=False) for lin in c.linears)
        linear_bytes += one_layer
        notes.append(f"{quant} loads layer by layer: the codes and one layer's {8 * plain}-bit linears "
                     f"({one_layer / 2**20:.0f} MiB) at most")
    else:
        linear_bytes = sum(_linear_bytes(lin, quant, double_quant) for lin in c.linears)
    mxfp4 = None
    if drafter:
        components = {"fc": c.fc * plain, "layers_linear": linear_bytes, "norms_other": c.norms_other * plain}
        params = {"fc": c.fc, "layers_linear": linear_w + linear_b, "norms_other": c.norms_other}
    else:
        # q4/q8: the fast path also keeps an 8-bit copy of the LM head (the tied embedding's, if tied)
        head_codes = (c.lm_head or c.embeddings) if quant in ("q4", "q8", "q4a8", "q8a8") else 0
        experts = (c.experts + c.expert_biases) * plain
        if quant in ("q4", "q8", "q4a8", "q8a8") and c.experts and not c.mxfp4_experts:
            notes.append(_weight_only_experts_note(c, config, quant))
        if c.mxfp4_experts and mxfp4_packed:
            # transformers' Mxfp4GptOssExperts: uint8 blocks (two fp4 a byte), a uint8 scale per 32, fp32 biases
            experts = c.experts // 2 + c.experts // MXFP4_BLOCK + 4 * c.expert_biases
            mxfp4 = "packed"
            notes.append("MXFP4 experts kept as published (transformers' triton kernels)")
        elif c.mxfp4_experts:
            mxfp4 = "dequantized"
            notes.append(f"MXFP4 experts dequantized to {quant} in memory (transformers does so without its "
                         "MXFP4 kernels: on a CPU, or without triton and kernels)")
        elif prequantized(config) and quant in ("bf16", "fp16", "fp32"):
            notes.append(f"checkpoint published in {prequantized(config)}: counted dequantized to {quant} in memory "
                         "(an upper bound: how transformers loads it is not modelled)")
        components = {"embeddings": c.embeddings * plain, "lm_head": c.lm_head * plain + head_codes,
                      "layers_linear": linear_bytes, "experts": experts,
                      "norms_other": c.norms_other * plain}
        params = {"embeddings": c.embeddings, "lm_head": c.lm_head, "layers_linear": linear_w + linear_b,
                  "experts": c.experts + c.expert_biases, "norms_other": c.norms_other}
    disk, disk_format = _disk_bytes(c, config, params)
    approximate = c.approximate or (not drafter and prequantized(config) not in (None, "mxfp4"))
    return WeightEstimate(quant=quant, components=components, params=params, disk_bytes=disk,
                          disk_format=disk_format, approximate=approximate, notes=tuple(notes), mxfp4=mxfp4)


def target_weight_bytes(config: dict[str, Any], quant: str = "bf16", *, double_quant: bool = False,
                        mxfp4_packed: bool = False) -> WeightEstimate:
    """Weight bytes of a target model loaded with `quant` (bf16, fp16, fp32, int8, nf4, q4, q8).

    `mxfp4_packed`: an MXFP4 checkpoint (gpt-oss) keeps its experts packed, as transformers does on a CUDA
    GPU with its MXFP4 kernels (models/memory/preflight.mxfp4_kept decides); otherwise they count dequantized."""
    return _estimate(count_target(config), config, quant, double_quant, drafter=False, mxfp4_packed=mxfp4_packed)


def drafter_weight_bytes(drafter_config: dict[str, Any], quant: str = "bf16", *,
                         double_quant: bool = False) -> WeightEstimate:
    """Weight bytes of a DFlash drafter; `quant` applies to the draft layers' linears only, like the loader."""
    return _estimate(count_drafter(drafter_config), drafter_config, quant, double_quant, drafter=True)


def head_shortlist_bytes(target_config: dict[str, Any]) -> int:
    """The 4-bit copy of the target's LM head (codes, and an fp16 scale and minimum per 32: 5/8 of a byte a
    weight) that greedy drafts beside a q4a8/q8a8 target read first (engine/cpu/int8act.ShortlistHead): the whole
    head's, an upper bound for a drafter with a draft vocabulary, whose copy holds that vocabulary's rows."""
    tc = text_config(target_config)
    return int(tc.get("vocab_size") or 0) * int(tc.get("hidden_size") or 0) * 5 // 8


# ---------------------------------------------------------------------------------------------------
# KV caches


def cache_value_bytes(quant: str, dtype: str, half_caches: bool = False) -> int:
    """Bytes of one cached key or value element for a target planned in `quant` ("none" reads `dtype`: bf16, fp16
    or fp32): the caches hold the activations' dtype, fp32 around q4a8/q8a8's 8-bit activations and in an fp32
    model, 16-bit otherwise (q4/q8 always run bf16 activations). `half_caches`: the C layers' fp16 caches
    (DFLASH_KV_CACHE=f16, engine/fast.py), which only a q4a8/q8a8 target on a CPU runs."""
    if quant in ("q4a8", "q8a8"):
        return 2 if half_caches else 4
    return 4 if dtype == "fp32" and quant in ("none", "fp32", "int8", "nf4") else 2


def kv_cache_bytes(config: dict[str, Any], context_tokens: int, dtype_bytes: int = 2, *,
                   cap_sliding: bool = True) -> int:
    """K+V bytes for `context_tokens` rows: 2 * kv_heads * head_dim * rows * dtype_bytes per attention layer.

    Sliding-window layers hold at most `sliding_window` rows when `cap_sliding`; gated-DeltaNet layers
    hold a fixed state (fp32 recurrent state + conv state) whatever the length, three times over in the
    engine: two buffers for rolling back exactly and a checkpoint for regenerating (static_cache.LinearStates).
    Multi-head latent attention (DeepSeek-V3, Kimi K2, GLM-5) caches the compressed latent, not K and V:
    `kv_lora_rank + qk_rope_head_dim` values a row and layer (transformers 5 caches it so), plus GLM-5's
    indexer keys (`index_head_dim`) in the layers that run an indexer. Gemma 4's full layers cache their
    global shape (`global_head_dim`, `num_global_key_value_heads`); its KV-shared layers cache nothing.
    """
    cfg = text_config(config)
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = head_dim(cfg)
    window = cfg.get("sliding_window")
    kinds = target_layer_kinds(cfg)
    if is_mla(cfg):
        latent = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
        index = int(cfg.get("index_head_dim") or 0)
        return sum((latent + (index if own else 0)) * context_tokens * dtype_bytes
                   for own in mla_indexer_layers(cfg))
    gemma4 = is_gemma4(cfg)
    shared_from = len(kinds) - int(cfg.get("num_kv_shared_layers") or 0) if gemma4 else len(kinds)
    total = 0
    for i, kind in enumerate(kinds):
        if kind == "linear_attention":
            nk, dk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
            nv, dv = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
            conv_dim = 2 * nk * dk + nv * dv
            state = nv * dk * dv * 4 + conv_dim * (int(cfg.get("linear_conv_kernel_dim", 4)) - 1) * dtype_bytes
            total += LINEAR_STATE_COPIES * state
            continue
        if i >= shared_from:
            continue  # Gemma 4: reads the KV of an earlier layer
        rows = context_tokens
        if kind == "sliding_attention" and cap_sliding and window:
            # transformers' cache keeps the window; the fast path (Gemma 4) a ring of window + 2 pieces
            rows = min(rows, int(window) + (2 * PREFILL_CHUNK if gemma4 else 0))
        layer_dim, layer_kv = gemma4_kv_shape(cfg, kind == "full_attention") if gemma4 else (hd, nkv)
        total += 2 * layer_kv * layer_dim * rows * dtype_bytes
    return total


def drafter_kv_cache_bytes(drafter_config: dict[str, Any], context_tokens: int, dtype_bytes: int = 2) -> int:
    """The drafter's context cache: every draft layer keeps every row (DraftCache does not trim windows)."""
    return kv_cache_bytes(drafter_config, context_tokens, dtype_bytes, cap_sliding=False)


# ---------------------------------------------------------------------------------------------------
# plans


def activation_bytes(target_config: dict[str, Any], drafter_config: dict[str, Any] | None, *,
                     context_tokens: int, block_size: int, weight_bytes: int) -> dict[str, int]:
    """The working-memory rule documented in the module docstring, by part."""
    cfg = text_config(target_config)
    h, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    inter = int(cfg.get("intermediate_size") or 4 * h)
    n_taps = drafter_tap_count(drafter_config) if drafter_config is not None else 0
    piece = min(context_tokens, PREFILL_CHUNK)
    group = int(cfg["num_attention_heads"]) // int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    return {
        "logits": 2 * block_size * vocab * 4,
        "prefill": (piece * (3 * inter + 4 * h) * 2 + group * piece * context_tokens * 3
                    + context_tokens * n_taps * h * 2),
        "margin": int(WEIGHT_MARGIN * weight_bytes),
        "cuda_context": CUDA_CONTEXT_BYTES,
    }
