"""Parameter counts per architecture, from `config.json` dicts only.

Used by the memory planner before any weights are downloaded, so it is pure arithmetic: no torch, no
transformers. The bytes those parameters take, per quantization: models/memory/sizes.py.

What is counted
---------------
Parameters are counted per component from the config (the shapes transformers builds):

* embeddings ``vocab * hidden``; ``lm_head`` the same unless ``tie_word_embeddings``;
* per decoder layer: q/k/v/o projections (``head_dim``, ``num_key_value_heads``, ``attention_bias``;
  qwen2 has biases on q/k/v only), the MLP gate/up/down, two RMSNorms, plus q_norm/k_norm on qwen3-family
  models; MoE layers (qwen3_moe, gpt_oss): fused expert tensors ``E * 3 * moe_intermediate * hidden``
  (+ expert biases on gpt-oss), the router, shared experts if any; gpt-oss attention sinks;
  Qwen3.5 and Qwen3-Next gated-DeltaNet ("linear_attention") layers (Qwen3-Next's layer kinds from
  ``full_attention_interval`` when the config lists none; its attention's q_proj carries the output gate);
* multi-head latent attention (DeepSeek-V3, Kimi K2's ``kimi_k2`` text model, GLM-5's ``glm_moe_dsa``; any
  config with ``kv_lora_rank``): q_a/q_b (or q_proj), kv_a_proj_with_mqa, kv_b_proj, o_proj and their
  norms, GLM-5's sparse-attention indexer (wq_b, wk, k_norm, weights_proj) in the layers that run one;
  their MoE (``n_routed_experts`` after ``first_k_dense_replace`` dense layers, ``n_shared_experts`` as
  one MLP, a router with its score-correction bias); multi-token-prediction layers are not loaded by
  transformers and not counted;
* Gemma 4 (``gemma4_text``): per-layer shapes (full layers: ``global_head_dim`` and, with
  ``attention_k_eq_v``, ``num_global_key_value_heads`` and no v_proj), KV-shared layers, the MoE block
  beside the dense MLP, per-layer embeddings; the vision tower is not counted;
* the final norm.

A checkpoint published quantized is recognised here (`prequantized`, `checkpoint_quantization`); how its
tensors count on disk and in memory is in models/memory/sizes.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_cli.engine.hf_config import drafter_tap_count, is_dflash2, layer_types, text_config

_QWEN3_QK_NORM = {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                  "qwen3_5_moe_text"}
_RECURRENT = {"linear_attention", "mamba", "conv", "recurrent"}
# checkpoint formats whose on-disk bytes models/memory/sizes.py counts as published; others count 16-bit
_DISK_FORMATS = ("mxfp4", "compressed-tensors", "fp8")


@dataclass
class Linear:
    """`count` nn.Linear layers of one shape (inp -> out), with or without a bias."""

    inp: int
    out: int
    bias: bool
    count: int = 1
    role: str = "other"  # "attn", "mlp", "shared" (shared experts), "linear_attn", "other": for checkpoint formats

    @property
    def weights(self) -> int:
        return self.inp * self.out * self.count

    @property
    def biases(self) -> int:
        return self.out * self.count if self.bias else 0


@dataclass
class Counts:
    """A model's parameters by component, as `count_target` and `count_drafter` find them."""

    embeddings: int = 0
    lm_head: int = 0
    linears: list[Linear] = field(default_factory=list)  # nn.Linear inside decoder layers
    experts: int = 0  # fused expert weight tensors (3-D nn.Parameter)
    expert_biases: int = 0
    norms_other: int = 0  # norms, routers, sinks, conv, ... (plain parameters)
    fc: int = 0  # drafter only
    mxfp4_experts: bool = False  # checkpoint stores the expert weights as MXFP4
    # the experts as the checkpoint stores them: (matrices, rows, columns), for its quantization's scales
    expert_mats: list[tuple[int, int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    approximate: bool = False

    def add(self, inp: int, out: int, bias: bool = False, count: int = 1, role: str = "other") -> None:
        if inp and out and count:
            self.linears.append(Linear(inp, out, bias, count, role))

    def add_experts(self, experts: int, inter: int, hidden: int) -> None:
        """One MoE layer's routed experts: gate and up (inter x hidden) and down (hidden x inter) each."""
        self.experts += experts * 3 * inter * hidden
        self.expert_mats += [(2 * experts, inter, hidden), (experts, hidden, inter)]


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def is_mla(cfg: dict[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-5): the KV cache holds a compressed latent."""
    return bool(cfg.get("kv_lora_rank"))


def is_gemma4(cfg: dict[str, Any]) -> bool:
    return str(cfg.get("model_type", "")).startswith("gemma4")


def target_layer_kinds(cfg: dict[str, Any]) -> list[str]:
    """Per-layer attention kind of a target's text config, as transformers derives it (Qwen3-Next configs
    may give only `full_attention_interval`: every n-th layer attends, the others are Gated DeltaNet)."""
    if cfg.get("layer_types") is None and cfg.get("model_type") == "qwen3_next":
        every = int(cfg.get("full_attention_interval") or 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(int(cfg["num_hidden_layers"]))]
    return layer_types(cfg)


def _attention(c: Counts, cfg: dict[str, Any], *, gated_q: bool = False) -> None:
    h = int(cfg["hidden_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = head_dim(cfg)
    mt = cfg.get("model_type", "")
    bias = bool(cfg.get("attention_bias", cfg.get("qkv_bias", False)))
    qkv_bias = bias or mt == "qwen2"
    c.add(h, nh * hd * (2 if gated_q else 1), qkv_bias, role="attn")
    c.add(h, nkv * hd, qkv_bias, 2, role="attn")
    c.add(nh * hd, h, bias, role="attn")
    if mt in _QWEN3_QK_NORM or cfg.get("use_qk_norm"):
        c.norms_other += 2 * hd
    if mt == "gpt_oss":
        c.norms_other += nh  # attention sinks


def mla_indexer_layers(cfg: dict[str, Any]) -> list[bool]:
    """GLM-5 (glm_moe_dsa) DeepSeek-sparse-attention indexers: which layers run their own (transformers'
    `indexer_types`: "full" runs one, "shared" reuses the previous layer's top-k)."""
    n = int(cfg["num_hidden_layers"])
    if not cfg.get("index_n_heads"):
        return [False] * n
    types = cfg.get("indexer_types")
    if types is None:
        freq = max(int(cfg.get("index_topk_freq") or 1), 1)
        offset = int(cfg.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    return [t == "full" for t in types]


def _mla_attention(c: Counts, cfg: dict[str, Any], indexer: bool) -> None:
    """DeepSeek-V3 / GLM-5 multi-head latent attention, as transformers builds it: q through a low-rank
    q_a/q_b pair (or one q_proj), K and V from one latent (kv_a_proj_with_mqa, kv_b_proj), plus GLM-5's
    sparse-attention indexer (wq_b, wk, k_norm, weights_proj)."""
    h = int(cfg["hidden_size"])
    nh = int(cfg["num_attention_heads"])
    q_lora = cfg.get("q_lora_rank")
    kv_lora, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    nope, v = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    bias = bool(cfg.get("attention_bias", False))
    if q_lora:
        c.add(h, int(q_lora), bias, role="attn")  # q_a_proj
        c.norms_other += int(q_lora)  # q_a_layernorm
        c.add(int(q_lora), nh * (nope + rope), role="attn")  # q_b_proj
    else:
        c.add(h, nh * (nope + rope), role="attn")  # q_proj
    c.add(h, kv_lora + rope, bias, role="attn")  # kv_a_proj_with_mqa
    c.norms_other += kv_lora  # kv_a_layernorm
    c.add(kv_lora, nh * (nope + v), role="attn")  # kv_b_proj
    c.add(nh * v, h, bias, role="attn")  # o_proj
    if indexer:
        heads, dim = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
        c.add(int(q_lora or h), heads * dim, role="attn")  # wq_b
        c.add(h, dim, role="attn")  # wk
        c.add(h, heads, role="attn")  # weights_proj
        c.norms_other += 2 * dim  # k_norm (a LayerNorm: weight and bias)


def _dense_mlp(c: Counts, h: int, inter: int, bias: bool = False, role: str = "mlp") -> None:
    c.add(h, inter, bias, 2, role=role)
    c.add(inter, h, bias, role=role)


def _gated_delta_net(c: Counts, cfg: dict[str, Any]) -> None:
    h = int(cfg["hidden_size"])
    nk, dk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
    nv, dv = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    c.add(h, conv_dim, role="linear_attn")  # in_proj_qkv (Qwen3-Next: in_proj_qkvz with the next one)
    c.add(h, value_dim, role="linear_attn")  # in_proj_z
    c.add(h, nv, count=2, role="linear_attn")  # in_proj_b, in_proj_a (Qwen3-Next: in_proj_ba)
    c.add(value_dim, h, role="linear_attn")  # out_proj
    c.norms_other += conv_dim * int(cfg.get("linear_conv_kernel_dim", 4)) + 2 * nv + dv  # conv1d, dt_bias, A_log, norm


def _gemma4_layers(c: Counts, cfg: dict[str, Any]) -> None:
    """Gemma 4's decoder (transformers' Gemma4TextDecoderLayer): sliding layers with `head_dim` and
    `num_key_value_heads`, full layers with `global_head_dim` and, when `attention_k_eq_v`, the
    `num_global_key_value_heads` and no v_proj (K doubles as V); KV-shared layers (the last
    `num_kv_shared_layers`) have no K/V projections; four norms a layer (seven with the MoE block, which
    runs beside the dense MLP); per-layer embeddings (PLE) when `hidden_size_per_layer_input`."""
    h, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    nh = int(cfg["num_attention_heads"])
    bias = bool(cfg.get("attention_bias", False))
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    shared_from = n - int(cfg.get("num_kv_shared_layers") or 0)
    ple = int(cfg.get("hidden_size_per_layer_input", 256) or 0)
    moe = bool(cfg.get("enable_moe_block", False))
    for i, kind in enumerate(target_layer_kinds(cfg)):
        full = kind == "full_attention"
        hd, nkv = gemma4_kv_shape(cfg, full)
        c.add(h, nh * hd, bias, role="attn")  # q_proj
        c.norms_other += hd  # q_norm
        if i < shared_from:
            c.add(h, nkv * hd, bias, count=1 if full and k_eq_v else 2, role="attn")  # k_proj (+ v_proj)
            c.norms_other += hd  # k_norm (v_norm has no weight)
        c.add(nh * hd, h, bias, role="attn")  # o_proj
        wide = 2 if cfg.get("use_double_wide_mlp") and i >= shared_from else 1
        _dense_mlp(c, h, int(cfg["intermediate_size"]) * wide)
        c.norms_other += 4 * h + 1  # four RMSNorms and the layer_scalar buffer
        if ple:
            c.add(h, ple, role="other")  # per_layer_input_gate
            c.add(ple, h, role="other")  # per_layer_projection
            c.norms_other += h  # post_per_layer_input_norm
        if moe:
            experts, inter = int(cfg["num_experts"]), int(cfg["moe_intermediate_size"])
            c.add(h, experts, role="other")  # router.proj
            c.norms_other += h + experts + 3 * h  # router scale, per_expert_scale, three more norms
            c.add_experts(experts, inter, h)
    if ple:  # embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm
        c.norms_other += int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) * n * ple
        c.norms_other += h * n * ple + ple


def gemma4_kv_shape(cfg: dict[str, Any], full: bool) -> tuple[int, int]:
    """(head_dim, KV heads) of a Gemma 4 layer: full layers use the global shape (Gemma4TextConfig)."""
    if not full:
        return int(cfg.get("head_dim") or 256), int(cfg["num_key_value_heads"])
    # a config transformers saved holds the full layers' shape as per-layer overrides, not global_* fields
    overrides = next(iter((cfg.get("per_layer_config") or {}).values()), None) or {}
    heads = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v", False) else None
    return (int(overrides.get("head_dim") or cfg.get("global_head_dim") or 512),
            int(overrides.get("num_key_value_heads") or heads or cfg["num_key_value_heads"]))


def _mla_moe_layers(cfg: dict[str, Any]) -> list[bool]:
    """Which layers of a DeepSeek-V3 / GLM-5 model are mixture-of-experts (the first
    `first_k_dense_replace` are dense; GLM-5 may list `mlp_layer_types`)."""
    n = int(cfg["num_hidden_layers"])
    if not cfg.get("n_routed_experts"):
        return [False] * n
    if cfg.get("mlp_layer_types"):
        return [t == "sparse" for t in cfg["mlp_layer_types"]]
    first = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    return [i >= first and i % freq == 0 for i in range(n)]


def count_target(config: dict[str, Any]) -> Counts:
    """Parameter counts of a causal LM from its config.json (text part of multimodal configs)."""
    cfg = text_config(config)
    mt = cfg.get("model_type", config.get("model_type", ""))
    h = int(cfg["hidden_size"])
    vocab = int(cfg["vocab_size"])
    n = int(cfg["num_hidden_layers"])
    tied = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    c = Counts(embeddings=vocab * h, lm_head=0 if tied else vocab * h)
    if is_gemma4(cfg):
        _gemma4_layers(c, cfg)
        c.norms_other += h  # final norm
        if config is not cfg:
            c.notes.append("Gemma 4: text model only (the vision tower is not loaded, not counted)")
        _checkpoint_notes(c, config, cfg, mt)
        return c
    types = target_layer_kinds(cfg)
    mlp_bias = bool(cfg.get("mlp_bias", False))
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    sparse_step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    mla = is_mla(cfg)
    indexers = mla_indexer_layers(cfg) if mla else [False] * n
    mla_moe = _mla_moe_layers(cfg) if mla else [False] * n
    for i in range(n):
        kind = types[i] if i < len(types) else "full_attention"
        if kind == "linear_attention":
            _gated_delta_net(c, cfg)
        elif kind in _RECURRENT:
            raise ValueError(f"cannot count parameters of {kind!r} layers")
        elif mla:
            _mla_attention(c, cfg, indexers[i])
        else:
            _attention(c, cfg, gated_q=bool(cfg.get("attn_output_gate")) or mt == "qwen3_next")
        c.norms_other += 2 * h  # input_layernorm, post_attention_layernorm
        moe_layer = n_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0
        if mt == "gpt_oss":
            inter = int(cfg["intermediate_size"])
            c.add_experts(n_experts, inter, h)  # gate_up_proj (E, 2I, H) + down_proj (E, H, I)
            c.expert_biases += n_experts * (2 * inter + h)
            c.norms_other += n_experts * h + n_experts  # router weight + bias
        elif mla and mla_moe[i]:
            inter = int(cfg["moe_intermediate_size"])
            c.add_experts(n_experts, inter, h)
            # router weight, and the score-correction bias of the noaux_tc routers (DeepSeek-V3, GLM-5)
            c.norms_other += n_experts * h + (0 if mt == "deepseek_v2" else n_experts)
            _dense_mlp(c, h, inter * int(cfg.get("n_shared_experts") or 0), role="shared")
        elif mla:
            _dense_mlp(c, h, int(cfg["intermediate_size"]), mlp_bias)
        elif moe_layer:
            inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
            c.add_experts(n_experts, inter, h)
            c.norms_other += n_experts * h  # router
            shared = int(cfg.get("shared_expert_intermediate_size") or 0)
            if shared:
                _dense_mlp(c, h, shared, role="shared")
                c.add(h, 1)  # shared_expert_gate
        else:
            _dense_mlp(c, h, int(cfg["intermediate_size"]), mlp_bias)
    c.norms_other += h  # final norm
    if mt == "gpt_oss":
        c.approximate = True
        c.notes.append("gpt-oss: counted from the config (sinks, routers, expert biases included)")
    if n_experts:
        c.notes.append("MoE experts are fused 3-D parameters in transformers 5: bitsandbytes (int8/nf4) "
                       "leaves them 16-bit")
    if any(t == "linear_attention" for t in types):
        c.approximate = True
        c.notes.append("hybrid model: text model only (vision tower and MTP head not counted)")
    if mla and int(cfg.get("num_nextn_predict_layers") or 0):
        c.notes.append(f"{cfg['num_nextn_predict_layers']} multi-token-prediction layer(s) in the checkpoint: "
                       "not loaded by transformers, not counted")
    if mla and config is not cfg:
        c.notes.append("text model only (the vision tower is not counted)")
    _checkpoint_notes(c, config, cfg, mt)
    return c


def checkpoint_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's own `quantization_config` ({} for a plain 16/32-bit checkpoint)."""
    qc = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    return qc if isinstance(qc, dict) else {}


def prequantized(config: dict[str, Any]) -> str | None:
    """The quantization method a checkpoint is published in (mxfp4, fp8, compressed-tensors, ...), or None.
    transformers refuses a bitsandbytes config on top of it ("The model is quantized with ... but you are
    passing a BitsAndBytesConfig"), so --quant int8/nf4 cannot apply."""
    method = checkpoint_quantization(config).get("quant_method")
    return str(method) if method else None


def _checkpoint_notes(c: Counts, config: dict[str, Any], cfg: dict[str, Any], mt: str) -> None:
    method = prequantized(config)
    if method == "mxfp4" and mt == "gpt_oss":
        c.mxfp4_experts = True
    elif method and method not in _DISK_FORMATS:
        c.approximate = True
        c.notes.append(f"checkpoint quantized with {method}: its on-disk size is counted as 16-bit")


def count_drafter(drafter_config: dict[str, Any]) -> Counts:
    """Parameter counts of a DFlash drafter (docs/format.md sections 2-3): fc, layers, norms."""
    cfg = drafter_config
    h = int(cfg["hidden_size"])
    n = int(cfg["num_hidden_layers"])
    c = Counts(fc=drafter_tap_count(cfg) * h * h)
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
