"""The fast path's per-layer pieces: which targets it runs (`fast_path_unsupported`, the model families), each
layer's linear maps as it runs them (`layer_projections`: fused, packed or 4/8-bit), and the math and
placement helpers its forward calls per layer: `norm_fn`, `rope_rows`, `partial_rope`,
`row_exact_attention`, `layer_device`, `move`, `first_attention`. engine/static_forward.py composes them into
the target's forward; engine/fast.py builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_cli.engine.cpu.c_layers import PLAIN_RMS_NORMS
from dflash_cli.engine.cpu.packed import PackedLinear, Parallel
from dflash_cli.engine.cpu.weightonly import Q4Codes, quantize_linears
from dflash_cli.engine.drafter import apply_rope
from dflash_cli.engine.hf_module import HFModule
from dflash_cli.engine.linear_attention import is_linear_attention, linear_projections
from dflash_cli.engine.pairing import HYBRID_MODEL_TYPES

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# Llama-style layers whose MLP may be a mixture of experts (Qwen3-MoE: Qwen3-Coder-30B-A3B), run as its own
# module, or under q4/q8 with 4/8-bit experts (engine/moe.py)
MOE_FAMILIES = ("qwen3_moe",)
HYBRID_FAMILIES = HYBRID_MODEL_TYPES
# Gemma 4 (26B-A4B, 31B): sliding-window and global layers of different shapes, sandwich norms, an optional
# mixture of experts beside the MLP, soft-capped logits (StaticForward)
GEMMA_FAMILIES = ("gemma4", "gemma4_text")


@dataclass
class QuantizedLayers:
    """Each decoder layer's projections (`layer_projections`) in a CPU integer format, made while the target
    loaded (engine/layerwise.py) rather than by the fast path, whose dense weights were never all held."""

    weights: str | None  # q4, q8, q4a8 or q8a8 (None: packed or the layers' own modules)
    projections: nn.ModuleList
    codes_used: int  # linears that run the checkpoint's own 4-bit codes
    freed_bytes: int


def fast_path_unsupported(model: HFModule, *, quantized: QuantizedLayers | None = None) -> str | None:
    """Why `model` cannot take the fast path, or None when it can (`quantized`: its layers were quantized as
    they loaded, so their dense weights are gone by design)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        return "layers offloaded to cpu/disk (accelerate copies their weights in on every forward)"
    if quantized is None and freed_weights(model):
        return "its dense weights were freed by an earlier quantized fast path (load it again)"
    return architecture_unsupported(model)


def architecture_unsupported(model: HFModule) -> str | None:
    """Why the fast path cannot run `model`'s kind of layers, or None (weights not looked at)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    supported = FAMILIES + MOE_FAMILIES + HYBRID_FAMILIES + GEMMA_FAMILIES
    if model_type not in supported:
        return f"model type {model_type!r} (fast path: {', '.join(supported)})"
    if model_type in GEMMA_FAMILIES:
        reason = _gemma_unsupported(model.get_decoder().config)
        if reason is not None:
            return reason
    else:
        # Qwen2 gates its window with use_sliding_window; Mistral applies sliding_window whenever it is set
        window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        if window or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            return "sliding-window attention"
    decoder = model.get_decoder()
    if not hasattr(decoder, "rotary_emb") or not hasattr(decoder, "norm"):
        return f"{type(decoder).__name__} has no rotary_emb or final norm"
    for layer in decoder.layers:
        if not all(hasattr(layer, m) for m in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return f"{type(layer).__name__} is not a Llama-style decoder layer"
        if is_linear_attention(layer):
            if model_type not in HYBRID_FAMILIES:
                return f"{type(layer.linear_attn).__name__} layers"
            continue
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"{type(layer).__name__} is not a Llama-style decoder layer"
        if model_type in FAMILIES and not _gated_mlp(layer.mlp):
            return f"{type(layer.mlp).__name__} is not a gated MLP"
    return None


def _gemma_unsupported(text_config: Any) -> str | None:
    """What a Gemma 4 text model has that the fast path does not run (the small E2B/E4B models' extras)."""
    if getattr(text_config, "hidden_size_per_layer_input", 0):
        return "per-layer input embeddings (Gemma 4 E2B/E4B)"
    if getattr(text_config, "num_kv_shared_layers", 0):
        return "layers that reuse another layer's K/V"
    if getattr(text_config, "use_bidirectional_attention", None) == "all":
        return "bidirectional attention"
    return None


def free_dense_weights(linears: list[nn.Module]) -> int:
    """Drops the dense weights of `linears` that run quantized now (their codes are a copy); returns the bytes
    released. A 4-bit target otherwise holds its full-precision weights beside the codes: 16 GB for a 4B
    model in fp32. What is left is an empty weight, so that a forward through the module fails loudly (a
    meta tensor would not: torch's CPU linear returns garbage for one) and `freed_weights` can tell."""
    freed = 0
    for linear in {id(m): m for m in linears}.values():
        weight = getattr(linear, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.numel():
            freed += weight.numel() * weight.element_size()
            linear.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
    return freed


def freed_weights(model: nn.Module) -> bool:
    """Whether an earlier quantized fast path freed some of `model`'s dense weights (free_dense_weights)."""
    return any(isinstance(m, nn.Linear) and m.weight.numel() == 0 and m.out_features * m.in_features
               for m in model.modules())


def _gated_mlp(mlp: nn.Module) -> bool:
    return all(hasattr(mlp, m) for m in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def codes_lookup(model: nn.Module, codes: dict[str, Q4Codes],
                  used: list[str]) -> Callable[[nn.Module], Q4Codes | None]:
    """Finds a linear's ready 4-bit codes by its module name (noting it in `used`); codes of another shape
    are a CheckpointError."""
    from dflash_cli.engine.errors import CheckpointError

    names = {id(m): name for name, m in model.named_modules()}

    def lookup(linear: nn.Module) -> Q4Codes | None:
        name = names.get(id(linear))
        found = codes.get(name) if name is not None else None
        weight = getattr(linear, "weight", None)
        if found is not None and weight is not None and tuple(found.codes.shape) != tuple(weight.shape):
            raise CheckpointError(f"the 4-bit codes of {name} have shape {list(found.codes.shape)}, "
                                  f"the weight {list(weight.shape)}", hint="delete the codes file")
        if found is not None and name is not None:
            used.append(name)
        return found

    return lookup


def layer_projections(layer: HFModule, pack: bool, quant: str | None = None,
                      codes: Callable[[nn.Module], Q4Codes | None] | None = None,
                      replaced: list[nn.Module] | None = None) -> nn.ModuleDict:
    """A layer's linear maps as qkv -> (q, k, v), o (or a linear-attention layer's inputs, out), and a gated
    MLP's gate_up -> (gate, up), down; weight-only quantized when `quant` is q4/q8 (engine/cpu/weightonly.py;
    `codes(linear)` may give ready 4-bit codes), else packed by oneDNN (fused where several) when `pack` and
    it works here, else the layer's own modules. Other MLPs (mixtures of experts) run as their own module;
    under q4/q8 a Qwen MoE block's shared expert, a gated MLP, gets shared_gate_up and shared_down.
    `replaced` collects the linears quantized here, whose dense weights nothing reads any more."""

    def fuse(*linears: nn.Module) -> nn.Module | None:
        made: nn.Module | None = None
        if quant is not None:
            given = [codes(m) for m in linears] if codes is not None else None
            made = quantize_linears(list(linears), quant, codes=given)
            if made is not None and replaced is not None:
                replaced.extend(linears)
        if made is None and pack:
            made = PackedLinear.pack(*linears)
        return made

    def group(*linears: nn.Module) -> nn.Module:
        return fuse(*linears) or (linears[0] if len(linears) == 1 else Parallel(*linears))

    out: dict[str, nn.Module] = {}
    if is_linear_attention(layer):
        out.update(linear_projections(layer, fuse))
    else:
        attn = layer.self_attn
        # Gemma 4's global layers have no v_proj (attention_k_eq_v): qkv then gives (q, k), and v is k
        qkv = [attn.q_proj, attn.k_proj] + ([attn.v_proj] if attn.v_proj is not None else [])
        out.update(qkv=group(*qkv), o=group(attn.o_proj))
    if _gated_mlp(layer.mlp):
        out.update(gate_up=group(layer.mlp.gate_proj, layer.mlp.up_proj), down=group(layer.mlp.down_proj))
    shared = getattr(layer.mlp, "shared_expert", None)
    if quant is not None and shared is not None and _gated_mlp(shared):
        gate_up, down = fuse(shared.gate_proj, shared.up_proj), fuse(shared.down_proj)
        if gate_up is not None and down is not None:
            out.update(shared_gate_up=gate_up, shared_down=down)
    return nn.ModuleDict(out)


# RMSNorms that compute F.rms_norm's function (x * rsqrt(mean(x^2) + eps) in fp32, times the weight) run as
# that one call instead of their eight small ops. In fp32 the result is the same; in bf16 transformers
# rounds before multiplying by the weight and F.rms_norm after, so about a quarter of the outputs differ in
# the last bit from transformers' forward (decoding is unaffected: a target always runs one path). Others
# (Qwen3.5's 1 + weight) run as modules. (PLAIN_RMS_NORMS lives in engine/cpu/c_layers.py, which reads it too.)


def norm_fn(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    if type(norm).__name__ not in PLAIN_RMS_NORMS:
        return norm
    weight: torch.Tensor = norm.weight  # type: ignore[assignment]
    eps, size = float(norm.variance_epsilon), [int(weight.shape[0])]  # type: ignore[arg-type]
    return lambda x: F.rms_norm(x, size, weight, eps)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """apply_rope over all channels, bit for bit, in four ops: rotate_half(x) * sin equals the halves of x
    swapped (a roll) times sin with its first half negated."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] channels only (Qwen3.5's partial rotary); full rotary
    takes rope_rows."""
    rotary = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


# with row-exact linears (q4/q8 on a CPU in bf16), calls of at most this many tokens (decodes, verifies)
# attend through row_exact_attention; prompts keep the fused kernel (their scores would not fit)
ROW_EXACT_ATTENTION = 64


def row_exact_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Attention whose every output row is bit-identical however many rows are computed together.

    torch's fused CPU attention (the flash kernel) rounds a row differently in bf16 depending on the other
    rows of its call: 1-token decodes against 8-token verifies at the same positions differed in the last
    bit in about one row in twenty, enough to change a greedy token now and then. The q4/q8 kernels compute
    each row on its own, so with this three-op form (bf16 matmul, fp32 softmax, bf16 matmul), row-exact
    over 1,470 (rows, window, length) cases measured, a quantized target's speculative decoding gives
    exactly its plain decoding's tokens (15 of 15 prompts x 128 tokens identical on the demo, where the
    flash kernel gave 3-4 of 15). It costs about 40 us more per layer call than the flash kernel. Running
    the flash kernel with one batch entry per position instead (same speed as the folded call at one token)
    was measured and rejected: its rounding depends on which thread computes an entry (the same query
    duplicated in a batch of 4 gave two different results), so a decode and a verify still disagreed.
    Dense bf16 weights gain nothing from it: oneDNN's bf16 matmul itself rounds some shapes differently by
    row count (576x1536 at 3 and 16 rows, measured), so they keep the flash kernel and approximate
    losslessness, as before; fp32 keeps it too (its differences, ~1e-7, are below what a token choice sees)."""
    scores = torch.matmul(q * scale if scale != 1.0 else q, keys.transpose(-1, -2))
    scores.masked_fill_(blocked, float("-inf"))  # blocked: ~mask, the keys each row may not see
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), values)


def layer_device(layer: nn.Module) -> torch.device:
    """Where a decoder layer computes: the device of its weights (one per layer under a device map)."""
    return next(layer.parameters()).device


def move(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every crossing of a device boundary in the fast path goes through here (the tests count them)."""
    # asynchronous only towards a GPU: a CPU tensor copied from a GPU without waiting could be read unfinished
    return x.to(device, non_blocking=device.type == "cuda")


def first_attention(model: HFModule) -> HFModule:
    return next(layer.self_attn for layer in model.get_decoder().layers if not is_linear_attention(layer))
