"""The target's forward over a StaticCache as one traceable function (`StaticForward`): the decoder layers of
every supported family (engine/fast_layers.py) run on the model's own modules, write K/V into the cache's
buffers (engine/static_cache.py) and return the logits, the tapped hidden states and the linear-attention
layers' records from the same call. engine/fast.py's FastPath builds one per kind of call and compiles the
short ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_cli.engine.cpu import native
from dflash_cli.engine.cpu.c_layers import (
    LayerStack,
    RopeTable,
    WholeForward,
    c_final_norm,
    layer_struct,
    whole_forward,
)
from dflash_cli.engine.cpu.weightonly import WeightOnlyLinear
from dflash_cli.engine.fast_layers import (
    ROW_EXACT_ATTENTION,
    first_attention,
    move,
    norm_fn,
    partial_rope,
    rope_rows,
    row_exact_attention,
)
from dflash_cli.engine.hf_module import HFModule
from dflash_cli.engine.linear_attention import gated_delta_net, is_linear_attention
from dflash_cli.engine.moe import WeightOnlyExperts, route, sparse_moe
from dflash_cli.engine.static_cache import write_rows


class StaticForward(nn.Module):
    """The target's forward over a StaticCache, as one traceable function.

    `forward(ids, positions, key_positions, keys, values, convs, states, ring)` runs tokens `ids` (1, n) at
    absolute `positions` (n,), writes their K/V into the buffers, attends over buffer rows `key_positions`
    (0..L-1, L >= the last position + 1), and returns logits (n, V), the tapped layers' outputs
    (1, n, taps*H) or None, and for each linear-attention layer (hybrid targets) the tensors of its
    BlockRecord (the layer reads `convs`/`states` and writes nothing). `ring` is the cache's slot map when
    its sliding-window layers keep a ring (StaticCache): those layers write row p % R and attend over all
    R rows, masked by the positions the rows hold. A batch of b sequences runs as ids (b, n) with positions
    (b, n), each row its own, against buffers of b rows (logits (b*n, V), taps (b, n, taps*H)): batched
    generation of training data, on layers without linear attention.

    Attention folds each key/value head's group of query heads into its rows, (1, kv, group*n, hd), so the
    fused attention kernels run without repeating K/V or a grouped-query fallback (in bf16 on a CPU, 4x
    faster per call); the mask is the (n, L) causal mask repeated per group. Every call attends over the
    same bucketed key window with a mask, 1-token decodes too: an unmasked decode over exactly its keys
    measured 20% faster per attention call but rounds differently in bf16 from the masked block verify, and
    greedy speculative decoding must equal greedy plain decoding.

    Layers may differ (Gemma 4): each has its own K/V shape, rotary table (one per layer type), window
    (a sliding layer's query sees the keys less than `sliding_window` positions behind it, transformers'
    rule) and so its own mask, one per (window, group, ring) computed once per call. Gemma's layers also
    norm the values (an RMSNorm without weight), take the values from the key projection where there is
    no v_proj, norm each sublayer's output before its residual (post_attention_layernorm,
    pre/post_feedforward_layernorm), add a mixture of experts beside the MLP (the layer's own router and
    experts), scale the layer's output (layer_scalar), and soft-cap the logits; their embedding module
    scales by sqrt(hidden) itself.
    """

    def __init__(self, model: HFModule, taps: list[int], projections: nn.ModuleList, lm_head: nn.Module, *,
                 last_logit_only: bool = False, devices: Sequence[torch.device] | None = None,
                 row_exact: bool = False, ring: tuple[int, int] | None = None, native_attention: bool = False,
                 logits: bool = True):
        super().__init__()
        self.logits = logits  # False: return the final-normed rows, for logits_of() to finish row by row
        self.row_exact = row_exact  # short calls attend through row_exact_attention
        decoder = model.get_decoder()
        config = decoder.config  # the text model's (a multimodal class nests it)
        self.embed = model.get_input_embeddings()
        self.layers = decoder.layers
        self.projections = projections
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm
        self.lm_head = lm_head
        self.taps = list(taps)
        self.last_logit_only = last_logit_only
        attn = first_attention(model)
        self.head_dim = attn.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        # Qwen3.5's attention doubles q_proj: a query and a sigmoid gate on the output per head
        self.gated = attn.q_proj.out_features == 2 * self.heads * self.head_dim
        # Gemma 4 keeps a rotary table per layer type (sliding: default rope; global: proportional, wider)
        per_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.input_norms = [norm_fn(layer.input_layernorm) for layer in self.layers]
        self.post_norms = [norm_fn(layer.post_attention_layernorm) for layer in self.layers]
        self.final_norm = norm_fn(self.norm)
        self.qk_norms = [(norm_fn(layer.self_attn.q_norm), norm_fn(layer.self_attn.k_norm))
                         if hasattr(getattr(layer, "self_attn", None), "q_norm") else None for layer in self.layers]
        # per attention layer: (kv heads, head dim), attention scale, rotary key, mask key (window, query
        # group, in the ring), value norm; Gemma's sandwich-normed layers (a norm before each residual)
        self.shapes: list[tuple[int, int]] = []
        self.scalings: list[float] = []
        self.rope_keys: list[str | None] = []
        self.kinds: list[tuple[int | None, int, bool]] = []
        self.v_norms: list[Any] = []
        self.sandwich = [hasattr(layer, "pre_feedforward_layernorm") for layer in self.layers]
        for layer in self.layers:
            a = getattr(layer, "self_attn", None)
            if is_linear_attention(layer) or a is None:
                self.shapes.append((0, 0))
                self.scalings.append(self.scaling)
                self.rope_keys.append(None)
                self.kinds.append((None, 1, False))
                self.v_norms.append(None)
                continue
            hd = a.head_dim
            kv = a.k_proj.out_features // hd
            window = getattr(a, "sliding_window", None) or None
            self.shapes.append((kv, hd))
            self.scalings.append(getattr(a, "scaling", hd**-0.5))
            self.rope_keys.append(getattr(a, "layer_type", None) if per_type else None)
            self.kinds.append((window, self.heads // kv, ring is not None and window == ring[1]))
            self.v_norms.append(getattr(a, "v_norm", None))
        attention = [i for i, layer in enumerate(self.layers) if not is_linear_attention(layer)]
        self.rope_set = sorted({self.rope_keys[i] for i in attention}, key=str)
        self.kind_set = sorted({self.kinds[i] for i in attention}, key=str)
        # one rope table of head_dim channels and one K/V shape for all: q4/q8 rope q|k at once
        self.uniform = len(self.rope_set) == 1 and {self.shapes[i] for i in attention} == {(self.kv_heads,
                                                                                          self.head_dim)}
        self.pre_ffn_norms: list[Any] = [norm_fn(layer.pre_feedforward_layernorm) if s else None
                                         for layer, s in zip(self.layers, self.sandwich)]
        self.post_ffn_norms: list[Any] = [norm_fn(layer.post_feedforward_layernorm) if s else None
                                          for layer, s in zip(self.layers, self.sandwich)]
        # under a device map each layer runs where its weights are; the rest (embeddings, norm, LM head) on
        # the hot device, where the caller's ids and the drafter are
        self.devices = list(devices) if devices is not None else None
        self._use_c_kernels(native_attention, projections)

    def _use_c_kernels(self, native_attention: bool, projections: nn.ModuleList) -> None:
        """q4a8/q8a8 (fp32 activations): short calls attend through the project's C kernel instead, row-exact
        in fp32 where torch's matmuls are not (engine/cpu/native.py; head dims in multiples of 8); Llama-style
        layers run as one C call for the whole stack (engine/cpu/c_layers.py) when every layer can, outside a
        device map."""
        built = native.library() if native_attention else None
        self.native = built.lib if built is not None and all(hd % 8 == 0 for _, hd in self.shapes) else None
        self.fused: LayerStack | None = None
        if self.native is not None and self.devices is None:
            made = [layer_struct(layer, proj, heads=self.heads, kv=self.kv_heads, hd=self.head_dim,
                                 scale=self.scaling) for layer, proj in zip(self.layers, projections)]
            if all(m is not None for m in made) and self.uniform:
                self.fused = LayerStack(self.native, made)  # type: ignore[arg-type]
        self.rope_table = RopeTable(self.rotary) if self.fused is not None else None  # (CPU)
        self.whole: WholeForward | None = None
        if self.fused is not None and self.native is not None:
            self.final_norm = c_final_norm(self.native, self.norm, self.final_norm)
            self.whole = whole_forward(self.fused, self.embed, self.norm, self.lm_head, self.softcap)

    def _call_tables(self, h: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
                     ring: torch.Tensor | None):
        """Per call, not per layer: the ring's slots, the rotary tables per layer type, the masks per kind of
        layer, and for row-exact calls the blocked keys and q|k rope tables."""
        n = positions.shape[-1]
        rows_at = positions if positions.dim() == 2 else positions[None]  # (batch rows or 1, n)
        slots = None
        if ring is not None:  # the ring's rows now hold these positions (masks below read it)
            slots = positions % ring.shape[0]
            ring.index_copy_(0, slots, positions)
        ropes: dict[str | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for key in self.rope_set:
            cos, sin = self.rotary(h, rows_at) if key is None else self.rotary(h, rows_at, key)
            cos, sin = cos[:, :, None], sin[:, :, None]  # (b, n, 1, rotary): rope before the heads move forward
            half = cos.shape[-1] // 2
            ropes[key] = (cos, sin, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1))  # rope_rows' sin
        after = rows_at[:, :, None] - key_positions  # (b, n, L): how far each key is behind each query
        masks: dict[tuple[int | None, int, bool], torch.Tensor] = {}
        for window, group, in_ring in self.kind_set:
            if in_ring:
                assert ring is not None and window is not None
                behind = rows_at[:, :, None] - ring  # (b, n, R); rows holding no position are far ahead
                seen = (behind >= 0) & (behind < window)
            else:
                seen = after >= 0 if window is None else (after >= 0) & (after < window)
            masks[(window, group, in_ring)] = seen.repeat(1, group, 1)[:, None]  # (b, 1, group*n, keys)
        exact = None
        # A batch of sequences (batched generation) attends through row_exact_attention too: for many rows of a
        # few queries each, torch's fused CPU kernel measured 2-3x slower than its matmuls.
        if (self.row_exact and n <= ROW_EXACT_ATTENTION) or rows_at.shape[0] > 1:
            # per call, not per layer: the blocked keys, and rope tables for q|k at once with the attention
            # scale folded into q's (so a plain layer ropes and scales q and k in four ops)
            qk_rope = None
            cos, _, signed = ropes[self.rope_set[0]]
            if self.uniform and cos.shape[-1] == self.head_dim:
                qk_rope = tuple(torch.cat([t.expand(-1, n, self.heads, -1) * self.scaling,
                                           t.expand(-1, n, self.kv_heads, -1)], dim=2) for t in (cos, signed))
            exact = ({kind: ~mask for kind, mask in masks.items()}, qk_rope)
        return slots, ropes, masks, exact

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], convs: Sequence[torch.Tensor] = (),
                states: Sequence[torch.Tensor] = (), ring: torch.Tensor | None = None):
        if self.fused is not None and ids.shape[0] == 1 and ring is None:
            return self.fused_forward(ids, positions, keys, values)
        h = self.embed(ids)  # (b, n, H)
        slots, ropes, masks, exact = self._call_tables(h, positions, key_positions, ring)
        hot = here = h.device
        # the per-call inputs of the layers, copied once per forward to each device that needs them
        inputs: dict[torch.device, Any] = {hot: (positions, key_positions, masks, ropes, slots)}
        wanted = set(self.taps)
        tapped: dict[int, torch.Tensor] = {}
        records: list[tuple[torch.Tensor, ...]] = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if self.devices is not None and self.devices[i] != here:  # a device boundary: move once
                here = self.devices[i]
                h = move(h, here)
                if here not in inputs:
                    inputs[here] = _moved(inputs[hot], here)
            at, keys_at, masks_at, ropes_at, slots_at = inputs[here]
            proj: Any = self.projections[i]  # the layer's layer_projections() ModuleDict
            x = self.input_norms[i](h)
            if is_linear_attention(layer):
                j = len(records)
                out, record = gated_delta_net(layer.linear_attn, proj, x, convs[j], states[j])
                records.append((record.s0, record.k, record.cum_g, record.delta, record.conv_tail))
            else:
                kind = self.kinds[i]
                out = self._attention(i, proj, x, slots_at if kind[2] else at, keys_at, masks_at[kind],
                                      ropes_at[self.rope_keys[i]], keys[i], values[i],
                                      exact[0][kind] if exact is not None else None,
                                      exact[1] if exact is not None else None)
            if self.sandwich[i]:
                h = self._sandwich(i, layer, proj, h, out, exact is not None)
            else:
                h = h + out
                x = self.post_norms[i](h)
                if "gate_up" in proj:
                    gate, up = proj["gate_up"](x)
                    h = h + proj["down"](layer.mlp.act_fn(gate) * up)
                elif isinstance(getattr(layer.mlp, "experts", None), WeightOnlyExperts):  # q4/q8 experts
                    h = h + sparse_moe(layer.mlp, x, proj, exact is not None)
                else:  # a mixture of experts
                    h = h + layer.mlp(x)
            if i in wanted:
                # transformers' hidden_states[-1] is after the final norm: tap the same thing. Taps are
                # gathered on the hot device (the drafter's), each moved once.
                tap = h if here == hot else move(h, hot)
                tapped[i] = self.final_norm(tap) if i == last else tap
        if here != hot:
            h = move(h, hot)
        return self._head(h, torch.cat([tapped[i] for i in self.taps], dim=-1) if self.taps else None, records)

    def _head(self, h: torch.Tensor, hidden: torch.Tensor | None, records: list[tuple[torch.Tensor, ...]]):
        if self.last_logit_only:
            h = h[:, -1:]
        normed = self.final_norm(h).flatten(0, 1)  # (b*n, H)
        return (self.logits_of(normed) if self.logits else normed), hidden, records

    def logits_of(self, normed: torch.Tensor) -> torch.Tensor:
        """(rows, V) logits of final-normed rows (rows, H); a 2-D input keeps CPU bf16 on the plain matmul."""
        logits = self.lm_head(normed)
        if self.softcap:  # Gemma: cap * tanh(logits / cap), as transformers' forward
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def fused_forward(self, ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                      values: list[torch.Tensor], start: int | None = None):
        """forward() with the whole stack of layers one C call (engine/cpu/c_layers.py), on one sequence (no ring,
        no linear attention); `start`: positions is start.. in a run (two tensor reads fewer)."""
        assert self.fused is not None and self.native is not None
        assert self.rope_table is not None
        positions = positions.contiguous()
        n = positions.shape[0]
        lo = int(positions[0]) if start is None else start
        if start is not None or int(positions[-1]) == lo + n - 1:  # (1, n, hd) rows of the tables of every position
            cos, signed = self.rope_table.rows(lo, lo + n)
        else:  # (not a run of positions: this call's own)
            cos, signed = self.rope_table.for_positions(positions)
        size, last = int(self.norm.weight.shape[0]), len(self.layers) - 1
        # the tapped states (1, n, taps * H), each tap layer's output written into its columns inside the call
        hidden = torch.empty(1, n, len(self.taps) * size, dtype=torch.float32) if self.taps else None
        columns = {i: hidden[..., j * size:(j + 1) * size] for j, i in enumerate(self.taps)} if hidden is not None \
            else {}
        taps = {i: c for i, c in columns.items() if i != last}
        if self.whole is not None:  # the embeddings, the stack, the final norm and the head: one C call
            out = self.whole(ids, positions, cos, signed, keys, values, taps, columns.get(last), self.last_logit_only,
                             self.logits)
            if out is not None:
                return out, hidden, []
        h = self.embed(ids).contiguous()  # (1, n, H) fp32, updated in place by each layer
        self.fused.run(h, positions, cos, signed, keys, values, taps)
        if last in columns:  # transformers' hidden_states[-1] is after the final norm
            columns[last].copy_(self.final_norm(h))
        return self._head(h, hidden, [])

    def _sandwich(self, i: int, layer: Any, proj: Any, h: torch.Tensor, attended: torch.Tensor,
                  exact: bool = False) -> torch.Tensor:
        """The rest of a Gemma 4 decoder layer after its attention, as transformers computes it: each
        sublayer's output normed before its residual, the mixture of experts (when the layer has one) on
        the post-attention hidden state beside the MLP, then the layer's scalar. `exact`: a row-exact call,
        whose router runs row by row (engine/moe.py)."""
        h = h + self.post_norms[i](attended)
        x = self.pre_ffn_norms[i](h)
        if "gate_up" in proj:
            gate, up = proj["gate_up"](x)
            mlp = proj["down"](layer.mlp.act_fn(gate) * up)
        else:
            mlp = layer.mlp(x)
        if getattr(layer, "enable_moe_block", False):
            flat = h.reshape(-1, h.shape[-1])
            _, weights, experts = route(layer.router, flat, exact)
            moe = layer.experts(layer.pre_feedforward_layernorm_2(flat), experts, weights).reshape(h.shape)
            mlp = layer.post_feedforward_layernorm_1(mlp) + layer.post_feedforward_layernorm_2(moe)
        h = h + self.post_ffn_norms[i](mlp)
        scalar = getattr(layer, "layer_scalar", None)
        return (h * scalar).to(h.dtype) if scalar is not None else h  # transformers multiplies in place

    def _attention(self, i, proj, x, write_at, key_positions, mask, rope, keys, values, blocked=None,
                   qk_rope=None):
        b, n, heads = x.shape[0], x.shape[1], self.heads
        kv, hd = self.shapes[i]
        qkv, scale = proj["qkv"], self.scalings[i]
        if (qk_rope is not None and self.qk_norms[i] is None and not self.gated
                and isinstance(qkv, WeightOnlyLinear)):
            y = qkv.whole(x)  # (b, n, (heads + 2 kv) * hd): q and k side by side, roped (and q scaled) at once
            qk = rope_rows(y[..., :(heads + kv) * hd].view(b, n, heads + kv, hd), *qk_rope)
            q, k, v = qk[:, :, :heads], qk[:, :, heads:], y[..., (heads + kv) * hd:]
            return self._attend(i, proj, q, k, v, write_at, key_positions, mask, keys, values, blocked, 1.0)
        q, k, *rest = qkv(x)
        v = rest[0] if rest else k  # no v_proj (Gemma 4's global layers): the values are the raw keys
        gate = None
        if self.gated:
            q, gate = q.reshape(b, n, -1, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(b, n, -1)
        q = q.reshape(b, n, heads, hd)
        k = k.reshape(b, n, kv, hd)
        qk_norms = self.qk_norms[i]
        if qk_norms is not None:
            q, k = qk_norms[0](q), qk_norms[1](k)
        v_norm = self.v_norms[i]
        if v_norm is not None:
            v = v_norm(v.reshape(b, n, kv, hd))
        cos, sin, signed = rope
        if cos.shape[-1] == hd:
            q, k = rope_rows(q, cos, signed), rope_rows(k, cos, signed)
        else:  # partial rotary (Qwen3.5): the first cos.shape[-1] channels
            q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
        return self._attend(i, proj, q, k, v, write_at, key_positions, mask, keys, values, blocked, scale, gate)

    def _attend(self, i, proj, q, k, v, write_at, key_positions, mask, keys, values, blocked, scale, gate=None):
        """Writes k, v (b, n, kv, hd) into the cache rows `write_at` and attends q (b, n, heads, hd) over the
        key window (a ring layer: all its rows)."""
        b, n, heads = q.shape[0], q.shape[1], self.heads
        kv, hd = self.shapes[i]
        write_rows(keys, write_at, k.transpose(1, 2))
        write_rows(values, write_at, v.reshape(b, n, kv, hd).transpose(1, 2))
        rows = keys.shape[2] if self.kinds[i][2] else key_positions.shape[0]
        # (b, n, heads, hd) -> (b, kv, group*n, hd): query head h belongs to key/value head h // group
        if self.native is not None and blocked is not None and b == 1 and not self.kinds[i][2]:
            # q4a8/q8a8: fp32 attention row-exact in C, read and written in the projections' layouts
            out = native.attention(self.native, q, keys, values, write_at, self.kinds[i][0], scale)
            return proj["o"](out * torch.sigmoid(gate) if gate is not None else out)
        folded = q.reshape(b, n, kv, heads // kv, hd).permute(0, 2, 3, 1, 4).reshape(b, kv, -1, hd)
        # an fp16 cache (FastPath.cache_dtype) read back in the queries' dtype: the values the C attention reads
        seen_k, seen_v = keys[:, :, :rows].to(q.dtype), values[:, :, :rows].to(q.dtype)
        if blocked is not None:
            out = row_exact_attention(folded, seen_k, seen_v, blocked, scale)
        else:
            out = F.scaled_dot_product_attention(folded, seen_k, seen_v, attn_mask=mask, scale=scale)
        out = out.reshape(b, kv, heads // kv, n, hd).permute(0, 3, 1, 2, 4).reshape(b, n, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return proj["o"](out)


def _moved(inputs: Any, device: torch.device) -> Any:
    """A forward's per-call inputs (tensors inside tuples and dicts) copied to `device` through move()."""
    if isinstance(inputs, torch.Tensor):
        return move(inputs, device)
    if isinstance(inputs, dict):
        return {k: _moved(v, device) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(_moved(v, device) for v in inputs)
    return inputs
