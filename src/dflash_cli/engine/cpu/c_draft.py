"""A q8a8/q4a8 drafter's whole greedy draft as one C call (native/draft.c): the block's embeddings, the context
rows, the C layers, the final norm, the head (a ShortlistHead, or the 4-bit head of a q4a8 drafter), and each
draft's id and confidence. The same kernels
the drafter's Python forward calls (engine/drafter.py), in the same order: the same drafts, confidences and
cache rows, bit for bit. Right after a verify each Python and torch operation between those kernels ran cold
(10-40 us apiece on 2 Zen 4 cores, ~0.4 ms of a ~1.7 ms draft); here they are one call."""

from __future__ import annotations

import ctypes
from typing import Any, cast

import torch
from torch import nn

from dflash_cli.engine.cpu import native
from dflash_cli.engine.cpu.c_layers import RopeTable, linear_struct
from dflash_cli.engine.cpu.int8act import CodesEmbedding, Int8ActLinear, ShortlistHead
from dflash_cli.engine.cpu.packed import embedding_rows

P, LONG, FLOAT = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class Drafter(ctypes.Structure):
    """native/draft.c's struct dfq_drafter."""
    _fields_ = [("hidden", LONG), ("layers", LONG), ("layer", P), ("fc", native.Linear),
                ("hidden_norm", P), ("norm", P), ("hidden_eps", FLOAT), ("norm_eps", FLOAT),
                ("embed_codes", P), ("embed_d", P), ("embed_dense", P), ("vocab", LONG), ("mask_row", P),
                ("quick", native.Linear), ("exact_codes", P), ("exact_d", P), ("exact_bias", P),
                ("head_rows", LONG), ("top", LONG), ("vocab_ids", P)]


class GreedyDraft:
    """One drafter's greedy drafts beside one target's embeddings `embed` and LM head, through `head` (the
    drafter's greedy head for it: a ShortlistHead, or an 8/4-bit head of its own), as one C call each. Made by
    greedy_draft_call; holds what the struct points to."""

    def __init__(self, drafter: Any, embed: torch.Tensor | CodesEmbedding, head: ShortlistHead | Int8ActLinear):
        lib, layers = drafter.native_layers
        self.lib, self.drafter, self.embed, self.head = lib, drafter, embed, head
        self.layers = layers
        self.layer_pointers = (ctypes.POINTER(native.DraftLayer) * len(layers))(*(ctypes.pointer(x) for x in layers))
        cfg = drafter.config
        with torch.inference_mode(False):  # normal tensors: drafts run in and out of inference mode
            mask = torch.tensor([drafter.mask_token_id])
            # the block's other slots, embedded as the Python forward embeds them
            self.mask_row = embedding_rows(embed, mask)[0].to(drafter.hidden_norm.weight.dtype).contiguous()
            self.vocab_ids = (drafter.draft_vocab.to(torch.int64).contiguous() if drafter.draft_vocab is not None
                              else None)
            self.like = torch.empty(1, cfg.num_key_value_heads, 0, cfg.head_dim)
            quick, exact = (head.quick, head.exact) if isinstance(head, ShortlistHead) else (head, None)
            self.logits = torch.empty(drafter.block_size, quick.padded)
        made = self.struct = Drafter(
            hidden=cfg.hidden_size, layers=len(layers), layer=ctypes.cast(self.layer_pointers, P),
            fc=linear_struct(drafter.fc), hidden_norm=drafter.hidden_norm.weight.data_ptr(),
            norm=drafter.norm.weight.data_ptr(), hidden_eps=drafter.hidden_norm.eps, norm_eps=drafter.norm.eps,
            mask_row=self.mask_row.data_ptr(), quick=linear_struct(quick), head_rows=head.out_features,
            vocab_ids=native.ptr(self.vocab_ids))
        if isinstance(embed, CodesEmbedding):
            made.embed_codes, made.embed_d, made.vocab = embed.head.codes.data_ptr(), embed.head.d.data_ptr(), \
                embed.num_embeddings
        else:
            made.embed_dense, made.vocab = embed.data_ptr(), embed.shape[0]
        if exact is not None:
            made.exact_codes, made.exact_d, made.exact_bias = exact.codes.data_ptr(), exact.d.data_ptr(), \
                native.ptr(exact.bias)
            made.top = head.top
        self.confidence = (FLOAT * drafter.block_size)()
        self.keys = (P * len(layers))()
        self.values = (P * len(layers))()

    def __call__(self, context: torch.Tensor | None, anchor: torch.Tensor, start: int, block_len: int, cache: Any,
                 keep: int, confidence: list[float] | None) -> torch.Tensor | None:
        """The drafts (keep,) of drafter.draft's greedy case, or None where the call cannot take them (the caller
        drafts in Python then: an anchor outside the table, a NaN in a row's logits, a longer block)."""
        drafter = self.drafter
        n_ctx = 0 if context is None else context.shape[1]
        if block_len > self.logits.shape[0] or not 0 < keep < block_len:
            return None
        if context is not None and (context.dtype != torch.float32 or not context.is_contiguous()):
            context = context.float().contiguous()
        rope = drafter._rope
        if rope is None:
            rope = drafter._rope = RopeTable(drafter.rotary, "cpu")
        committed, end = start - n_ctx, start + block_len
        assert cache.length == committed, (cache.length, n_ctx, start)
        cos, signed = rope.rows(committed, end)
        window = drafter.context_window or 0
        capacity = 0
        for i, layer in enumerate(self.layers):
            layer.window = window
            keys, values = cache.reserve(i, end, self.like)
            self.keys[i], self.values[i], capacity = keys.data_ptr(), values.data_ptr(), keys.shape[2]
        ids = torch.empty(keep, dtype=torch.int64)
        status = self.lib.dfq_draft_greedy(
            ctypes.byref(self.struct), context.data_ptr() if context is not None else None, n_ctx, int(anchor),
            block_len, keep, committed, cos.data_ptr(), signed.data_ptr(), self.keys, self.values,
            capacity, self.logits.data_ptr(), ids.data_ptr(),
            self.confidence if confidence is not None else None)
        if status:
            return None
        cache.advance(n_ctx)
        if confidence is not None:
            confidence.extend(self.confidence[:keep])
        return ids


def greedy_draft_call(drafter: Any, embed: torch.Tensor | nn.Module, head: nn.Module) -> GreedyDraft | None:
    """A GreedyDraft for a drafter whose layers run in C (engine/cpu/c_layers.fuse_drafter) and whose greedy head
    is a ShortlistHead or a q8a8/q4a8 head, embedding from a tied head's codes or a dense fp32 table, with no
    embedding scale and logits used as the head gives them; else None (the drafter's Python forward drafts)."""
    if getattr(drafter, "native_layers", None) is None or not isinstance(head, (ShortlistHead, Int8ActLinear)):
        return None
    lib = drafter.native_layers[0]
    cfg = drafter.config
    if not hasattr(lib, "dfq_draft_greedy") or not isinstance(drafter.fc, Int8ActLinear):
        return None
    if drafter.embed_scale is not None or cfg.input_embedding_scale != 1.0 or cfg.output_multiplier != 1.0 \
            or cfg.final_logit_softcapping or drafter.static_draft is not None or drafter.rotary is None:
        return None
    if drafter.fc.padded != cfg.hidden_size or drafter.hidden_norm.weight.dtype != torch.float32:
        return None
    dense = isinstance(embed, torch.Tensor) and embed.dtype == torch.float32 and embed.is_contiguous() \
        and embed.device.type == "cpu" and embed.dim() == 2 and embed.shape[1] == cfg.hidden_size
    if not (dense or isinstance(embed, CodesEmbedding)):
        return None
    return GreedyDraft(drafter, cast("torch.Tensor | CodesEmbedding", embed), head)
