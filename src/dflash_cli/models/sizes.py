"""Sizes for the memory planner: parameters, weight bytes per quantization, KV caches and working memory,
counted from `config.json` dicts only.

Used before any weights are downloaded, so it is pure arithmetic: no torch, no transformers.

What is counted
---------------
Parameters are counted per component from the config (the shapes transformers builds):

* embeddings ``vocab * hidden``; ``lm_head`` the same unless ``tie_word_embeddings``;
* per decoder layer: q/k/v/o projections (``head_dim``, ``num_key_value_heads``, ``attention_bias``;
  qwen2 has biases on q/k/v only), the MLP gate/up/down, two RMSNorms, plus q_norm/k_norm on qwen3-family
  models; MoE layers (qwen3_moe, gpt_oss): fused expert tensors ``E * 3 * moe_intermediate * hidden``
  (+ expert biases on gpt-oss), the router, shared experts if any; gpt-oss attention sinks;
  Qwen3.5 gated-DeltaNet ("linear_attention") layers;
* the final norm.

Bytes per quantization (``quant``):

* ``bf16`` / ``fp16`` (``none`` is an alias of bf16): 2 bytes per parameter; ``fp32``: 4.
* ``int8`` (bitsandbytes LLM.int8()): every ``nn.Linear`` inside the decoder layers stores 1 byte per
  weight plus one fp32 scale per output row; biases stay 16-bit.
* ``nf4`` (bitsandbytes 4-bit): 0.5 byte per weight plus one absmax per 64-weight block, fp32
  (4 bytes, this project's setting: ``bnb_4bit_use_double_quant=False``) or, with double quantization,
  1 byte per block plus one fp32 per 256 blocks.
* ``q4`` / ``q8`` (CPU weight-only kernels): the 16-bit weights as loaded plus the codes (q4: 0.5 byte per
  weight and a bf16 scale and zero per 32; q8: 1 byte per weight and a bf16 scale per row), and an 8-bit
  copy of the LM head (of the embedding when tied).
* Under int8/nf4 the embeddings, ``lm_head``, norms, routers and other plain parameters stay 16-bit.
  So do *fused* MoE expert tensors: transformers 5 stores them as 3-D ``nn.Parameter``s, not
  ``nn.Linear``, and bitsandbytes only replaces ``nn.Linear`` modules.
* Drafters: only the linears of the draft layers are quantized (``engine.load.load_drafter``);
  ``fc`` and the norms stay 16-bit. A drafter has no embeddings and no LM head (it borrows the target's).

KV caches (``kv_cache_bytes``): ``2 (K and V) * kv_heads * head_dim * rows * dtype_bytes`` per
attention layer; the target's sliding-window layers keep at most ``sliding_window`` rows; gated-DeltaNet
layers keep a fixed recurrent state. The drafter's context cache (``engine.drafter.DraftCache``) keeps
every committed row in every layer (the window is applied by the mask, not by trimming), so it is not capped.

Activations / working margin (``activation_bytes``), a deliberately simple rule:

* logits: ``2 * block_size * vocab * 4`` (target verification and drafter proposals, fp32);
* prefill working set: the fast path reads a prompt in pieces of ``PREFILL_CHUNK`` tokens (engine/config.py),
  so per piece ``piece * (3 * intermediate + 4 * hidden) * 2`` (one layer's MLP intermediates,
  residual/q/k/v copies) plus its attention mask and the bias a fused kernel makes of it,
  ``heads / kv_heads * piece * context_tokens * 3``; and for the whole prompt the tapped hidden states
  handed to the drafter, ``context_tokens * n_taps * hidden * 2``;
* 10% of all weight bytes (allocator fragmentation, temporary buffers, dequantization scratch);
* 0.5 GiB for the CUDA context.

Approximate, on purpose: the activation rule above; gpt-oss (its checkpoint is MXFP4: the on-disk size
is reported separately from the in-memory size, which assumes the experts are dequantized to bf16);
Qwen3.5 hybrids (text model only, vision tower and MTP head not counted); allocator rounding;
the drafter cache grows by doubling, so its real allocation can reach up to twice the estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dflash_cli.engine.config import PREFILL_CHUNK, drafter_tap_count, is_dflash2, layer_types, text_config

GIB = 1024**3
CUDA_CONTEXT_BYTES = GIB // 2
WEIGHT_MARGIN = 0.10
NF4_BLOCK = 64
NF4_DOUBLE_QUANT_GROUP = 256
MXFP4_BLOCK = 32  # one uint8 scale per 32 fp4 values
Q4_GROUP = 32  # q4: a bf16 scale and zero per 32 weights

QUANT_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "none": "bf16", "fp16": "fp16", "float16": "fp16",
                 "fp32": "fp32", "float32": "fp32", "int8": "int8", "nf4": "nf4",
                 "q4": "q4", "q8": "q8"}
#: `--quant auto` order: best quality first
AUTO_ORDER = ("bf16", "int8", "nf4")

_QWEN3_QK_NORM = {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                  "qwen3_5_moe_text"}
_RECURRENT = {"linear_attention", "mamba", "conv", "recurrent"}
LINEAR_STATE_COPIES = 3  # per linear-attention layer: two buffers to roll back, one checkpoint


def normalize_quant(quant: str | None) -> str:
    key = "bf16" if quant is None else str(quant).lower()
    if key not in QUANT_ALIASES:
        raise ValueError(f"unknown quantization {quant!r}: use bf16, fp16, fp32, int8, nf4, q4 or q8")
    return QUANT_ALIASES[key]


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB"


# ---------------------------------------------------------------------------------------------------
# parameter counting


@dataclass
class _Linear:
    inp: int
    out: int
    bias: bool
    count: int = 1

    @property
    def weights(self) -> int:
        return self.inp * self.out * self.count

    @property
    def biases(self) -> int:
        return self.out * self.count if self.bias else 0


@dataclass
class _Counts:
    embeddings: int = 0
    lm_head: int = 0
    linears: list[_Linear] = field(default_factory=list)  # nn.Linear inside decoder layers
    experts: int = 0  # fused expert weight tensors (3-D nn.Parameter)
    expert_biases: int = 0
    norms_other: int = 0  # norms, routers, sinks, conv, ... (plain parameters)
    fc: int = 0  # drafter only
    mxfp4_experts: bool = False  # checkpoint stores the expert weights as MXFP4
    notes: list[str] = field(default_factory=list)
    approximate: bool = False

    def add(self, inp: int, out: int, bias: bool = False, count: int = 1) -> None:
        if inp and out and count:
            self.linears.append(_Linear(inp, out, bias, count))


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _attention(c: _Counts, cfg: dict[str, Any], *, gated_q: bool = False) -> None:
    h = int(cfg["hidden_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = _head_dim(cfg)
    mt = cfg.get("model_type", "")
    bias = bool(cfg.get("attention_bias", cfg.get("qkv_bias", False)))
    qkv_bias = bias or mt == "qwen2"
    c.add(h, nh * hd * (2 if gated_q else 1), qkv_bias)
    c.add(h, nkv * hd, qkv_bias, 2)
    c.add(nh * hd, h, bias)
    if mt in _QWEN3_QK_NORM or cfg.get("use_qk_norm"):
        c.norms_other += 2 * hd
    if mt == "gpt_oss":
        c.norms_other += nh  # attention sinks


def _dense_mlp(c: _Counts, h: int, inter: int, bias: bool = False) -> None:
    c.add(h, inter, bias, 2)
    c.add(inter, h, bias)


def _gated_delta_net(c: _Counts, cfg: dict[str, Any]) -> None:
    h = int(cfg["hidden_size"])
    nk, dk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
    nv, dv = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    c.add(h, conv_dim)  # in_proj_qkv
    c.add(h, value_dim)  # in_proj_z
    c.add(h, nv, count=2)  # in_proj_b, in_proj_a
    c.add(value_dim, h)  # out_proj
    c.norms_other += conv_dim * int(cfg.get("linear_conv_kernel_dim", 4)) + 2 * nv + dv  # conv1d, dt_bias, A_log, norm


def count_target(config: dict[str, Any]) -> _Counts:
    """Parameter counts of a causal LM from its config.json (text part of multimodal configs)."""
    cfg = text_config(config)
    mt = cfg.get("model_type", config.get("model_type", ""))
    h = int(cfg["hidden_size"])
    vocab = int(cfg["vocab_size"])
    n = int(cfg["num_hidden_layers"])
    tied = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    c = _Counts(embeddings=vocab * h, lm_head=0 if tied else vocab * h)
    types = layer_types(cfg)
    mlp_bias = bool(cfg.get("mlp_bias", False))
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    sparse_step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    for i in range(n):
        kind = types[i] if i < len(types) else "full_attention"
        if kind == "linear_attention":
            _gated_delta_net(c, cfg)
        elif kind in _RECURRENT:
            raise ValueError(f"cannot count parameters of {kind!r} layers")
        else:
            _attention(c, cfg, gated_q=bool(cfg.get("attn_output_gate")))
        c.norms_other += 2 * h  # input_layernorm, post_attention_layernorm
        moe_layer = n_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0
        if mt == "gpt_oss":
            inter = int(cfg["intermediate_size"])
            c.experts += n_experts * 3 * inter * h  # gate_up_proj (E, H, 2I) + down_proj (E, I, H)
            c.expert_biases += n_experts * (2 * inter + h)
            c.norms_other += n_experts * h + n_experts  # router weight + bias
        elif moe_layer:
            inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
            c.experts += n_experts * 3 * inter * h
            c.norms_other += n_experts * h  # router
            shared = int(cfg.get("shared_expert_intermediate_size") or 0)
            if shared:
                _dense_mlp(c, h, shared)
                c.add(h, 1)  # shared_expert_gate
        else:
            _dense_mlp(c, h, int(cfg["intermediate_size"]), mlp_bias)
    c.norms_other += h  # final norm
    qc = config.get("quantization_config") or cfg.get("quantization_config") or {}
    if mt == "gpt_oss":
        c.approximate = True
        c.mxfp4_experts = qc.get("quant_method") == "mxfp4"
        c.notes.append("gpt-oss: counted from the config (sinks, routers, expert biases included); "
                       "in memory the MXFP4 experts are assumed dequantized to bf16 (transformers does this "
                       "without the MXFP4 kernels); with the kernels they stay near the on-disk size")
    if n_experts:
        c.notes.append("MoE experts are fused 3-D parameters in transformers 5: bitsandbytes (int8/nf4) "
                       "leaves them 16-bit")
    if any(t == "linear_attention" for t in types):
        c.approximate = True
        c.notes.append("hybrid model: text model only (vision tower and MTP head not counted)")
    return c


def count_drafter(drafter_config: dict[str, Any]) -> _Counts:
    """Parameter counts of a DFlash drafter (docs/format.md sections 2-3): fc, layers, norms."""
    cfg = drafter_config
    h = int(cfg["hidden_size"])
    n = int(cfg["num_hidden_layers"])
    c = _Counts(fc=drafter_tap_count(cfg) * h * h)
    q3 = dict(cfg, model_type="qwen3")  # DFlash draft layers are Qwen3 layers (q_norm/k_norm)
    dflash2 = is_dflash2(cfg)
    extra = cfg.get("dflash_config") or {}
    for _ in range(n):
        _attention(c, q3)
        _dense_mlp(c, h, int(cfg["intermediate_size"]))
        c.norms_other += 2 * h
        if dflash2:  # attention_conv and mlp_conv: base_kernel (2, K, H) and kernel_projection
            k, g = int(extra["conv_kernel_size"]), int(extra["conv_group_size"])
            c.norms_other += 2 * 2 * k * h
            c.add(h, 2 * k * (h // g), count=2)
    c.norms_other += 2 * h  # hidden_norm, norm
    if dflash2:  # the candidate selector: hidden projection and two vocabulary-sized codebooks, never quantized
        rank = int(extra["selector_rank"])
        c.norms_other += rank * h + 2 * int(cfg["vocab_size"]) * rank
    return c


# ---------------------------------------------------------------------------------------------------
# bytes


def _plain_bytes(quant: str) -> int:
    """Bytes per parameter of what bitsandbytes does not quantize (the compute dtype)."""
    return 4 if quant == "fp32" else 2


def _linear_bytes(lin: _Linear, quant: str, double_quant: bool) -> int:
    per = lin.inp * lin.out
    bias = lin.biases * _plain_bytes(quant)
    if quant in ("bf16", "fp16"):
        w = 2 * per
    elif quant == "fp32":
        w = 4 * per
    elif quant == "int8":
        w = per + 4 * lin.out  # int8 weights + fp32 row scales (SCB)
    elif quant in ("q4", "q8"):
        # weight-only CPU kernels (engine/weightonly.py): the 16-bit weights loaded stay beside the codes
        codes = math.ceil(per / 2) + 4 * math.ceil(per / Q4_GROUP) if quant == "q4" else per + 2 * lin.out
        w = 2 * per + codes
    elif quant == "nf4":
        blocks = math.ceil(per / NF4_BLOCK)
        absmax = (blocks + 4 * math.ceil(blocks / NF4_DOUBLE_QUANT_GROUP) + 4) if double_quant else 4 * blocks
        w = math.ceil(per / 2) + absmax
    else:  # pragma: no cover - normalize_quant guards this
        raise ValueError(quant)
    return w * lin.count + bias


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


def _estimate(c: _Counts, config: dict[str, Any], quant: str, double_quant: bool, drafter: bool) -> WeightEstimate:
    quant = normalize_quant(quant)
    plain = _plain_bytes(quant)
    linear_w = sum(lin.weights for lin in c.linears)
    linear_b = sum(lin.biases for lin in c.linears)
    linear_bytes = sum(_linear_bytes(lin, quant, double_quant) for lin in c.linears)
    if drafter:
        components = {"fc": c.fc * plain, "layers_linear": linear_bytes, "norms_other": c.norms_other * plain}
        params = {"fc": c.fc, "layers_linear": linear_w + linear_b, "norms_other": c.norms_other}
    else:
        # q4/q8: the fast path also keeps an 8-bit copy of the LM head (the tied embedding's, if tied)
        head_codes = (c.lm_head or c.embeddings) if quant in ("q4", "q8") else 0
        components = {"embeddings": c.embeddings * plain, "lm_head": c.lm_head * plain + head_codes,
                      "layers_linear": linear_bytes, "experts": (c.experts + c.expert_biases) * plain,
                      "norms_other": c.norms_other * plain}
        params = {"embeddings": c.embeddings, "lm_head": c.lm_head, "layers_linear": linear_w + linear_b,
                  "experts": c.experts + c.expert_biases, "norms_other": c.norms_other}
    disk_dt = _checkpoint_dtype_bytes(config)
    total_params = sum(params.values())
    if c.mxfp4_experts:
        mx = c.experts // 2 + c.experts // MXFP4_BLOCK  # fp4 pairs in uint8 blocks + one uint8 scale per 32
        disk = mx + (total_params - c.experts) * disk_dt
        disk_format = "MXFP4 experts + bf16 rest"
    else:
        disk = total_params * disk_dt
        disk_format = "fp32" if disk_dt == 4 else "bf16/fp16"
    return WeightEstimate(quant=quant, components=components, params=params, disk_bytes=disk,
                          disk_format=disk_format, approximate=c.approximate, notes=tuple(c.notes))


def target_weight_bytes(config: dict[str, Any], quant: str = "bf16", *, double_quant: bool = False) -> WeightEstimate:
    """Weight bytes of a target model loaded with `quant` (bf16, fp16, fp32, int8, nf4)."""
    return _estimate(count_target(config), config, quant, double_quant, drafter=False)


def drafter_weight_bytes(drafter_config: dict[str, Any], quant: str = "bf16", *,
                         double_quant: bool = False) -> WeightEstimate:
    """Weight bytes of a DFlash drafter; `quant` applies to the draft layers' linears only, like the loader."""
    return _estimate(count_drafter(drafter_config), drafter_config, quant, double_quant, drafter=True)


# ---------------------------------------------------------------------------------------------------
# KV caches


def kv_cache_bytes(config: dict[str, Any], context_tokens: int, dtype_bytes: int = 2, *,
                   cap_sliding: bool = True) -> int:
    """K+V bytes for `context_tokens` rows: 2 * kv_heads * head_dim * rows * dtype_bytes per attention layer.

    Sliding-window layers hold at most `sliding_window` rows when `cap_sliding`; gated-DeltaNet layers
    hold a fixed state (fp32 recurrent state + conv state) whatever the length, three times over in the
    engine: two buffers for rolling back exactly and a checkpoint for regenerating (fast.LinearStates).
    """
    cfg = text_config(config)
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = _head_dim(cfg)
    window = cfg.get("sliding_window")
    total = 0
    for kind in layer_types(cfg):
        if kind == "linear_attention":
            nk, dk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
            nv, dv = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
            conv_dim = 2 * nk * dk + nv * dv
            state = nv * dk * dv * 4 + conv_dim * (int(cfg.get("linear_conv_kernel_dim", 4)) - 1) * dtype_bytes
            total += LINEAR_STATE_COPIES * state
            continue
        rows = context_tokens
        if kind == "sliding_attention" and cap_sliding and window:
            rows = min(rows, int(window))
        total += 2 * nkv * hd * rows * dtype_bytes
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
