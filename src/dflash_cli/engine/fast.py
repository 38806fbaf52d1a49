"""The target's fast path: a static KV cache and one forward that can be compiled once per block length.

transformers' own forward rebuilds masks, caches and keyword plumbing on every call, and its dynamic cache
grows by concatenation; that per-call work dominates a 1-token decode (docs/engine.md, "The fast path").
Here the target's decoder layers run through one small function of (token ids, positions, key positions,
cache buffers) that reuses the model's own modules (norms, projections, rotary embedding, MLP), writes K/V
into preallocated buffers with `index_copy_`, and returns the logits and the tapped hidden states from the
same call, with no hooks. Rolling back rejected drafts is a length update: K/V past the committed length
are stale but never attended, because every query sees only keys at positions <= its own, and each
position is rewritten before a query at or after it runs.

Supported: decoder layers shaped like Llama's (Llama, Qwen2, Qwen3, Mistral without a sliding window, and
Qwen3-MoE): full causal attention with q/k/v/o projections, optional per-head q/k norms, rotary embeddings;
and the Qwen3.5 and Qwen3-Next hybrids, whose attention layers add an output gate and partial rotary
embeddings and whose Gated DeltaNet layers keep a recurrent state that rolls back exactly
(engine/linear_attention.py; their mixtures of experts have a shared expert); and Gemma 4 (sliding-window
and global layers of different shapes, sandwich norms, soft-capped logits; StaticForward), whose sliding
layers keep a ring of K/V rows in long contexts (StaticCache). Mixtures of experts run as transformers'
modules, or under q4/q8 with 4/8-bit experts and row-by-row routing (engine/moe.py). Other targets keep the
transformers path (`fast_path_unsupported` says why).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_cli.engine import native
from dflash_cli.engine.config import PREFILL_CHUNK
from dflash_cli.engine.drafter import apply_rope
from dflash_cli.engine.errors import RollbackError
from dflash_cli.engine.fused import PLAIN_RMS_NORMS, layer_struct, run_layer
from dflash_cli.engine.hf_module import HFModule
from dflash_cli.engine.int8act import INT8_ACT_QUANTS
from dflash_cli.engine.linear_attention import (
    CHUNK,
    BlockRecord,
    conv_after,
    gated_delta_net,
    is_linear_attention,
    linear_projections,
    state_after,
)
from dflash_cli.engine.moe import WeightOnlyExperts, quantize_experts, route, sparse_moe
from dflash_cli.engine.packed import PackedLinear, Parallel, room_to_pack
from dflash_cli.engine.pairing import HYBRID_MODEL_TYPES
from dflash_cli.engine.weightonly import Q4Codes, WeightOnlyLinear, quantize_linears

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# Llama-style layers whose MLP may be a mixture of experts (Qwen3-MoE: Qwen3-Coder-30B-A3B), run as its own
# module, or under q4/q8 with 4/8-bit experts (engine/moe.py)
MOE_FAMILIES = ("qwen3_moe",)
HYBRID_FAMILIES = HYBRID_MODEL_TYPES
# Gemma 4 (26B-A4B, 31B): sliding-window and global layers of different shapes, sandwich norms, an optional
# mixture of experts beside the MLP, soft-capped logits (StaticForward)
GEMMA_FAMILIES = ("gemma4", "gemma4_text")


class StaticCache:
    """Per-layer K/V buffers of a fixed capacity, allocated once; `length` is a host int.

    Buffers start zeroed so that masked-out rows are finite (a NaN times a zero attention weight is NaN).
    Linear-attention layers (hybrid targets) keep their state in `LinearStates` instead.

    Layers may differ in shape (`layer_shapes`: Gemma 4's global layers have fewer, wider K/V heads than its
    sliding-window layers). Sliding-window layers of a long context keep their K/V in a ring (`ring`: a
    buffer of R rows where position p lives in row p % R, and `ring[r]` says which position row r holds,
    FAR when none): a query sees the `window` positions up to its own, R = window + 2 * slack, so a forward
    of up to `slack` tokens overwrites only positions no query after the last committed one reads, and the
    other `slack` rows let the sequence return up to `slack` positions behind the newest write
    (`reachable`). Every row a query may see at position p was written at or before p, as in the
    full-length buffers.

    `batch` > 1 holds that many independent sequences, one per batch row (batched generation of training
    data, train/batched.py: `FastPath.forward_rows`); `length` then means nothing, each row's is the caller's.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, *,
                 dtype: torch.dtype, device: torch.device | Sequence[torch.device],
                 linear: LinearStates | None = None, attention_layers: set[int] | None = None,
                 layer_shapes: Sequence[tuple[int, int, int]] | None = None,
                 ring: torch.Tensor | None = None, window: int | None = None, batch: int = 1):
        # one device for all layers, or each layer's own (a target split over devices)
        self.devices = list(device) if isinstance(device, Sequence) else [device] * num_layers

        def buffer(i: int) -> torch.Tensor:
            # (kv heads, head dim, rows) of layer i: the model's own, or all layers alike
            heads, dim, rows = layer_shapes[i] if layer_shapes is not None else (kv_heads, head_dim, capacity)
            rows = rows if attention_layers is None or i in attention_layers else 0
            return torch.zeros((batch, heads, rows, dim), dtype=dtype, device=self.devices[i])

        self.keys = [buffer(i) for i in range(num_layers)]
        self.values = [buffer(i) for i in range(num_layers)]
        self.capacity = capacity
        self.length = 0
        self.linear = linear
        self.ring, self.window = ring, window
        self.written = 0  # positions < written have been written since the cache was emptied (ring bound)
        self.owner = 0  # the DecodeState holding this cache (engine/state.py)

    def get_seq_length(self) -> int:
        return self.length

    def reachable(self, length: int) -> int:
        """The longest prefix of at most `length` positions that crop() can return to."""
        if self.linear is not None:
            return self.linear.reachable(min(length, self.length))
        if self.ring is not None and self.window is not None and self.written > self.ring.shape[0]:
            # the ring holds positions written-R..written-1: the window before `length` must be among them
            return length if length - self.window >= self.written - self.ring.shape[0] else 0
        return length

    def crop(self, length: int) -> None:
        """Forgets positions >= length: a length update, nothing is copied or freed."""
        assert 0 <= length <= self.length, (length, self.length)
        if self.linear is not None and length < self.length:
            self.linear.crop(length)
        if self.ring is not None and self.reachable(length) != length:
            raise RollbackError(f"the sliding-window ring no longer holds the positions before {length}")
        self.length = length
        if length == 0:
            self.written = 0


class LinearStates:
    """The recurrent and convolution states of a hybrid target's linear-attention layers.

    A forward reads the states and leaves a BlockRecord per layer; `settle(p)` then makes each state that
    after position p-1, for any p within the last forward's tokens. Each layer has two buffers: settling
    writes the one not in use and then switches, in one assignment, so a Ctrl-C at any point leaves every
    layer either settled or still able to settle. One checkpoint (the state just before a prompt's last
    token) lets a chat regenerate its last reply without reading the prompt again; any other earlier
    length starts over from position 0.
    """

    def __init__(self, nets: list[HFModule], *, dtype: torch.dtype, device: torch.device | Sequence[torch.device]):
        self.kernel = nets[0].conv_kernel_size
        devices = list(device) if isinstance(device, Sequence) else [device] * len(nets)
        conv = [(1, net.conv_dim, net.conv_kernel_size - 1) for net in nets]
        state = [(net.num_v_heads, net.head_k_dim, net.head_v_dim) for net in nets]
        self.convs = [[torch.zeros(c, dtype=dtype, device=d) for c, d in zip(conv, devices)] for _ in range(3)]
        self.states = [[torch.zeros(s, dtype=torch.float32, device=d) for s, d in zip(state, devices)]
                       for _ in range(3)]
        # per layer: (buffer in use 0|1, record of the last forward or None, its base position or the
        # state's position); buffer 2 is the checkpoint
        self.slots: list[tuple[int, BlockRecord | None, int]] = [(0, None, 0)] * len(nets)
        self.checkpoint_at: int | None = None

    def current(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([self.convs[cur][j] for j, (cur, _, _) in enumerate(self.slots)],
                [self.states[cur][j] for j, (cur, _, _) in enumerate(self.slots)])

    def _covers(self, j: int, position: int) -> bool:
        _, record, base = self.slots[j]
        return base <= position <= base + record.tokens if record is not None else position == base

    def reachable(self, length: int) -> int:
        if all(self._covers(j, length) for j in range(len(self.slots))):
            return length
        if self.checkpoint_at is not None and self.checkpoint_at <= length:
            return self.checkpoint_at
        return 0

    def _install(self, j: int, conv: torch.Tensor, state: torch.Tensor, position: int) -> None:
        cur = self.slots[j][0]
        self.convs[1 - cur][j].copy_(conv)
        self.states[1 - cur][j].copy_(state)
        self.slots[j] = (1 - cur, None, position)

    def settle(self, position: int) -> None:
        """Makes every layer's state the one after positions < `position`."""
        for j, (_, record, base) in enumerate(self.slots):
            if record is None:
                if base != position:
                    raise RollbackError(f"linear-attention state is at {base}, not {position}")
                continue
            m = position - base
            if not 0 <= m <= record.tokens:
                raise RollbackError(f"position {position} is outside the last forward ({base}..)")
            self._install(j, conv_after(record, m, self.kernel), state_after(record, m), position)

    def record(self, base: int, records: list[BlockRecord]) -> None:
        for j, record in enumerate(records):
            self.slots[j] = (self.slots[j][0], record, base)

    def save_checkpoint(self, position: int) -> None:
        """Keeps the state after positions < `position` (within the last forward) aside."""
        self.checkpoint_at = None
        for j, (_, record, base) in enumerate(self.slots):
            m = position - base
            assert record is not None and 0 <= m <= record.tokens, (position, base)
            self.convs[2][j].copy_(conv_after(record, m, self.kernel))
            self.states[2][j].copy_(state_after(record, m))
        self.checkpoint_at = position

    def crop(self, length: int) -> None:
        if self.checkpoint_at is not None and length < self.checkpoint_at:
            self.checkpoint_at = None  # the tokens it summarised may change
        if all(self._covers(j, length) for j in range(len(self.slots))):
            return  # settled lazily by the next forward
        if length == 0:
            for j in range(len(self.slots)):
                self._install(j, torch.zeros_like(self.convs[2][j]), torch.zeros_like(self.states[2][j]), 0)
        elif length == self.checkpoint_at:
            for j in range(len(self.slots)):
                self._install(j, self.convs[2][j], self.states[2][j], length)
        else:
            raise RollbackError(f"linear-attention state cannot return to position {length}")


def fast_path_unsupported(model: HFModule) -> str | None:
    """Why `model` cannot take the fast path, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if any(p.device.type == "meta" for p in model.parameters()):
        return "layers offloaded to cpu/disk (accelerate copies their weights in on every forward)"
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


def _gated_mlp(mlp: nn.Module) -> bool:
    return all(hasattr(mlp, m) for m in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def layer_projections(layer: HFModule, pack: bool, quant: str | None = None,
                      codes: Callable[[nn.Module], Q4Codes | None] | None = None) -> nn.ModuleDict:
    """A layer's linear maps as qkv -> (q, k, v), o (or a linear-attention layer's inputs, out), and a gated
    MLP's gate_up -> (gate, up), down; weight-only quantized when `quant` is q4/q8 (engine/weightonly.py;
    `codes(linear)` may give ready 4-bit codes), else packed by oneDNN (fused where several) when `pack` and
    it works here, else the layer's own modules. Other MLPs (mixtures of experts) run as their own module;
    under q4/q8 a Qwen MoE block's shared expert, a gated MLP, gets shared_gate_up and shared_down."""

    def fuse(*linears: nn.Module) -> nn.Module | None:
        made: nn.Module | None = None
        if quant is not None:
            given = [codes(m) for m in linears] if codes is not None else None
            made = quantize_linears(list(linears), quant, codes=given)
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
# (Qwen3.5's 1 + weight) run as modules. (PLAIN_RMS_NORMS lives in engine/fused.py, which reads it too.)


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
                 row_exact: bool = False, ring: tuple[int, int] | None = None, native_attention: bool = False):
        super().__init__()
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
        # q4a8/q8a8 (fp32 activations): short calls attend through the project's C kernel instead, row-exact
        # in fp32 where torch's matmuls are not (engine/native.py; head dims in multiples of 8)
        built = native.library() if native_attention else None
        self.native = built.lib if built is not None and all(hd % 8 == 0 for _, hd in self.shapes) else None
        # q4a8/q8a8 Llama-style layers: each one C call (engine/fused.py), when every layer can be
        self.fused: list[Any] | None = None
        if self.native is not None and devices is None:
            made = [layer_struct(layer, proj, heads=self.heads, kv=self.kv_heads, hd=self.head_dim,
                                 scale=self.scaling) for layer, proj in zip(self.layers, projections)]
            self.fused = made if all(m is not None for m in made) and self.uniform else None

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
            return self._fused_forward(ids, positions, keys, values)
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
        return self._head(h, tapped, records)

    def _head(self, h: torch.Tensor, tapped: dict[int, torch.Tensor], records: list[tuple[torch.Tensor, ...]]):
        if self.last_logit_only:
            h = h[:, -1:]
        # (b*n, V); a 2-D input keeps CPU bf16 on the plain matmul
        logits = self.lm_head(self.final_norm(h).flatten(0, 1))
        if self.softcap:  # Gemma: cap * tanh(logits / cap), as transformers' forward
            logits = torch.tanh(logits / self.softcap) * self.softcap
        hidden = torch.cat([tapped[i] for i in self.taps], dim=-1) if self.taps else None
        return logits, hidden, records

    def _fused_forward(self, ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                       values: list[torch.Tensor]):
        """forward() with every layer one C call (engine/fused.py), on one sequence."""
        assert self.fused is not None and self.native is not None
        h = self.embed(ids).contiguous()  # (1, n, H) fp32, updated in place by each layer
        cos, sin = self.rotary(h, positions[None])  # (1, n, hd)
        half = cos.shape[-1] // 2
        cos, signed = cos.contiguous(), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        positions = positions.contiguous()
        wanted, last = set(self.taps), len(self.layers) - 1
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.fused):
            run_layer(self.native, layer, h, positions, cos, signed, keys[i], values[i])
            if i in wanted:
                tapped[i] = self.final_norm(h) if i == last else h.clone()
        return self._head(h, tapped, [])

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
        if blocked is not None:
            out = row_exact_attention(folded, keys[:, :, :rows], values[:, :, :rows], blocked, scale)
        else:
            out = F.scaled_dot_product_attention(folded, keys[:, :, :rows], values[:, :, :rows],
                                                 attn_mask=mask, scale=scale)
        out = out.reshape(b, kv, heads // kv, n, hd).permute(0, 3, 1, 2, 4).reshape(b, n, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return proj["o"](out)


def write_rows(buffer: torch.Tensor, at: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes K/V rows (b, heads, n, hd) into a cache buffer (b, heads, capacity, hd) at `at`: (n,) buffer
    rows for every sequence alike (decoding), or (b, n), each sequence its own (batched generation)."""
    if at.dim() == 1:
        buffer.index_copy_(2, at, rows)
    else:  # advanced indices first: the target is (b, n, heads, hd). (scatter_ measured 100x slower.)
        buffer[torch.arange(at.shape[0], device=at.device)[:, None], :, at] = rows.transpose(1, 2)


def _moved(inputs: Any, device: torch.device) -> Any:
    """A forward's per-call inputs (tensors inside tuples and dicts) copied to `device` through move()."""
    if isinstance(inputs, torch.Tensor):
        return move(inputs, device)
    if isinstance(inputs, dict):
        return {k: _moved(v, device) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(_moved(v, device) for v in inputs)
    return inputs


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
        weights: "q4"/"q8" runs the linears (LM head included) weight-only quantized (engine/weightonly.py).
        q4_codes: ready 4-bit codes by module name (a GGUF's own), used instead of quantizing those linears.
        slack: how many tokens one forward may write into a sliding-window ring (StaticCache); default the
            longer of a prompt piece (PREFILL_CHUNK) and a padded short call. Longer calls run in pieces.
    """

    def __init__(self, model: HFModule, context: int, *, pad_to: int = 1,
                 compile_step: Callable[[nn.Module], Callable[..., Any]] | None = None,
                 on_fallback: Callable[[str], None] | None = None, weights: str | None = None,
                 q4_codes: dict[str, Q4Codes] | None = None, slack: int | None = None):
        attn = first_attention(model)
        self.model = model
        self.context = context
        # one spare row: the attended window (key_positions) then never spans the whole buffer, which
        # compiled code would specialise to a constant
        self.capacity = context + _bucket(max(pad_to, 1)) + 1
        layers = model.get_decoder().layers
        self.num_layers = len(layers)
        self.linear_nets = [layer.linear_attn for layer in layers if is_linear_attention(layer)]
        self.attention_layers = {i for i, layer in enumerate(layers) if not is_linear_attention(layer)}
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.head_dim = attn.head_dim
        attentions = {i: layers[i].self_attn for i in self.attention_layers}
        # each attention layer's (kv heads, head dim): Gemma 4's global layers differ from its sliding ones
        self.layer_shapes = {i: (a.k_proj.out_features // a.head_dim, a.head_dim) for i, a in attentions.items()}
        windows = {i: w for i, a in attentions.items() if (w := getattr(a, "sliding_window", None))}
        # Sliding-window layers keep a ring of window + 2 * slack rows when the context is longer than that
        # (StaticCache); shorter contexts keep full-length buffers, as the other layers.
        self.slack = max(slack or PREFILL_CHUNK, _bucket(max(pad_to, 1)))
        self.ring: tuple[int, int] | None = None  # (rows, window)
        if len(set(windows.values())) == 1:
            window = next(iter(windows.values()))
            if window + 2 * self.slack < self.capacity:
                self.ring = (window + 2 * self.slack, window)
        self.ring_layers = set(windows) if self.ring is not None else set()
        self.dtype = model.get_input_embeddings().weight.dtype
        self.device = model.get_input_embeddings().weight.device  # the hot device: ids, logits, taps
        devices = [layer_device(layer) for layer in layers]
        # each layer's device under a device map; None on one device (no boundary checks at all)
        self.devices: list[torch.device] | None = devices if set(devices) != {self.device} else None
        self.compile_step = compile_step
        self.on_fallback = on_fallback
        # a mixture's fused experts: replaced in the model by 4/8-bit ones, the 16-bit tensors freed (moe.py);
        # before the room to pack is measured, which counts the model's parameters
        self.quantized_experts = quantize_experts(model, weights) if weights and self.device.type == "cpu" else 0
        # Eager CPU runs use oneDNN-packed weights (a second copy, when memory allows); compiled code leaves
        # the weights to the compiler.
        self.packed = pack = compile_step is None and room_to_pack(model)
        self.weights = weights
        used: list[str] = []
        codes = _codes_lookup(model, q4_codes, used) if q4_codes else None
        # quantized linears compute each row on their own; attention then must too (row_exact_attention)
        # (q4a8/q8a8 quantize every row's activations: an fp32 attention's ~1e-7 differences between a decode
        # and a verify would change their codes, so they attend row-exact in fp32 too)
        self.row_exact = bool(weights) and self.device.type == "cpu" and (
            self.dtype != torch.float32 or weights in INT8_ACT_QUANTS)
        self.projections = nn.ModuleList(layer_projections(layer, pack, weights, codes)
                                         for layer in model.get_decoder().layers)
        self.codes_used = len(set(used))  # linears that run the checkpoint's own codes
        head = model.get_output_embeddings()
        # keep_source: a draft vocabulary takes its rows from the dense head (drafter.draft_head). Under q4 the
        # LM head is q8: 4-bit groups cost it 9% of its weight (the demo's tau fell from 1.7 to 1.1), as fast
        # at 1 row; llama.cpp's 4-bit formats also keep the output matrix at 6-8 bits.
        head_kind = "q8a8" if weights in INT8_ACT_QUANTS else "q8"
        self.lm_head = ((quantize_linears([head], head_kind, keep_source=True) if weights else None)
                        or (PackedLinear.pack(head, keep_source=True) if pack else None) or head)
        self.fallback_reason: str | None = None
        self.taps: list[int] = []
        self._eager: dict[tuple[bool, bool], StaticForward] = {}
        self._compiled: dict[bool, Callable[..., Any]] = {}
        self._shared: StaticCache | None = None

    @property
    def weight_form(self) -> str:
        """The linears' format in words ("q4 weights (the checkpoint's own 4-bit codes)", "packed weights")."""
        if self.weights:
            own = f" ({self.codes_used} linears with the checkpoint's own 4-bit codes)" if self.codes_used else ""
            experts = f", {self.quantized_experts} layers of {self.weights} experts" if self.quantized_experts else ""
            layers = ", each decoder layer one C call" if self._module(False, True).fused is not None else ""
            return f"{self.weights} weights{own}{experts}{layers}"
        return "packed weights" if self.packed else ""

    @property
    def attention_kernel(self) -> str:
        """The attention kernel the short calls get here, in words (engine/kernels.py)."""
        from dflash_cli.engine.kernels import NATIVE_ATTENTION, attention_kernel

        if self.weights in INT8_ACT_QUANTS and self._module(False, True).native is not None:
            return NATIVE_ATTENTION
        heads = int(self.model.config.num_attention_heads)
        return attention_kernel(self.device, self.dtype, heads=heads, kv_heads=self.kv_heads,
                                head_dim=self.head_dim, row_exact=self.row_exact)

    @property
    def compiled(self) -> bool:
        return self.compile_step is not None and self.fallback_reason is None

    def set_taps(self, taps: list[int]) -> None:
        self.taps = list(taps)
        self._eager.clear()
        self._compiled.clear()

    def shared_cache(self) -> StaticCache:
        """The model's one cache for decoding (engine/state.py hands it from one conversation to the next)."""
        if self._shared is None:
            self._shared = self.new_cache()
        return self._shared

    def new_cache(self, batch: int = 1) -> StaticCache:
        """A cache of its own (a second allocation of the whole context: decoding uses shared_cache()); `batch`
        sequences side by side for forward_rows."""
        devices = self.devices or [self.device] * self.num_layers
        linear_devices = [d for i, d in enumerate(devices) if i not in self.attention_layers]
        linear = (LinearStates(self.linear_nets, dtype=self.dtype, device=linear_devices)
                  if self.linear_nets else None)
        shapes = [(*self.layer_shapes.get(i, (self.kv_heads, self.head_dim)),
                   self.ring[0] if i in self.ring_layers and self.ring is not None else self.capacity)
                  for i in range(self.num_layers)]
        ring = (torch.full((self.ring[0],), FAR, dtype=torch.long, device=self.device)
                if self.ring is not None else None)
        cache = StaticCache(self.num_layers, self.kv_heads, self.head_dim, self.capacity, dtype=self.dtype,
                            device=devices, linear=linear, attention_layers=self.attention_layers,
                            layer_shapes=shapes, ring=ring, window=self.ring[1] if self.ring else None, batch=batch)
        if self.compiled and self.device.type == "cuda":  # CUDA graphs read the buffers where they are
            buffers = cache.keys + cache.values + ([ring] if ring is not None else [])
            if linear is not None:
                buffers += [b for group in linear.convs[:2] + linear.states[:2] for b in group]
            for buf in buffers:  # no identity guard: another cache's buffers run the same graphs
                torch._dynamo.mark_static_address(buf, guard=False)
        return cache

    def precompile(self, *, taps: bool, max_block: int) -> None:
        """Runs every short call the loop makes once, so compilation happens now and not in a reply: with a
        drafter (`taps`) the tapped verify at 1..max_block rows padded to powers of two (a plain step then
        still feeds the drafter), without one the 1-row decode. A drafter-less decode with a drafter loaded
        (--compare's baseline) compiles on its first call."""
        cache = self.shared_cache()
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.forward(ids, cache, 0, taps=False, last_logit_only=True)
        # on CUDA the first call of a shape warms up and the second records its graph: both happen here
        runs = 2 if self.device.type == "cuda" else 1
        for size in sorted({_bucket(n) for n in range(1, max_block + 1)}):
            for _ in range(runs):
                if self.compiled:
                    self.forward(ids.expand(1, size).contiguous(), cache, 1, taps=taps, last_logit_only=False)
        cache.crop(0)
        cache.owner = 0  # a DecodeState that held it reads its prompt anew

    def _module(self, taps: bool, last_logit_only: bool) -> StaticForward:
        key = (taps, last_logit_only)
        if key not in self._eager:
            self._eager[key] = StaticForward(self.model, self.taps if taps else [], self.projections, self.lm_head,
                                             last_logit_only=last_logit_only, devices=self.devices,
                                             row_exact=self.row_exact, ring=self.ring,
                                             native_attention=self.weights in INT8_ACT_QUANTS)
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
        if cache.ring is not None and n > self.slack:  # a ring takes at most `slack` new rows per forward
            return self._in_pieces(ids, cache, start, taps=taps, last_logit_only=last_logit_only)
        # before the forward (an interrupted one may have written some rows): a padded call's rows too
        cache.written = max(cache.written, start + _bucket(n))
        with torch.inference_mode():
            if cache.linear is not None:
                cache.linear.settle(start)
            states = cache.linear.current() if cache.linear is not None else ((), ())
            out = None
            if self.compiled and not last_logit_only and _bucket(n) < self.capacity - self.context:
                out = self._run_compiled(ids, cache, start, taps, states)
            if out is None:
                positions = torch.arange(start, end, device=ids.device)
                keys_at = key_positions(end, cache.capacity - 1, ids.device)
                out = self._module(taps, last_logit_only)(ids, positions, keys_at, cache.keys, cache.values,
                                                          *states, ring=cache.ring)
            logits, hidden, records = out
            if cache.linear is not None:
                # the records cover the last chunk of the tokens run (compiled calls are one chunk)
                cache.linear.record(start + CHUNK * ((n - 1) // CHUNK), [BlockRecord(*r) for r in records])
                if last_logit_only:  # a prompt: keep the state before its last token for /regen
                    cache.linear.save_checkpoint(end - 1)
        cache.length = end
        return logits, hidden

    def forward_rows(self, ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache, rows: slice, *,
                     taps: bool, last_logit_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An eager forward of several sequences at once (batched generation, train/batched.py): row r of
        `ids` (b, n) runs at positions[r] (b, n), or all rows at `positions` (n,), in batch row rows[r] of a
        cache from new_cache(batch=...). Each sequence keeps its own length (the caller's; cache.length is
        not used), with buffer row == position, so a query at p sees the rows <= p of its own sequence only.
        Returns logits (b*n, V) (b, V with last_logit_only) and, with taps, the tapped states (b, n, F).
        Targets with rings, linear-attention layers or layers on several devices decode one sequence only."""
        assert cache.ring is None and cache.linear is None and self.devices is None
        end = int(positions.max()) + 1
        if end > self.context:
            from dflash_cli.engine.errors import InvalidSettingError

            raise InvalidSettingError(f"the sequence needs {end} positions, the cache holds {self.context}")
        # The keys the longest sequence needs, in steps of 32 (nothing is compiled here, and a batch reads every
        # row's keys up to the window); once that is most of the buffer, the whole buffer: its rows are then
        # contiguous, and a CPU matmul over a window of them measured 5x slower in bf16 (a copy first).
        window = -(-end // 32) * 32
        keys_at = torch.arange(cache.capacity if 2 * window > cache.capacity else window, device=ids.device)
        with torch.inference_mode():
            logits, hidden, _ = self._module(taps, last_logit_only)(
                ids, positions, keys_at, [k[rows] for k in cache.keys], [v[rows] for v in cache.values])
        return logits, hidden

    def _in_pieces(self, ids: torch.Tensor, cache: StaticCache, start: int, *, taps: bool,
                   last_logit_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A forward of more tokens than a sliding-window ring takes at once, as consecutive forwards."""
        assert cache.linear is None  # rings exist only for targets without linear-attention layers
        logits, hidden = [], []
        for at in range(0, ids.shape[1], self.slack):
            piece = ids[:, at:at + self.slack]
            last = at + self.slack >= ids.shape[1]
            out, tapped = self.forward(piece, cache, start + at, taps=taps, last_logit_only=last_logit_only and last)
            if not last_logit_only or last:
                logits.append(out)
            if tapped is not None:
                hidden.append(tapped)
        return torch.cat(logits), (torch.cat(hidden, dim=1) if hidden else None)

    def _run_compiled(self, ids: torch.Tensor, cache: StaticCache, start: int, taps: bool, states):
        """A short call padded to the next power of two; None when compiling failed (eager takes over)."""
        n = ids.shape[1]
        size = _bucket(n)
        if size > n:  # pad with the last token; its logits, states and K/V rows are never used
            ids = torch.cat([ids, ids[:, -1:].expand(1, size - n)], dim=1)
        # A fresh (1, size) tensor made here, in inference mode, whatever the caller passed: a slice of a
        # longer row keeps that row's stride (and counts as contiguous), and a tensor made outside inference
        # mode has other dispatch keys; each would compile (and record) the shape again.
        ids = ids.reshape(-1).clone()[None]
        positions = torch.arange(start, start + size, device=ids.device)
        keys_at = key_positions(start + size, self.capacity - 1, ids.device)
        torch._dynamo.maybe_mark_dynamic(keys_at, 0)
        step = self._compiled.get(taps)
        if step is None:
            assert self.compile_step is not None  # only compiled runs get here
            step = self._compiled[taps] = self.compile_step(self._module(taps, False))
        try:
            ring = {"ring": cache.ring} if cache.ring is not None else {}  # only sliding-window rings
            logits, hidden, records = step(ids, positions, keys_at, cache.keys, cache.values, *states, **ring)
        except Exception as e:  # noqa: BLE001 - any compiler failure: say so once and run eagerly
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.fallback_reason = f"{type(e).__name__}: {first}"[:200]
            if self.on_fallback is not None:
                self.on_fallback(f"compilation failed ({self.fallback_reason}); running uncompiled")
            return None
        logits, hidden = logits[:n], (hidden[:, :n] if hidden is not None else None)
        if self.device.type == "cuda":  # a CUDA graph's outputs are overwritten by its next replay
            logits, hidden = logits.clone(), (hidden.clone() if hidden is not None else None)
            records = [tuple(t.clone() for t in r) for r in records]
        return logits, hidden, records


def _codes_lookup(model: nn.Module, codes: dict[str, Q4Codes],
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


# the position a ring row holds when it holds none: ahead of every query, so no mask lets it through
FAR = 2**62


def _bucket(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


def key_positions(length: int, most: int, device: torch.device, minimum: int = 256) -> torch.Tensor:
    """Rows 0..L-1 to attend over: L is `length` rounded up to a power of two (at least `minimum`, at most
    `most`), so attention reads what the sequence needs, not the whole buffer."""
    return torch.arange(min(max(_bucket(length), minimum), most), device=device)
