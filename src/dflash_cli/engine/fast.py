"""The target's fast path: a static KV cache and one forward that can be compiled once per block length.

transformers' own forward rebuilds masks, caches and keyword plumbing on every call, and its dynamic cache
grows by concatenation; that per-call work dominates a 1-token decode (docs/engine.md, "The fast path").
Here the target's decoder layers run through one small function of (token ids, positions, key positions,
cache buffers) that reuses the model's own modules (norms, projections, rotary embedding, MLP), writes K/V
into preallocated buffers with `index_copy_`, and returns the logits and the tapped hidden states from the
same call, with no hooks. Rolling back rejected drafts is a length update: K/V past the committed length
are stale but never attended, because every query sees only keys at positions <= its own, and each
position is rewritten before a query at or after it runs.

Supported: decoder layers shaped like Llama's (Llama, Qwen2, Qwen3, Mistral without a sliding window):
full causal attention with q/k/v/o projections, optional per-head q/k norms, rotary embeddings. Other
targets keep the transformers path (`fast_path_unsupported` says why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_cli.engine.drafter import apply_rope
from dflash_cli.engine.packed import PackedLinear, Parallel, room_to_pack

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


class StaticCache:
    """Per-layer K/V buffers of a fixed capacity, allocated once; `length` is a host int.

    Buffers start zeroed so that masked-out rows are finite (a NaN times a zero attention weight is NaN).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, *,
                 dtype: torch.dtype, device: torch.device):
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        """Forgets positions >= length: a length update, nothing is copied or freed."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length


def fast_path_unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot take the fast path, or None when it can."""
    config = model.config
    if getattr(config, "model_type", None) not in FAMILIES:
        return f"model type {getattr(config, 'model_type', None)!r} (fast path: {', '.join(FAMILIES)})"
    # Qwen2 gates its window with use_sliding_window; Mistral applies sliding_window whenever it is set
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if window or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window attention"
    decoder = model.get_decoder()
    if not hasattr(decoder, "rotary_emb") or not hasattr(decoder, "norm"):
        return f"{type(decoder).__name__} has no rotary_emb or final norm"
    for layer in decoder.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"{type(layer).__name__} is not a Llama-style decoder layer"
        if not all(hasattr(layer, m) for m in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return f"{type(layer).__name__} is not a Llama-style decoder layer"
        if not all(hasattr(layer.mlp, m) for m in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"{type(layer.mlp).__name__} is not a gated MLP"
    return None


def layer_projections(layer: nn.Module, pack: bool) -> nn.ModuleDict:
    """A Llama-style layer's linear maps as qkv -> (q, k, v), o, gate_up -> (gate, up), down; packed by
    oneDNN (q|k|v and gate|up fused) when `pack` and it works here, else the layer's own modules."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = dict(qkv=(attn.q_proj, attn.k_proj, attn.v_proj), o=(attn.o_proj,),
                  gate_up=(mlp.gate_proj, mlp.up_proj), down=(mlp.down_proj,))
    out = {}
    for name, linears in groups.items():
        packed = PackedLinear.pack(*linears) if pack else None
        out[name] = packed or (linears[0] if len(linears) == 1 else Parallel(*linears))
    return nn.ModuleDict(out)


class StaticForward(nn.Module):
    """The target's forward over a StaticCache, as one traceable function.

    `forward(ids, positions, key_positions, keys, values)` runs tokens `ids` (1, n) at absolute `positions`
    (n,), writes their K/V into the buffers, attends over buffer rows `key_positions` (0..L-1, L >= the
    last position + 1), and returns logits (n, V) and the tapped layers' outputs (1, n, taps*H) or None.
    """

    def __init__(self, model: nn.Module, taps: list[int], projections: nn.ModuleList, lm_head: nn.Module, *,
                 last_logit_only: bool = False):
        super().__init__()
        decoder = model.get_decoder()
        self.embed = model.get_input_embeddings()
        self.layers = decoder.layers
        self.projections = projections
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm
        self.lm_head = lm_head
        self.taps = list(taps)
        self.last_logit_only = last_logit_only
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor]):
        n = ids.shape[1]
        kv_len = key_positions.shape[0]
        h = self.embed(ids)  # (1, n, H)
        cos, sin = self.rotary(h, positions[None])  # (1, n, hd)
        cos, sin = cos[:, None], sin[:, None]
        mask = (key_positions[None, :] <= positions[:, None])[None, None]  # (1, 1, n, L)
        wanted = set(self.taps)
        tapped: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn, proj = layer.self_attn, self.projections[i]
            x = layer.input_layernorm(h)
            q, k, v = proj["qkv"](x)
            q = q.reshape(1, n, -1, self.head_dim)
            k = k.reshape(1, n, -1, self.head_dim)
            v = v.reshape(1, n, -1, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (1, heads, n, hd)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys[i].index_copy_(2, positions, k)
            values[i].index_copy_(2, positions, v)
            out = F.scaled_dot_product_attention(
                q, keys[i][:, :, :kv_len], values[i][:, :, :kv_len], attn_mask=mask, scale=self.scaling,
                enable_gqa=q.shape[1] != k.shape[1])
            h = h + proj["o"](out.transpose(1, 2).reshape(1, n, -1))
            x = layer.post_attention_layernorm(h)
            gate, up = proj["gate_up"](x)
            h = h + proj["down"](layer.mlp.act_fn(gate) * up)
            if i in wanted:
                # transformers' hidden_states[-1] is after the final norm: tap the same thing.
                tapped[i] = self.norm(h) if i == last else h
        if self.last_logit_only:
            h = h[:, -1:]
        logits = self.lm_head(self.norm(h)[0])  # (n, V); a 2-D input keeps CPU bf16 on the plain matmul
        hidden = torch.cat([tapped[i] for i in self.taps], dim=-1) if self.taps else None
        return logits, hidden


class FastPath:
    """Static caches plus the forwards that run on them: eager for prompts, compiled (when given a compiler)
    for the short calls of the loop, padded up to a few fixed lengths so that few shapes get compiled.

    Args:
        model: a supported transformers causal LM (see fast_path_unsupported).
        context: positions a sequence may hold (prompt + reply).
        pad_to: the longest short call (the drafter's block size); caches get that many spare rows, since a
            padded call writes K/V past the sequence's end (stale rows, never attended).
        compile_step: turns a StaticForward into the callable that runs short calls, or None (eager).
        on_fallback: told once, in one line, when compiling fails and the eager forward takes over.
    """

    def __init__(self, model: nn.Module, context: int, *, pad_to: int = 1,
                 compile_step: Callable[[nn.Module], Callable[..., Any]] | None = None,
                 on_fallback: Callable[[str], None] | None = None):
        attn = model.get_decoder().layers[0].self_attn
        self.model = model
        self.context = context
        # one spare row: the attended window (key_positions) then never spans the whole buffer, which
        # compiled code would specialise to a constant
        self.capacity = context + _bucket(max(pad_to, 1)) + 1
        self.num_layers = len(model.get_decoder().layers)
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.head_dim = attn.head_dim
        self.dtype = model.get_input_embeddings().weight.dtype
        self.device = model.get_input_embeddings().weight.device
        self.compile_step = compile_step
        self.on_fallback = on_fallback
        # Eager CPU runs use oneDNN-packed weights (a second copy, when memory allows); compiled code leaves
        # the weights to the compiler.
        self.packed = pack = compile_step is None and room_to_pack(model)
        self.projections = nn.ModuleList(layer_projections(layer, pack) for layer in model.get_decoder().layers)
        head = model.get_output_embeddings()
        self.lm_head = (PackedLinear.pack(head) if pack else None) or head
        self.fallback_reason: str | None = None
        self.taps: list[int] = []
        self._eager: dict[tuple[bool, bool], StaticForward] = {}
        self._compiled: dict[bool, Callable[..., Any]] = {}

    @property
    def compiled(self) -> bool:
        return self.compile_step is not None and self.fallback_reason is None

    def set_taps(self, taps: list[int]) -> None:
        self.taps = list(taps)
        self._eager.clear()
        self._compiled.clear()

    def new_cache(self) -> StaticCache:
        cache = StaticCache(self.num_layers, self.kv_heads, self.head_dim, self.capacity, dtype=self.dtype,
                            device=self.device)
        if self.compiled and self.device.type == "cuda":  # CUDA graphs read the buffers where they are
            for buf in cache.keys + cache.values:
                torch._dynamo.mark_static_address(buf)
        return cache

    def precompile(self, *, taps: bool, max_block: int) -> None:
        """Runs every short call the loop can make once (decode 1; blocks padded to 2, 4, .. max_block), so
        compilation happens now and not in the middle of a reply."""
        cache = self.new_cache()
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.forward(ids, cache, 0, taps=False, last_logit_only=True)
        sizes = sorted({_bucket(n) for n in range(1, max_block + 1)})
        for with_taps in sorted({False, taps}):
            for size in sizes:
                if not self.compiled:
                    return
                self.forward(ids.expand(1, size).contiguous(), cache, 1, taps=with_taps, last_logit_only=False)

    def _module(self, taps: bool, last_logit_only: bool) -> StaticForward:
        key = (taps, last_logit_only)
        if key not in self._eager:
            self._eager[key] = StaticForward(self.model, self.taps if taps else [], self.projections, self.lm_head,
                                             last_logit_only=last_logit_only)
        return self._eager[key]

    def forward(self, ids: torch.Tensor, cache: StaticCache, start: int, *, taps: bool,
                last_logit_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs ids (1, n) at positions start..start+n-1; the cache then holds start+n positions.

        Returns logits (n, V) (or (1, V) with last_logit_only) and, with taps, the tapped states (1, n, F).
        """
        n = ids.shape[1]
        end = start + n
        if end > self.context:
            from dflash_cli.engine.errors import InvalidSettingError

            raise InvalidSettingError(f"the sequence needs {end} positions, the cache holds {self.context}",
                                      hint="raise --max-context")
        with torch.inference_mode():
            out = None
            if self.compiled and not last_logit_only and _bucket(n) < self.capacity - self.context:
                out = self._run_compiled(ids, cache, start, taps)
            if out is None:
                positions = torch.arange(start, end, device=ids.device)
                keys_at = key_positions(end, cache.capacity - 1, ids.device)
                out = self._module(taps, last_logit_only)(ids, positions, keys_at, cache.keys, cache.values)
        cache.length = end
        return out

    def _run_compiled(self, ids: torch.Tensor, cache: StaticCache, start: int, taps: bool):
        """A short call padded to the next power of two; None when compiling failed (eager takes over)."""
        n = ids.shape[1]
        size = _bucket(n)
        if size > n:  # pad with the last token; its logits, states and K/V rows are never used
            ids = torch.cat([ids, ids[:, -1:].expand(1, size - n)], dim=1)
        positions = torch.arange(start, start + size, device=ids.device)
        keys_at = key_positions(start + size, self.capacity - 1, ids.device)
        torch._dynamo.maybe_mark_dynamic(keys_at, 0)
        step = self._compiled.get(taps)
        if step is None:
            step = self._compiled[taps] = self.compile_step(self._module(taps, False))
        try:
            logits, hidden = step(ids, positions, keys_at, cache.keys, cache.values)
        except Exception as e:  # noqa: BLE001 - any compiler failure: say so once and run eagerly
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.fallback_reason = f"{type(e).__name__}: {first}"[:200]
            if self.on_fallback is not None:
                self.on_fallback(f"compilation failed ({self.fallback_reason}); running uncompiled")
            return None
        logits, hidden = logits[:n], (hidden[:, :n] if hidden is not None else None)
        if self.device.type == "cuda":  # a CUDA graph's outputs are overwritten by its next replay
            logits, hidden = logits.clone(), (hidden.clone() if hidden is not None else None)
        return logits, hidden


def _bucket(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


def key_positions(length: int, most: int, device: torch.device, minimum: int = 256) -> torch.Tensor:
    """Rows 0..L-1 to attend over: L is `length` rounded up to a power of two (at least `minimum`, at most
    `most`), so attention reads what the sequence needs, not the whole buffer."""
    return torch.arange(min(max(_bucket(length), minimum), most), device=device)
