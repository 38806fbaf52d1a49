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

This file holds the driver, `FastPath`: it builds the caches and forwards, pads and compiles the short calls,
and runs prompts eagerly. The pieces live beside it: the caches in engine/static_cache.py (`StaticCache`,
`LinearStates`, `key_positions`), the forward in engine/static_forward.py (`StaticForward`), and the
per-layer support check, projections and math in engine/fast_layers.py (`fast_path_unsupported`,
`layer_projections`, `row_exact_attention`, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dflash_cli.engine.cpu.int8act import INT8_ACT_QUANTS, CodesEmbedding, Q8A8Linear
from dflash_cli.engine.cpu.packed import PackedLinear, room_to_pack
from dflash_cli.engine.cpu.weightonly import Q4Codes, quantize_linears
from dflash_cli.engine.dtypes import half_caches_asked
from dflash_cli.engine.fast_layers import (
    QuantizedLayers,
    codes_lookup,
    first_attention,
    free_dense_weights,
    layer_device,
    layer_projections,
)
from dflash_cli.engine.hf_config import PREFILL_CHUNK
from dflash_cli.engine.hf_module import HFModule
from dflash_cli.engine.linear_attention import CHUNK, BlockRecord, is_linear_attention
from dflash_cli.engine.moe import quantize_experts
from dflash_cli.engine.static_cache import FAR, LinearStates, StaticCache, bucket, key_positions
from dflash_cli.engine.static_forward import StaticForward

HEAD_COST_ROWS = 8  # the row counts FastPath.head_costs measures, 1..this


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
        weights: "q4"/"q8" runs the linears (LM head included) weight-only quantized (engine/cpu/weightonly.py).
        q4_codes: ready 4-bit codes by module name (a GGUF's own), used instead of quantizing those linears.
        slack: how many tokens one forward may write into a sliding-window ring (StaticCache); default the
            longer of a prompt piece (PREFILL_CHUNK) and a padded short call. Longer calls run in pieces.
        free_dense: drop the dense weights of the linears quantized here (and of an untied LM head under
            q4a8/q8a8): the model then runs on this path only (Target.enable_fast_path; train's batched
            generator keeps them, its training reads the LM head).
        quantized: the layers' projections made while the target loaded (engine/layerwise.py), in `weights`.
    """

    def __init__(self, model: HFModule, context: int, *, pad_to: int = 1,
                 compile_step: Callable[[nn.Module], Callable[..., Any]] | None = None,
                 on_fallback: Callable[[str], None] | None = None, weights: str | None = None,
                 q4_codes: dict[str, Q4Codes] | None = None, slack: int | None = None, free_dense: bool = False,
                 quantized: QuantizedLayers | None = None):
        attn = first_attention(model)
        self.model = model
        self.context = context
        # one spare row: the attended window (key_positions) then never spans the whole buffer, which
        # compiled code would specialise to a constant
        self.capacity = context + bucket(max(pad_to, 1)) + 1
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
        self.slack = max(slack or PREFILL_CHUNK, bucket(max(pad_to, 1)))
        self.ring: tuple[int, int] | None = None  # (rows, window)
        if len(set(windows.values())) == 1:
            window = next(iter(windows.values()))
            if window + 2 * self.slack < self.capacity:
                self.ring = (window + 2 * self.slack, window)
        self.ring_layers = set(windows) if self.ring is not None else set()
        # the compute dtype (a float32 target may keep its embeddings 16-bit: engine/layerwise.py)
        self.dtype = model.get_decoder().norm.weight.dtype
        self._head_costs: tuple[float, ...] | None = None  # head_costs(), measured once
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
        # quantized linears compute each row on their own; attention then must too (row_exact_attention)
        # (q4a8/q8a8 quantize every row's activations: an fp32 attention's ~1e-7 differences between a decode
        # and a verify would change their codes, so they attend row-exact in fp32 too)
        self.row_exact = bool(weights) and self.device.type == "cpu" and (
            self.dtype != torch.float32 or weights in INT8_ACT_QUANTS)
        self.quantized_as_loaded = quantized is not None
        if quantized is None:
            quantized = _quantize_layers(model, pack, weights, q4_codes, free_dense)
        elif quantized.weights != weights:
            raise ValueError(f"layers loaded as {quantized.weights}, asked to run {weights}")
        self.projections = quantized.projections
        self.freed_bytes = quantized.freed_bytes
        self.codes_used = quantized.codes_used  # linears that run the checkpoint's own codes
        self._make_head(model, weights, pack, free_dense)
        self.fallback_reason: str | None = None
        self.taps: list[int] = []
        self._eager: dict[tuple[bool, bool, bool], StaticForward] = {}
        self._compiled: dict[bool, Callable[..., Any]] = {}
        self._shared: StaticCache | None = None

    def _make_head(self, model: HFModule, weights: str | None, pack: bool, free_dense: bool) -> None:
        """self.lm_head in the run's format, and self.codes_embedding: the input embeddings when they are the
        LM head's codes (a tied head under q4a8/q8a8), else None."""
        head = model.get_output_embeddings()
        # keep_source: a draft vocabulary takes its rows from the dense head (drafter.draft_head). Under q4 the
        # LM head is q8: 4-bit groups cost it 9% of its weight (the demo's tau fell from 1.7 to 1.1), as fast
        # at 1 row; llama.cpp's 4-bit formats also keep the output matrix at 6-8 bits.
        head_kind = "q8a8" if weights in INT8_ACT_QUANTS else "q8"
        self.lm_head = ((quantize_linears([head], head_kind, keep_source=True) if weights else None)
                        or (PackedLinear.pack(head, keep_source=True) if pack else None) or head)
        self.codes_embedding: CodesEmbedding | None = None
        if free_dense and weights in INT8_ACT_QUANTS and self.lm_head is not head:
            tied = head.weight is self.embed_weight(model)
            if tied:
                self.codes_embedding = _embed_from_head(model, self.lm_head)
            if not tied or self.codes_embedding is not None:
                # rows for a draft vocabulary come from the head's 8-bit codes (dense_rows): free its source
                self.lm_head.source = None
                self.freed_bytes += free_dense_weights([head])

    @staticmethod
    def embed_weight(model: HFModule) -> torch.Tensor:
        return model.get_input_embeddings().weight

    @property
    def weight_form(self) -> str:
        """The linears' format in words ("q4 weights (the checkpoint's own 4-bit codes)", "packed weights")."""
        if self.weights:
            own = f" ({self.codes_used} linears with the checkpoint's own 4-bit codes)" if self.codes_used else ""
            experts = f", {self.quantized_experts} layers of {self.weights} experts" if self.quantized_experts else ""
            module = self._module(False, True)
            layers = ", the decoder layers one C call" if module.fused is not None else ""
            if module.whole is not None:
                layers = ", the whole forward one C call"
            loaded = ", quantized layer by layer as they loaded" if self.quantized_as_loaded else ""
            return f"{self.weights} weights{own}{experts}{loaded}{layers}"
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
        if self.taps:  # the speculative loop's forwards, built now: not inside the first rounds the adaptive
            # controller times (4-5 ms each on a CPU, which made a first plain round look 50% dearer)
            for logits in (True, False) if self.defers_head else (True,):
                self._module(True, False, logits)
            self._module(True, True)

    def cache_dtype(self) -> torch.dtype:
        """fp16 with DFLASH_KV_CACHE=f16 where every layer runs as one C call (eager, on the CPU): attention
        reads half the bytes, most of a decode's at long context (the demo at 4k tokens: plain decoding 1.4x),
        and decodes, verifies and the batched generator read the same rows, so speculation stays lossless; but
        the demo drafter, trained on the fp32-cache target, accepts less behind it (tau at block 8 2.24 ->
        2.09), so it is not the default. Otherwise the model's dtype."""
        if (half_caches_asked()
                and self.device.type == "cpu" and not self.compiled and self.ring is None
                and self._module(True, False).fused is not None):
            return torch.float16
        return self.dtype

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
        cache = StaticCache(self.num_layers, self.kv_heads, self.head_dim, self.capacity, dtype=self.cache_dtype(),
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
        for size in sorted({bucket(n) for n in range(1, max_block + 1)}):
            for _ in range(runs):
                if self.compiled:
                    self.forward(ids.expand(1, size).contiguous(), cache, 1, taps=taps, last_logit_only=False)
        cache.crop(0)
        cache.owner = 0  # a DecodeState that held it reads its prompt anew

    def _module(self, taps: bool, last_logit_only: bool, logits: bool = True) -> StaticForward:
        key = (taps, last_logit_only, logits)
        if key not in self._eager:
            self._eager[key] = StaticForward(self.model, self.taps if taps else [], self.projections, self.lm_head,
                                             last_logit_only=last_logit_only, devices=self.devices,
                                             row_exact=self.row_exact, ring=self.ring,
                                             native_attention=self.weights in INT8_ACT_QUANTS, logits=logits)
        return self._eager[key]

    @property
    def defers_head(self) -> bool:
        """Whether forward(logits=False) pays: an eager CPU forward, where the LM head of a verify's rows is a
        tenth to a quarter of the step and the rows after a rejected draft need none (GPU calls are
        compiled whole, and a host sync per piece of head would cost more than it saves)."""
        return self.device.type == "cpu" and not self.compiled

    def logits_of(self, normed: torch.Tensor) -> torch.Tensor:
        """(rows, V) logits of rows that forward(logits=False) returned."""
        with torch.inference_mode():
            return self._module(True, False, False).logits_of(normed)

    def head_costs(self) -> tuple[float, ...]:
        """What a call of the LM head on k rows costs (seconds, index k; 0 unused), k = 1..8, measured once, best
        of 3 each (one each for a head slower than 10 ms a call, a multi-GB one): greedy verifies weigh one call
        on every row against a first piece and a second call (engine/speculative.first_head_rows). Where the
        head is compute-bound (AVX2 on Zen 1: the demo's head 2.5 ms for 1 row, 8.7 for 8) each row costs about
        what a call does; where it is memory-bound (the same head on Zen 4: 0.52 ms for 1 row, 0.74 for 4, 1.5
        for 8) the first rows come almost free."""
        if self._head_costs is None:
            width = int(self.model.get_decoder().norm.weight.shape[0])

            def best(rows: int, repeats: int) -> float:
                normed = torch.zeros(rows, width, dtype=self.dtype, device=self.device)
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    self.logits_of(normed)
                    times.append(time.perf_counter() - started)
                return min(times)

            # a first call as a warm-up, which also says whether three of each fit in well under a second
            repeats = 3 if best(1, 1) < 0.01 else 1
            self._head_costs = (0.0, *(best(rows, repeats) for rows in range(1, HEAD_COST_ROWS + 1)))
        return self._head_costs

    def forward(self, ids: torch.Tensor, cache: StaticCache, start: int, *, taps: bool,
                last_logit_only: bool, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs ids (1, n) at positions start..start+n-1; the cache then holds start+n positions.

        Returns logits (n, V) (or (1, V) with last_logit_only) and, with taps, the tapped states (1, n, F).
        logits=False (eager calls only, see defers_head): the final-normed rows (n, H) instead of logits.
        """
        n = ids.shape[1]
        end = start + n
        if end > self.context:
            from dflash_cli.engine.errors import InvalidSettingError

            raise InvalidSettingError(f"the sequence needs {end} positions, the cache holds {self.context}",
                                      hint="raise --max-context")
        if cache.ring is not None and n > self.slack:  # a ring takes at most `slack` new rows per forward
            return self._in_pieces(ids, cache, start, taps=taps, last_logit_only=last_logit_only, logits=logits)
        # before the forward (an interrupted one may have written some rows): a padded call's rows too
        cache.written = max(cache.written, start + bucket(n))
        with torch.inference_mode():
            if cache.linear is not None:
                cache.linear.settle(start)
            states = cache.linear.current() if cache.linear is not None else ((), ())
            out = None
            if self.compiled and logits and not last_logit_only and bucket(n) < self.capacity - self.context:
                out = self._run_compiled(ids, cache, start, taps, states)
            if out is None:
                positions = torch.arange(start, end, device=ids.device)
                module = self._module(taps, last_logit_only, logits)
                if module.fused is not None and ids.shape[0] == 1 and cache.ring is None:
                    # the C layers' call directly: it reads no key rows, and a module call's dispatch ran cold
                    out = module.fused_forward(ids, positions, cache.keys, cache.values, start)
                else:
                    keys_at = key_positions(end, cache.capacity - 1, ids.device)
                    out = module(ids, positions, keys_at, cache.keys, cache.values, *states, ring=cache.ring)
            result, hidden, records = out
            if cache.linear is not None:
                # the records cover the last chunk of the tokens run (compiled calls are one chunk)
                cache.linear.record(start + CHUNK * ((n - 1) // CHUNK), [BlockRecord(*r) for r in records])
                if last_logit_only:  # a prompt: keep the state before its last token for /regen
                    cache.linear.save_checkpoint(end - 1)
        cache.length = end
        return result, hidden

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
                   last_logit_only: bool, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A forward of more tokens than a sliding-window ring takes at once, as consecutive forwards."""
        assert cache.linear is None  # rings exist only for targets without linear-attention layers
        outs, hidden = [], []
        for at in range(0, ids.shape[1], self.slack):
            piece = ids[:, at:at + self.slack]
            last = at + self.slack >= ids.shape[1]
            out, tapped = self.forward(piece, cache, start + at, taps=taps, last_logit_only=last_logit_only and last,
                                       logits=logits)
            if not last_logit_only or last:
                outs.append(out)
            if tapped is not None:
                hidden.append(tapped)
        return torch.cat(outs), (torch.cat(hidden, dim=1) if hidden else None)

    def _run_compiled(self, ids: torch.Tensor, cache: StaticCache, start: int, taps: bool, states):
        """A short call padded to the next power of two; None when compiling failed (eager takes over)."""
        n = ids.shape[1]
        size = bucket(n)
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
        except Exception as e:  # any compiler failure: say so once and run eagerly
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


def _embed_from_head(model: HFModule, head: nn.Module) -> CodesEmbedding | None:
    """Makes a tied LM head's 8-bit codes the model's input embeddings (a plain nn.Embedding only: Gemma's
    scales its rows); returns them, or None where it does not apply."""
    embeddings = model.get_input_embeddings()
    if type(embeddings) is not nn.Embedding or not isinstance(head, Q8A8Linear):
        return None
    codes = CodesEmbedding(head)
    model.set_input_embeddings(codes)
    return codes


def _quantize_layers(model: HFModule, pack: bool, weights: str | None, q4_codes: dict[str, Q4Codes] | None,
                     free_dense: bool) -> QuantizedLayers:
    """Each decoder layer's projections as the fast path runs them (quantized when `weights`, else packed or
    the layer's own), the dense weights of the quantized ones freed when `free_dense`."""
    used: list[str] = []
    codes = codes_lookup(model, q4_codes, used) if q4_codes else None
    replaced: list[nn.Module] = []
    projections = nn.ModuleList(layer_projections(layer, pack, weights, codes, replaced)
                                for layer in model.get_decoder().layers)
    freed = free_dense_weights(replaced) if free_dense else 0
    return QuantizedLayers(weights, projections, len(set(used)), freed)
