"""The drafter's block forward at fixed shapes, so that it can be compiled once and captured as a CUDA graph.

Eager, a draft is about 300 small kernel launches, as many as a graphed verify costs in total on a GPU.
What varies between drafts is made fixed: the new context rows (P = 0..B, what the last verify accepted)
are padded to the block size B, the keys are read over the same power-of-two window as the target's
(engine/static_cache.key_positions) with a mask, and K/V are written with `index_copy_` at positions given as a
tensor. The drafter cache keeps row index == position (engine/drafter.DraftCache), so both paths share it:
context rows go to start-P..start-1 and the block to start..start+B-1, as eagerly; the padding rows go
to start+B.., rows no query sees (every query sees keys <= start+B-1) and the next draft overwrites
before any query could. Drafts with more new context than B (the first after a prompt, or after plain
steps) run the eager forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dflash_cli.engine.drafter import DFlashDrafter, DraftCache, visibility


class WindowWriter:
    """What a drafter layer's attention calls `cache.write` on: writes K/V at `positions` into the cache's
    buffers and returns the first `window` rows."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: torch.Tensor, window: int):
        self.keys, self.values, self.positions, self.window = keys, values, positions, window

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer].index_copy_(2, self.positions, k)
        self.values[layer].index_copy_(2, self.positions, v)
        return self.keys[layer][:, :, : self.window], self.values[layer][:, :, : self.window]


class BlockForward(nn.Module):
    """forward(context (1, B, F), context positions (B,), block (1, B, H), block positions (B,), key
    positions (L,), keys, values) -> the block's normed hidden states (1, B, H)."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, context, context_positions, block, block_positions, key_positions, keys, values):
        drafter = self.drafter
        ctx = drafter.project_context(context)
        positions = torch.cat([context_positions, block_positions])
        writer = WindowWriter(keys, values, positions, key_positions.shape[0])
        last = block_positions[-1]

        def mask_for(causal: bool, window: int | None) -> torch.Tensor:
            seen = visibility(block_positions[:, None], key_positions[None, :], causal=causal, window=window)
            return seen & (key_positions[None, :] <= last)

        return drafter.run_layers(block, ctx, positions[None], writer, mask_for)


class StaticDraft:
    """Runs a drafter's blocks through BlockForward, compiled by `compile_step` (None: eagerly, the same
    shapes); `on_fallback` hears once when compiling fails and the eager BlockForward takes over."""

    def __init__(self, drafter: DFlashDrafter, compile_step: Callable[[nn.Module], Callable[..., Any]] | None = None,
                 on_fallback: Callable[[str], None] | None = None):
        self.drafter = drafter
        self.block = drafter.block_size
        cfg = drafter.config  # the tapped states' width, as DFlashDrafter's fc takes them
        taps = len(cfg.target_layer_ids) if cfg.target_layer_ids is not None else cfg.num_hidden_layers
        self.context_width = taps * cfg.hidden_size
        self._marked: set[int] = set()
        self.eager = BlockForward(drafter)
        self.step: Callable[..., Any] = compile_step(self.eager) if compile_step is not None else self.eager
        self.compiled = compile_step is not None
        self.on_fallback = on_fallback
        self.fallback_reason: str | None = None

    def fits(self, context: torch.Tensor | None, block_len: int, start: int, cache: DraftCache) -> bool:
        rows = 0 if context is None else context.shape[1]
        return block_len == self.block and rows <= self.block and start + 2 * self.block <= cache.capacity

    def __call__(self, context: torch.Tensor | None, block: torch.Tensor, start: int,
                 cache: DraftCache) -> torch.Tensor:
        """Like DFlashDrafter.forward (commits `context` to `cache`), for blocks of B slots whose new context
        has at most B rows and whose padding fits the cache (`fits`)."""
        from dflash_cli.engine.static_cache import key_positions

        b, device = self.block, block.device
        rows = 0 if context is None else context.shape[1]
        assert cache.length + rows == start, (cache.length, rows, start)
        with torch.inference_mode():  # every input made here, as inference tensors, whoever calls (no recompiles)
            padded = block.new_zeros((1, b, self.context_width))
            if context is not None:
                padded[:, :rows] = context
            block = block.clone()
            context_positions = torch.cat([torch.arange(start - rows, start, device=device),
                                           torch.arange(start + b, start + 2 * b - rows, device=device)])
            block_positions = torch.arange(start, start + b, device=device)
            keys_at = key_positions(start + b, cache.capacity, device)
        torch._dynamo.maybe_mark_dynamic(keys_at, 0)
        cfg = self.drafter.config
        keys, values = cache.buffers(cfg.num_key_value_heads, cfg.head_dim, dtype=block.dtype, device=device)
        if self.compiled and device.type == "cuda":  # CUDA graphs read the buffers where they are
            for buf in keys + values:
                if id(buf) not in self._marked:
                    torch._dynamo.mark_static_address(buf, guard=False)
                    self._marked.add(id(buf))
        args = (padded, context_positions, block, block_positions, keys_at, keys, values)
        try:
            with torch.inference_mode():  # as drafting runs: a graph compiled in another grad mode recompiles
                hidden = self.step(*args)
        except Exception as e:  # any compiler failure: say so once and run eagerly
            if self.step is self.eager:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.fallback_reason = f"{type(e).__name__}: {first}"[:200]
            if self.on_fallback is not None:
                self.on_fallback(f"compiling the drafter failed ({self.fallback_reason}); drafting uncompiled")
            self.step, self.compiled = self.eager, False
            with torch.inference_mode():
                hidden = self.step(*args)
        cache.advance(rows)
        return hidden.clone() if device.type == "cuda" else hidden  # a graph's output is its next replay's

    def precompile(self, cache: DraftCache, hidden_size: int, device: torch.device) -> None:
        """Runs a draft of each new-context size class once (twice on CUDA: a warm-up, then the recording),
        so compiling and recording happen before the first reply; leaves the cache empty."""
        block = torch.zeros((1, self.block, hidden_size), dtype=self.drafter.hidden_norm.weight.dtype,
                            device=device)
        for _ in range(2 if device.type == "cuda" else 1):
            cache.crop(0)
            self(None, block, 0, cache)
        cache.crop(0)
        cache.owner = 0  # a DecodeState that held it reads its prompt anew
