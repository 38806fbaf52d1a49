"""The DFlash draft model: a few Qwen3-style layers that predict a whole block in one forward pass.

Module attribute names match the checkpoint keys (`fc`, `hidden_norm`, `layers.{i}.self_attn.q_proj`, ...)
so weights load by key with no renaming. docs/format.md sections 2-4 specify it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from dflash_cli.engine.cpu.int8act import shortlist_head
from dflash_cli.engine.cpu.packed import PackedLinear, dense_rows, dense_weight, embedding_rows
from dflash_cli.engine.cpu.weightonly import quantize_linears
from dflash_cli.engine.hf_config import DrafterConfig
from dflash_cli.engine.sampling import Sampler, greedy_ids, greedy_ids_with_confidence

if TYPE_CHECKING:
    from collections.abc import Iterable


@runtime_checkable
class Drafter(Protocol):
    """What the decoding loop needs from a drafter: `DFlashDrafter`, `DFlash2Drafter` and `OracleDrafter`."""

    config: DrafterConfig

    @property
    def block_size(self) -> int: ...

    @property
    def mask_token_id(self) -> int: ...

    def new_cache(self, capacity: int = 256) -> DraftCache: ...

    def draft(self, context: torch.Tensor | None, anchor: torch.Tensor, start: int, block_len: int,
              cache: DraftCache, embed_weight: torch.Tensor | nn.Module, lm_head: nn.Module, *,
              keep: int | None = None, sampler: Sampler | None = None,
              confidence: list[float] | None = None) -> torch.Tensor:
        """The first `keep` drafts after `anchor` (a (1,) tensor), as a (keep,) tensor; commits `context`.
        `confidence`, where given, receives each greedy draft's probability under the drafter (nothing where
        the drafter cannot tell: sampled drafts, another kind of drafter)."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Variance in fp32, cast back before the weight: the reference numerics.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DraftCache:
    """Per-layer K/V (normed, roped) of the committed context, in buffers allocated on the first write for
    `capacity` rows (the target's static cache size on the fast path), growing by doubling only past it.

    `write` puts new rows after the committed ones and returns the keys to attend over; only `advance`
    makes rows committed, so a block's own K/V are overwritten by the next call.
    """

    def __init__(self, num_layers: int, capacity: int = 256):
        self.length = 0
        self.capacity = capacity
        self.owner = 0  # the DecodeState holding this cache (engine/state.py)
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        buf_k, buf_v = self.reserve(layer, end, k)
        buf_k[:, :, self.length : end] = k
        buf_v[:, :, self.length : end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def reserve(self, layer: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s whole K and V buffers, grown (committed rows kept) to hold `end` rows; `like`:
        a (N, kv, rows, hd) tensor of the shape and dtype to hold."""
        buf_k, buf_v = self._k[layer], self._v[layer]
        if buf_k is None or buf_v is None or buf_k.shape[2] < end:  # (the two are allocated together)
            capacity = max(end, self.capacity, 2 * (buf_k.shape[2] if buf_k is not None else 0))
            shape = (like.shape[0], like.shape[1], capacity, like.shape[3])
            # zeroed: rows past the sequence are read, masked, by drafter.draft_graph's fixed window
            new_k, new_v = like.new_zeros(shape), like.new_zeros(shape)
            if buf_k is not None and buf_v is not None:
                new_k[:, :, : self.length] = buf_k[:, :, : self.length]
                new_v[:, :, : self.length] = buf_v[:, :, : self.length]
            self._k[layer], self._v[layer] = buf_k, buf_v = new_k, new_v
        return buf_k, buf_v

    def buffers(self, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's K and V buffers, allocated (zeroed, `capacity` rows) where not yet."""
        for layer, buf in enumerate(self._k):
            if buf is None:
                shape = (1, kv_heads, self.capacity, head_dim)
                self._k[layer] = torch.zeros(shape, dtype=dtype, device=device)
                self._v[layer] = torch.zeros(shape, dtype=dtype, device=device)
        return cast("list[torch.Tensor]", self._k), cast("list[torch.Tensor]", self._v)

    def advance(self, rows: int) -> None:
        self.length += rows

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, nh, nkv, hd, bias = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                cfg.head_dim, cfg.attention_bias)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, cache: DraftCache | None, layer: int, mask):
        # x: (N, B, H) blocks; ctx: (N, P, H) new context rows or None; cos/sin: (N, P+B, hd).
        # Without a cache (training) the keys are the context rows and the blocks themselves.
        b, n_block, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n_block, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_in = x if ctx is None else torch.cat([ctx, x], dim=1)  # context first, then the block
        n_kv = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(b, n_kv, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, n_kv, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos[:, None, -n_block:], sin[:, None, -n_block:])
        k = apply_rope(k, cos[:, None], sin[:, None])
        keys, values = (k, v) if cache is None else cache.write(layer, k, v)  # (N, nkv, committed + P + B, hd)
        out = grouped_attention(q, keys, values, mask, self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n_block, -1))


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """Attention of q (N, heads, Q, hd) over keys/values (N, kv, K, hd) with grouped query heads (head h
    reads key/value head h // group), called so that a fused CUDA kernel accepts it.

    Unmasked, `enable_gqa` suits the flash kernel. Masked, neither fused kernel takes `enable_gqa` (flash
    takes no mask, memory-efficient no GQA) and torch would run the math kernel with fp32 scores; so each
    key/value head's group of query heads is folded into its rows, (N, kv, group*Q, hd), with the mask
    repeated per group: plain masked attention, which the memory-efficient kernel runs.
    """
    n, heads, rows, hd = q.shape
    kv = keys.shape[1]
    if mask is None or kv == heads:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=kv != heads)
    group = heads // kv
    folded = q.reshape(n, kv, group * rows, hd)  # heads are kv-major: rows of a group follow each other
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # broadcastable to (n, heads, rows, K)
    if mask.shape[1] == 1:  # the same for every head: repeated per query head of a group
        mask = mask.expand(mask.shape[0], 1, rows, mask.shape[-1]).repeat(1, 1, group, 1)
    else:
        mask = mask.expand(n, heads, rows, mask.shape[-1]).reshape(n, kv, group * rows, -1)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(n, heads, rows, hd)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        sliding = cfg.layer_types[index] == "sliding_attention"
        # Reference rule: sliding layers are causal inside the block, full layers bidirectional,
        # unless the config sets is_causal for all layers.
        self.causal = sliding if cfg.is_causal is None else bool(cfg.is_causal)
        self.window = cfg.sliding_window if sliding else None

    def forward(self, h, ctx, cos, sin, cache, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, cache, self.index, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def block_mask(q_start: int, n_query: int, n_key: int, *, causal: bool, window: int | None,
               device: torch.device) -> torch.Tensor | None:
    """Boolean (n_query, n_key) mask, True = attend; keys sit at positions 0..n_key-1. None = see all."""
    q_pos = torch.arange(q_start, q_start + n_query, device=device)[:, None]
    k_pos = torch.arange(n_key, device=device)[None, :]
    if not causal and (window is None or (q_start + n_query - 1 < window and n_key - 1 - q_start < window)):
        return None
    return visibility(q_pos, k_pos, causal=causal, window=window)


def context_window_mask(mask: torch.Tensor | None, start: int, n_query: int, window: int | None,
                        device: torch.device) -> torch.Tensor | None:
    """`mask` (block_mask's) that also hides the context positions before the last `window` (the drafter's
    context window, `--draft-window`): the block at start.. sees positions start-window.. only."""
    if window is None or start <= window:
        return mask
    k_pos = torch.arange(start + n_query, device=device)
    seen = (k_pos >= start - window)[None].expand(n_query, -1)
    return seen if mask is None else mask & seen


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, window: int | None) -> torch.Tensor:
    """The in-block attention rule on broadcastable position tensors: True where query may see key."""
    visible = torch.ones(torch.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=torch.bool, device=q_pos.device)
    if causal:
        visible &= k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
        if not causal:
            visible &= k_pos - q_pos < window
    return visible


class DFlashDrafter(nn.Module):
    """A DFlash drafter. It has no embedding and no LM head: it borrows the target's."""

    layer_class: type[DraftLayer] = DraftLayer
    # draft(confidence=[...]) gets each greedy draft's probability (a subclass whose draft() does not sets it False)
    reports_confidence = True

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        n_taps = len(cfg.target_layer_ids) if cfg.target_layer_ids is not None else cfg.num_hidden_layers
        self.fc = nn.Linear(n_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary: nn.Module | None = None  # made by init_rotary(), outside any meta-device context
        # optional sorted (V',) token ids the drafter proposes from (checkpoint tensor `draft_vocab`): the
        # LM head then runs on those rows only; the target still verifies over the whole vocabulary
        self.draft_vocab: torch.Tensor | None
        self.register_buffer("draft_vocab", None)
        self._draft_head: tuple[Any, torch.Tensor, tuple, nn.Module] | None = None  # see draft_head()
        self._shortlist: tuple[Any, nn.Module | None] | None = None  # see greedy_head()
        self._greedy_call: tuple[Any, ...] | None = None  # see greedy_call()
        self._ids_buffers: dict[tuple, torch.Tensor] = {}  # see _block_ids()
        self.head_quant: str | None = None  # "q8a8": the draft head's rows 8-bit (engine/cpu/int8act.py)
        # engine/fused.fuse_drafter: (the C library, each layer's struct) when every layer runs in one C call
        self.native_layers: tuple[Any, list[Any]] | None = None
        # engine/draft_graph.StaticDraft once the loop drafts at fixed shapes (compiled targets), else None
        self.static_draft: Any = None
        # attend to the last N context positions only (None = all): a drafter trained on short contexts drafts
        # worse at thousands of tokens (the demo's: tau 1.14 at 8k, 1.93 with 128); the config's
        # dflash_config.draft_window, else --draft-window
        self.context_window: int | None = cfg.draft_window
        # the target's embedding scale (Gemma: sqrt(hidden), in the embedding's dtype), set when the pair is
        # attached (load.attach_drafter): the block's embeddings are what the target's embedding module gives
        self.embed_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def init_rotary(self, device: torch.device) -> None:
        """The drafter's own RoPE (not the target's), computed by transformers from the config."""
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        raw = {k: v for k, v in self.config.raw.items() if k not in ("auto_map", "architectures")}
        raw.update(head_dim=self.config.head_dim, hidden_size=self.config.hidden_size,
                   num_attention_heads=self.config.num_attention_heads)
        self.rotary = Qwen3RotaryEmbedding(Qwen3Config(**raw)).to(device)
        self._rope: Any = None  # engine/cpu/c_layers.RopeTable for the C layers, made on first use

    def _apply(self, fn, recurse=True):
        # .to(dtype)/.to(device) would cast RoPE's fp32 frequencies too: recompute them instead
        super()._apply(fn, recurse)
        if self.rotary is not None:
            self.init_rotary(self.hidden_norm.weight.device)
        return self

    def new_cache(self, capacity: int = 256) -> DraftCache:
        return DraftCache(len(self.layers), capacity)

    def forward(self, context: torch.Tensor | None, block: torch.Tensor, start: int,
                cache: DraftCache) -> torch.Tensor:
        """Runs the drafter over one block and commits `context` to `cache`.

        Args:
            context: (1, P, n_taps*H) tapped target hidden states of positions start-P..start-1 that the
                cache does not hold yet, or None.
            block: (1, B, H) embeddings of [anchor, MASK x (B-1)] at positions start..start+B-1.
            start: absolute position of the anchor; must equal cache.length + P.
            cache: the drafter's context cache; grows by P rows.
        Returns:
            (1, B, H) normed hidden states of the block slots.
        """
        n_ctx = 0 if context is None else context.shape[1]
        assert cache.length + n_ctx == start, (cache.length, n_ctx, start)
        n_block = block.shape[1]
        ctx = None if context is None else self.project_context(context)
        positions = torch.arange(start - n_ctx, start + n_block, device=block.device)[None]
        h = self.run_layers(block, ctx, positions, cache, lambda causal, window: context_window_mask(block_mask(
            start, n_block, start + n_block, causal=causal, window=window, device=block.device), start, n_block,
            self.context_window, block.device))
        cache.advance(n_ctx)
        return h

    def _run_native_layers(self, h: torch.Tensor, ctx: torch.Tensor | None, positions: torch.Tensor,
                           cache: DraftCache) -> torch.Tensor:
        """run_layers with each layer one C call (engine/cpu/c_layers.py, q8a8 linears), for one block."""
        from dflash_cli.engine.cpu.c_layers import RopeTable, run_draft_layer

        assert self.native_layers is not None and self.rotary is not None
        lib, layers = self.native_layers
        if self._rope is None:
            self._rope = RopeTable(self.rotary, h.device)
        cos, signed = self._rope.rows(int(positions[0, 0]), int(positions[0, -1]) + 1)  # (1, P+B, hd)
        h = h.contiguous().clone()  # updated in place
        ctx = ctx.contiguous() if ctx is not None else None
        end = positions.shape[-1] + cache.length
        cfg = self.config
        like = h.new_empty(1, cfg.num_key_value_heads, 0, cfg.head_dim)
        for i, layer in enumerate(layers):
            layer.window = self.context_window or 0
            keys, values = cache.reserve(i, end, like)
            run_draft_layer(lib, layer, h, ctx, cache.length, cos, signed, keys, values)
        return self._norm(self.norm, h)

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """norm(x), in one C call beside the C layers (a torch RMSNorm took ~0.1 ms of a ~2 ms draft)."""
        if self.native_layers is not None and not torch.is_grad_enabled():
            from dflash_cli.engine.cpu import native

            out = native.rms_norm(self.native_layers[0], x, norm.weight, norm.eps)
            if out is not None:
                return out
        return norm(x)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(.)) of tapped target states (N, P, n_taps*H): the context rows, (N, P, H)."""
        dtype = self.hidden_norm.weight.dtype  # (fc may be a packed linear without a .weight)
        flat = features.reshape(-1, features.shape[-1]).to(dtype)  # 2-D, as a packed CPU linear takes it
        return self._norm(self.hidden_norm, self.fc(flat)).view(*features.shape[:-1], -1)

    def run_layers(self, h: torch.Tensor, ctx: torch.Tensor | None, positions: torch.Tensor,
                   cache: DraftCache | None, mask_for) -> torch.Tensor:
        """The draft layers and the final norm over blocks `h` (N, Q, H) at `positions` (N, P+Q) (context
        rows first), attending to `ctx` (N, P, H); `mask_for(causal, window)` gives each kind of layer's
        attention mask. Decoding passes one block and its cache; training many blocks and no cache."""
        assert self.rotary is not None, "init_rotary() first"
        if self.native_layers is not None and cache is not None and h.shape[0] == 1 and h.dtype == torch.float32:
            return self._run_native_layers(h, ctx, positions, cache)
        cos, sin = self.rotary(h, positions)
        masks: dict[tuple[bool, int | None], torch.Tensor | None] = {}
        for layer in cast("Iterable[DraftLayer]", self.layers):  # layer_class instances
            key = (layer.causal, layer.window)
            if key not in masks:
                masks[key] = mask_for(*key)
            h = layer(h, ctx, cos, sin, cache, masks[key])
        return self.norm(h)

    @torch.inference_mode()
    def draft(self, context: torch.Tensor | None, anchor: torch.Tensor, start: int, block_len: int,
              cache: DraftCache, embed_weight: torch.Tensor | nn.Module, lm_head: nn.Module, *,
              keep: int | None = None, sampler: Sampler | None = None,
              confidence: list[float] | None = None) -> torch.Tensor:
        """Proposes tokens after `anchor` (a (1,) tensor) from a block of `block_len` slots.

        Returns the first `keep` drafts (default all block_len-1) as a (keep,) tensor; the LM head runs on
        those slots only. Drafting the block the drafter was trained on and keeping a prefix gives better
        first drafts than drafting a shorter block: a block attends to itself bidirectionally.

        `sampler` (the target's): the draft at position p is the sampler's own choice from the draft logits
        with the noise it will use for the target at p (coupled drafts, docs/format.md section 5); None = argmax.
        `confidence` (greedy drafts only): gets each draft's probability under the drafter, its softmax's maximum.
        """
        sampled = sampler if sampler is not None and (not sampler.greedy or sampler.constrained) else None
        if sampled is None:
            call = self.greedy_call(embed_weight, lm_head)
            drafted = None if call is None else call(context, anchor, start, block_len, cache,
                                                     block_len - 1 if keep is None else keep, confidence)
            if drafted is not None:
                return drafted
        if self.draft_vocab is None:
            head = self.greedy_head_for(lm_head) if sampled is None else lm_head
            _, logits = self.draft_logits(context, anchor, start, block_len, cache, embed_weight, head, keep)
            return self._greedy(logits, confidence) if sampled is None else sampled(logits, start + 1)
        h = self.draft_hidden(context, anchor, start, block_len, cache, embed_weight, keep)
        head = self.greedy_head_for(lm_head) if sampled is None else self.draft_head(lm_head)
        logits = self.postprocess_logits(head(h.to(lm_head_dtype(head) or h.dtype))).float()  # (keep, V')
        if sampled is None:  # the vocabulary is sorted: the same first maximum as over `full`
            return self.draft_vocab[self._greedy(logits, confidence)]
        width = int(getattr(lm_head, "out_features"))  # the target's vocabulary
        full = logits.new_full((logits.shape[0], width), -torch.inf)
        full[:, self.draft_vocab] = logits  # ids outside the draft vocabulary get probability 0
        return sampled(full, start + 1)

    @staticmethod
    def _greedy(logits: torch.Tensor, confidence: list[float] | None) -> torch.Tensor:
        """Each row's greedy token; with `confidence`, its probability appended there."""
        if confidence is None:
            return greedy_ids(logits)
        ids, top = greedy_ids_with_confidence(logits)
        confidence.extend(top.tolist())
        return ids

    def draft_head(self, lm_head: nn.Module) -> nn.Module:
        """The target's LM head restricted to the draft vocabulary's rows (made once per LM head)."""
        assert self.draft_vocab is not None
        # a quantized head that kept no dense weight (its codes are the weight): its rows come from the codes
        weight = dense_weight(lm_head)
        owner: Any = weight if weight is not None else lm_head
        # in the drafter's dtype: a 16-bit embedding a float32 target keeps (engine/layerwise.py) widens exactly
        like = (weight if weight is not None else self.draft_vocab).new_empty(0, dtype=self.hidden_norm.weight.dtype)
        cached = self._draft_head
        # made again for another head (a weak reference: a freed target's id may be reused), dtype, device
        # or vocabulary
        if (cached is None or cached[0]() is not owner or cached[1] is not self.draft_vocab
                or cached[2] != (lm_head.out_features, like.device, like.dtype)):
            rows = self.draft_vocab.to(like.device)
            taken = dense_rows(lm_head, rows)
            sub = nn.Linear(taken.shape[1], len(rows), bias=False, device=like.device, dtype=like.dtype)
            bias = getattr(lm_head, "bias", None)
            with torch.no_grad():
                sub.weight.copy_(taken)
                if bias is not None:
                    sub.bias = nn.Parameter(bias.detach()[rows].clone(), requires_grad=False)
            sub.requires_grad_(False)
            quantized = quantize_linears([sub], self.head_quant) if self.head_quant else None
            cached = (weakref.ref(owner), self.draft_vocab, (lm_head.out_features, like.device, like.dtype),
                      quantized or PackedLinear.pack(sub) or sub)
            self._draft_head = cached
        return cached[3]

    def greedy_head_for(self, lm_head: nn.Module) -> nn.Module:
        """The head greedy drafts run beside the target's LM head `lm_head`: the draft vocabulary's rows of it where
        the drafter has one, else the head itself, through greedy_head. Called once at load (runtime/local.py), so
        a shortlist's 4-bit copy (0.02 s for the demo's draft vocabulary, 0.4 s for a Qwen3-1.7B-shaped head on 2
        Zen 3 cores) and the draft vocabulary's rows are made then, not in the first reply's first draft, where
        the adaptive controller would time them."""
        return self.greedy_head(self.draft_head(lm_head) if self.draft_vocab is not None else lm_head)

    def greedy_head(self, head: nn.Module) -> nn.Module:
        """The head greedy drafts run: over an 8-bit head on the CPU kernels (a draft vocabulary's, or the target's
        own), a ShortlistHead (a 4-bit copy scores every row, the 8-bit codes each row's best few again:
        engine/cpu/int8act.py), made once per head; else the head itself. Sampled drafts keep the head's logits."""
        cached = self._shortlist
        if cached is None or cached[0]() is not head:
            self._shortlist = cached = (weakref.ref(head), shortlist_head(head))
        return cached[1] or head

    def greedy_call(self, embed_weight: torch.Tensor | nn.Module, lm_head: nn.Module) -> Any:
        """The whole greedy draft as one C call (engine/cpu/c_draft.py: the same drafts, bit for bit, without
        the cold Python between the kernels after a verify) where the drafter's layers run in C and its greedy
        head on the CPU kernels (c_draft.greedy_draft_call), else None; made once per embedding table and head."""
        if self.native_layers is None or self.static_draft is not None:
            return None
        cached = self._greedy_call
        if (cached is None or cached[0]() is not embed_weight or cached[1]() is not lm_head
                or cached[2] is not self.native_layers or cached[3] is not self.draft_vocab):
            from dflash_cli.engine.cpu.c_draft import greedy_draft_call

            call = greedy_draft_call(self, embed_weight, self.greedy_head_for(lm_head))
            cached = (weakref.ref(embed_weight), weakref.ref(lm_head), self.native_layers, self.draft_vocab, call)
            self._greedy_call = cached
        return cached[4]

    def draft_logits(self, context, anchor, start, block_len, cache, embed_weight, lm_head,
                     keep: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed hidden states (keep, H) and post-processed draft logits (keep, V) of slots 1..keep."""
        h = self.draft_hidden(context, anchor, start, block_len, cache, embed_weight, keep)
        return h, self.postprocess_logits(lm_head(h.to(lm_head_dtype(lm_head) or h.dtype)))

    def draft_hidden(self, context, anchor, start, block_len, cache, embed_weight, keep: int | None) -> torch.Tensor:
        """The normed hidden states (keep, H) of slots 1..keep of a block of `block_len` slots."""
        keep = block_len - 1 if keep is None else keep
        ids = self._block_ids(anchor, block_len)
        block = embedding_rows(embed_weight, ids)
        if self.embed_scale is not None:  # as the target's own embedding module (Gemma) computes it
            block = block * self.embed_scale
        block = block[None].to(self.hidden_norm.weight.dtype)  # (1, B, H)
        if self.config.input_embedding_scale != 1.0:
            block = block * self.config.input_embedding_scale
        # slot 0 (the anchor) predicts nothing; a 2-D input keeps the LM head on the plain matmul path
        # (a 3-D slice makes CPU bf16 kernels copy the whole vocabulary matrix on every call)
        static = self.static_draft
        window = self.context_window
        if static is not None and (window is None or start <= window) and static.fits(context, block_len, start, cache):
            return static(context, block, start, cache)[0, 1 : keep + 1]  # fixed shapes (draft_graph.py)
        return self(context, block, start, cache)[0, 1 : keep + 1]  # (keep, H)

    def _block_ids(self, anchor: torch.Tensor, block_len: int) -> torch.Tensor:
        """[anchor, MASK x (block_len - 1)]: one buffer per length, dtype and device, its first slot rewritten
        (a cat of two new tensors took ~50 us of a ~2 ms CPU draft). Read at once by the embedding lookup."""
        key = (block_len, anchor.dtype, anchor.device)
        ids = self._ids_buffers.get(key)
        if ids is None:
            with torch.inference_mode(False):  # a normal tensor: drafts run in and out of inference mode
                ids = self._ids_buffers[key] = torch.full((block_len,), self.mask_token_id, dtype=anchor.dtype,
                                                          device=anchor.device)
        ids[:1].copy_(anchor)
        return ids

    def postprocess_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def lm_head_dtype(head: nn.Module) -> torch.dtype | None:
    weight = getattr(head, "weight", None)
    return weight.dtype if weight is not None and weight.dtype.is_floating_point else None
