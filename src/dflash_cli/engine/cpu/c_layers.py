"""Whole Llama-style decoder layers in C (native/layer.c) under q4a8/q8a8: the small ops around the linears
(norms, rotary, K/V writes, attention, SiLU, residuals) cost more than the linears in eager PyTorch on a CPU,
one dispatch each; here the target's whole stack is one call, a drafter's layer one call. Row-exact like its
parts, and checked against the op-by-op forward in tests/test_int8act.py."""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from dflash_cli.engine.cpu import native
from dflash_cli.engine.cpu.int8act import CodesEmbedding, Int8ActLinear, Q4A8Linear

# RMSNorms that compute F.rms_norm's function (x * rsqrt(mean(x^2) + eps) in fp32, times the weight): the
# fast path runs them as that one call (engine/fast_layers.py), the C layer as its own pass
PLAIN_RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "MistralRMSNorm"}
SILU = {"SiLU", "SiLUActivation"}


# rotary types whose tables transformers recomputes from a call's longest position (dynamic_rope_update)
DYNAMIC_ROPE = {"dynamic", "longrope"}


class RopeTable:
    """cos and sin with its first half negated (native/layer.c's tables) for positions lo..end-1, (1, end - lo,
    hd) fp32, made by `rotary` (a transformers rotary module): slices of tables of every position so far, grown
    by doubling. Computing them per call cost ~0.1 ms of a ~5 ms decode (70 us of a draft), and so a decode and
    a verify read the same rows for a position. A rotary whose tables depend on the call (DYNAMIC_ROPE) makes
    each call's rows itself, as before."""

    def __init__(self, rotary: Any, device: torch.device | str = "cpu"):
        self.rotary = rotary
        self.like = torch.empty(0, device=device)  # fp32 on the device: what the tables are made as
        self.per_call = getattr(rotary, "rope_type", "default") in DYNAMIC_ROPE
        self.cos: torch.Tensor | None = None
        self.signed: torch.Tensor | None = None

    def for_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(self.like, positions[None])
        half = cos.shape[-1] // 2
        return cos.float().contiguous(), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).float().contiguous()

    def rows(self, lo: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.per_call:
            return self.for_positions(torch.arange(lo, end, device=self.like.device))
        if self.cos is None or self.signed is None or self.cos.shape[1] < end:
            size = max(end, 2 * self.cos.shape[1] if self.cos is not None else 256)
            self.cos, self.signed = self.for_positions(torch.arange(size, device=self.like.device))
        return self.cos[:, lo:end], self.signed[:, lo:end]


def c_final_norm(lib: ctypes.CDLL, norm: nn.Module, fallback: Any) -> Any:
    """The final norm beside the C layers as one C call (`dfq_rms_norm_rows`) where it is a plain fp32 RMSNorm,
    else `fallback`: torch's RMSNorm on a few rows cost ~70 us of a ~3.5 ms decode of the demo (waking its own
    thread pool), the C norm ~5. Row by row in a fixed order, so a decode and a verify norm a row alike."""
    weight = getattr(norm, "weight", None)
    if type(norm).__name__ not in PLAIN_RMS_NORMS or not isinstance(weight, torch.Tensor):
        return fallback
    eps = float(getattr(norm, "variance_epsilon"))

    def final_norm(x: torch.Tensor) -> torch.Tensor:  # (native.rms_norm: None for what its kernel cannot take)
        out = native.rms_norm(lib, x, weight, eps) if not torch.is_grad_enabled() else None
        return out if out is not None else fallback(x)

    return final_norm


def _linear(layer: Any) -> native.Linear | None:
    """A layer's linear as its struct, where it has no padded rows (a layer's outputs are read whole)."""
    if not isinstance(layer, Int8ActLinear) or layer.padded != layer.out_features:
        return None
    return linear_struct(layer)


def _norm(norm: nn.Module | None) -> tuple[int | None, float]:
    if norm is None or type(norm).__name__ not in PLAIN_RMS_NORMS:
        raise ValueError
    weight = norm.weight
    assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.is_contiguous()
    return weight.data_ptr(), float(norm.variance_epsilon)  # type: ignore[arg-type]


def layer_struct(layer: Any, proj: Any, *, heads: int, kv: int, hd: int, scale: float) -> native.Layer | None:
    """`layer` as native/layer.c's struct, or None where that C layer cannot run it (another norm, activation,
    or layout; a gated or partial-rotary attention; linears not in q4a8/q8a8)."""
    attn, mlp = getattr(layer, "self_attn", None), layer.mlp
    if attn is None or type(getattr(mlp, "act_fn", None)).__name__ not in SILU or hd % 8 or hd > 1024:
        return None
    if hasattr(layer, "pre_feedforward_layernorm") or not all(k in proj for k in ("qkv", "o", "gate_up", "down")):
        return None
    parts = [_linear(proj[k]) for k in ("qkv", "o", "gate_up", "down")]
    if any(p is None for p in parts):
        return None
    qkv, o, gate_up, down = parts
    assert qkv is not None and o is not None and gate_up is not None and down is not None
    hidden, inter = o.n, down.k
    if qkv.n != (heads + 2 * kv) * hd or gate_up.n != 2 * inter or o.k != heads * hd or hidden % 32:
        return None
    try:
        (norm1, eps1), (norm2, eps2) = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
        q_norm = k_norm = None
        qk_eps = 0.0
        if hasattr(attn, "q_norm"):
            (q_norm, qk_eps), (k_norm, _) = _norm(attn.q_norm), _norm(attn.k_norm)
    except (ValueError, AssertionError):
        return None
    return native.Layer(hidden, heads, kv, hd, inter, norm1, norm2, q_norm, k_norm, eps1, eps2, qk_eps, scale,
                        qkv, o, gate_up, down)


class LayerStack:
    """The target's decoder layers (Layer structs, alike in shape) run as one C call (native/layer.c's
    dfq_stack_forward): one ctypes call and one parallel region per forward instead of one per layer."""

    def __init__(self, lib: ctypes.CDLL, layers: list[native.Layer]):
        self.lib, self.layers = lib, layers  # the structs stay alive while the pointers below are used
        self.count = len(layers)
        self.pointers = (ctypes.POINTER(native.Layer) * self.count)(*(ctypes.pointer(layer) for layer in layers))
        self.rows = (ctypes.c_void_p * self.count)
        self._buffers: tuple[list[torch.Tensor], list[torch.Tensor], Any, Any] | None = None

    def buffer_rows(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[Any, Any]:
        """The C call's arrays of the layers' K and V buffer pointers: kept for the last cache's lists (a static
        cache's, the same every forward), since 60 data_ptr calls and two arrays cost ~50 us of a decode cold."""
        held = self._buffers
        if held is None or held[0] is not keys or held[1] is not values \
                or held[2][0] != keys[0].data_ptr() or held[3][-1] != values[-1].data_ptr():
            held = self._buffers = (keys, values, self.rows(*(k.data_ptr() for k in keys)),
                                    self.rows(*(v.data_ptr() for v in values)))
        return held[2], held[3]

    def __len__(self) -> int:
        return self.count

    def tap_rows(self, taps: dict[int, torch.Tensor]) -> tuple[Any, int]:
        """The C call's per-layer tap pointers (None for none) and their row stride."""
        if not taps:
            return None, 0
        return (self.rows(*(taps[i].data_ptr() if i in taps else None for i in range(self.count))),
                next(iter(taps.values())).stride(1))

    def run(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
            keys: list[torch.Tensor], values: list[torch.Tensor], taps: dict[int, torch.Tensor]) -> None:
        """Runs every layer on h (1, n, hidden) fp32 in place; cos/signed_sin (n, hd); keys[i]/values[i] (1, kv,
        capacity, hd) fp32 or fp16, row r holding position r. taps[i]: a (1, n, hidden) fp32 view with unit
        column stride (a slice of the tapped states' columns) that gets layer i's output too, all with one row
        stride."""
        tap_rows, stride = self.tap_rows(taps)
        key_rows, value_rows = self.buffer_rows(keys, values)
        done = self.lib.dfq_stack_forward(self.pointers, self.count, h.data_ptr(), h.shape[1], positions.data_ptr(),
                                          cos.data_ptr(), signed_sin.data_ptr(), key_rows, value_rows,
                                          keys[0].shape[2], tap_rows, stride, int(keys[0].dtype == torch.float16))
        if not done:
            raise MemoryError("the C layers' buffers could not be allocated")


class Model(ctypes.Structure):
    """native/layer.c's struct dfq_model."""
    _fields_ = [("hidden", ctypes.c_long), ("vocab", ctypes.c_long), ("embed_codes", ctypes.c_void_p),
                ("embed_d", ctypes.c_void_p), ("embed_dense", ctypes.c_void_p), ("norm", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("head", native.Linear)]


class WholeForward:
    """A forward of the target around its LayerStack as one C call (native/layer.c's dfq_model_forward): the
    embeddings' rows, the stack, the final norm (and the last layer's tap), the LM head; the same kernels in the
    same order as the Python around the stack, so the same bits. Made by whole_forward."""

    def __init__(self, stack: LayerStack, embed: nn.Module, norm: nn.Module, head: Int8ActLinear):
        self.stack, self.embed, self.norm, self.head = stack, embed, norm, head
        weight: Any = norm.weight
        self.struct = made = Model(hidden=int(weight.shape[0]), norm=weight.data_ptr(),
                                   eps=float(getattr(norm, "variance_epsilon")), head=linear_struct(head))
        if isinstance(embed, CodesEmbedding):
            codes = embed.head
            made.embed_codes, made.embed_d, made.vocab = codes.codes.data_ptr(), codes.d.data_ptr(), \
                embed.num_embeddings
        else:
            table: Any = embed.weight
            made.embed_dense, made.vocab = table.data_ptr(), int(table.shape[0])

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 keys: list[torch.Tensor], values: list[torch.Tensor], taps: dict[int, torch.Tensor],
                 last_tap: torch.Tensor | None, last_only: bool, logits: bool) -> torch.Tensor | None:
        """(rows, V) logits or (rows, H) final-normed rows of the tokens ids (1, n) (rows: n, or 1 with
        `last_only`), as LayerStack.run's arguments, `last_tap` the last layer's tap columns (or None); None for
        an id outside the table (the caller's own lookup says so)."""
        stack, n = self.stack, ids.shape[1]
        ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()
        rows = 1 if last_only else n
        out = torch.empty(rows, self.head.padded if logits else self.struct.hidden)
        tap_rows, stride = stack.tap_rows(taps)
        if last_tap is not None:
            stride = last_tap.stride(1)
        key_rows, value_rows = stack.buffer_rows(keys, values)
        done = stack.lib.dfq_model_forward(
            ctypes.byref(self.struct), stack.pointers, stack.count, ids.data_ptr(), n, positions.data_ptr(),
            cos.data_ptr(), signed_sin.data_ptr(), key_rows, value_rows, keys[0].shape[2], tap_rows, stride,
            int(keys[0].dtype == torch.float16), last_tap.data_ptr() if last_tap is not None else None,
            int(last_only), int(logits), out.data_ptr())
        if done < 0:
            return None
        if not done:
            raise MemoryError("the C layers' buffers could not be allocated")
        return out[:, :self.head.out_features] if logits and self.head.padded != self.head.out_features else out


def whole_forward(stack: LayerStack, embed: nn.Module, norm: nn.Module, head: nn.Module,
                  softcap: float | None) -> WholeForward | None:
    """A WholeForward where the C call computes what the Python around the stack does: input embeddings from
    a plain fp32 table or a tied head's codes (CodesEmbedding), a plain fp32 RMSNorm, a q8a8/q4a8 LM head, no
    logit soft-cap; else None."""
    weight = getattr(norm, "weight", None)
    if softcap or not hasattr(stack.lib, "dfq_model_forward") or not isinstance(head, Int8ActLinear):
        return None
    if type(norm).__name__ not in PLAIN_RMS_NORMS or not isinstance(weight, torch.Tensor) \
            or weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    table = getattr(embed, "weight", None)
    dense = type(embed) is nn.Embedding and isinstance(table, torch.Tensor) and table.dtype == torch.float32 \
        and table.is_contiguous() and table.dim() == 2 and table.shape[1] == weight.shape[0]
    if not (dense or isinstance(embed, CodesEmbedding)):
        return None
    return WholeForward(stack, embed, norm, head)


def linear_struct(layer: Int8ActLinear) -> native.Linear:
    """`layer` as a struct dfq_linear of its padded rows (an LM head's vocabulary need not be a multiple of 8)."""
    m = getattr(layer, "m", None)
    return native.Linear(4 if isinstance(layer, Q4A8Linear) else 8, layer.padded, layer.in_features,
                         layer.codes.data_ptr(), layer.d.data_ptr(), m.data_ptr() if m is not None else None,
                         native.ptr(layer.bias))


def _weight(norm: Any) -> tuple[int, float]:
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError
    return weight.data_ptr(), float(norm.eps)


def draft_layer_struct(layer: Any) -> native.DraftLayer | None:
    """A DFlash drafter layer (engine/drafter.DraftLayer) with q8a8/q4a8 linears as native/layer.c's draft
    struct, or None where that C layer cannot run it (a causal or sliding layer, another activation)."""
    attn, mlp = layer.self_attn, layer.mlp
    if layer.causal or layer.window is not None or type(getattr(mlp, "act", None)).__name__ not in SILU:
        return None
    parts = [_linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                  mlp.down_proj)]
    if any(p is None for p in parts) or attn.head_dim % 8 or attn.head_dim > 1024 or parts[3].n % 32:  # type: ignore[union-attr]
        return None
    try:
        (norm1, eps1), (norm2, eps2) = _weight(layer.input_layernorm), _weight(layer.post_attention_layernorm)
        (q_norm, qk_eps), (k_norm, _) = _weight(attn.q_norm), _weight(attn.k_norm)
    except ValueError:
        return None
    return native.DraftLayer(parts[3].n, attn.num_heads, attn.num_kv_heads, attn.head_dim,  # type: ignore[union-attr]
                             parts[4].n, norm1, norm2, q_norm, k_norm, eps1, eps2, qk_eps,  # type: ignore[union-attr]
                             attn.head_dim**-0.5, *parts)


def run_draft_layer(lib: ctypes.CDLL, layer: native.DraftLayer, h: torch.Tensor, ctx: torch.Tensor | None,
                    committed: int, cos: torch.Tensor, signed_sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> None:
    """Runs one drafter layer on the block h (1, B, hidden) in place, with new context rows ctx (1, P, hidden)
    or None, writing K/V at cache rows committed.. (keys/values (1, kv, capacity, hd))."""
    lib.dfq_draft_layer_forward(ctypes.byref(layer), h.data_ptr(), h.shape[1],
                                ctx.data_ptr() if ctx is not None else None, ctx.shape[1] if ctx is not None else 0,
                                committed, cos.data_ptr(), signed_sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                keys.shape[2])


def fuse_drafter(drafter: Any) -> bool:
    """Runs each of a q8a8 drafter's layers (engine/int8act.quantize_drafter) as one C call from now on,
    when every layer can be; whether it does."""
    built = native.library()
    layers = getattr(drafter, "layers", None)
    if built is None or layers is None or not hasattr(drafter, "native_layers"):
        return False
    made = [draft_layer_struct(layer) for layer in layers]
    if any(m is None for m in made):
        return False
    drafter.native_layers = (built.lib, made)
    return True
