"""The drafter's training forward: many anchor blocks per sequence in one pass, isolated by a block mask.

It runs the inference code (`DFlashDrafter.project_context` and `run_layers`, the same layers and
attention) with another mask and no cache: instead of one block against a cache, every block of every
anchor attends to the sequence's context rows before its anchor plus its own slots (docs/format.md
section 4). At inference the anchor x_p is the last committed token and the cache holds the tapped states
of positions 0..p-1, so block a sees context rows j < p_a and nothing of the other blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_cli.engine.drafter import DFlashDrafter, visibility

IGNORE = -100  # the label of slots that predict nothing


def block_ids(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int) -> torch.Tensor:
    """(N, A*B) block inputs [x_p, MASK x (B-1)] for each anchor p of each sequence."""
    n, a = anchors.shape
    out = ids.new_full((n, a, block_size), mask_id)
    out[:, :, 0] = ids.gather(1, anchors)
    return out.view(n, a * block_size)


def block_embeddings(drafter: DFlashDrafter, ids: torch.Tensor, anchors: torch.Tensor,
                     embed: torch.Tensor) -> torch.Tensor:
    """(N, A*B, H) embedded blocks of `block_ids`, scaled as the engine scales a block it drafts."""
    emb = F.embedding(block_ids(ids, anchors, drafter.block_size, drafter.mask_token_id), embed)
    if drafter.embed_scale is not None:  # the target's own embedding scale (Gemma), as decoding applies it
        emb = emb * drafter.embed_scale
    if drafter.config.input_embedding_scale != 1.0:
        emb = emb * drafter.config.input_embedding_scale
    return emb.to(drafter.fc.weight.dtype)


def block_labels(ids: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 ignore: int = IGNORE) -> torch.Tensor:
    """(N, A, B) targets: slot k of anchor p predicts x_{p+k}; slot 0 and slots past the end are `ignore`."""
    k = torch.arange(block_size, device=ids.device)
    pos = anchors[:, :, None] + k  # (N, A, B)
    valid = (pos < lengths[:, None, None]) & (k > 0)
    labels = ids.gather(1, pos.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(pos)
    return labels.masked_fill(~valid, ignore)


def training_mask(anchors: torch.Tensor, n_ctx: int, block_size: int, *, causal: bool,
                  window: int | None) -> torch.Tensor:
    """Boolean (N, 1, A*B, n_ctx + A*B) mask, True = attend.

    Query slot k of block a (position p_a+k) sees context row j iff j < p_a (and within the window), and
    slot k' of its own block iff causal allows it (k' <= k) and within the window; never other blocks.
    """
    n, a = anchors.shape
    dev = anchors.device
    k = torch.arange(block_size, device=dev)
    q_pos = (anchors[:, :, None] + k).view(n, a * block_size, 1)  # (N, Q, 1)
    q_anchor = anchors.repeat_interleave(block_size, dim=1)[:, :, None]  # (N, Q, 1)
    j = torch.arange(n_ctx, device=dev)[None, None, :]
    ctx = j < q_anchor
    if window is not None:
        ctx &= q_pos - j < window
    blk_of = torch.arange(a, device=dev).repeat_interleave(block_size)
    same = blk_of[:, None] == blk_of[None, :]  # (Q, Q)
    inside = same & visibility(k.repeat(a)[:, None], k.repeat(a)[None, :], causal=causal, window=window)
    return torch.cat([ctx, inside[None].expand(n, -1, -1)], dim=2)[:, None]


def training_forward(drafter: DFlashDrafter, features: torch.Tensor, block_embeds: torch.Tensor,
                     anchors: torch.Tensor) -> torch.Tensor:
    """Normed hidden states (N, A*B, H) of all anchor blocks, through the inference layers.

    Args:
        features: (N, L, n_taps*H) tapped target states of the (padded) sequences, positions 0..L-1.
        block_embeds: (N, A*B, H) embeddings of the blocks (block_ids), anchors' blocks one after another.
        anchors: (N, A) anchor positions; block a occupies positions p_a..p_a+B-1.
    """
    n, n_ctx, _ = features.shape
    n_q = block_embeds.shape[1]
    bsz = n_q // anchors.shape[1]
    ctx = drafter.project_context(features)
    ctx_pos = torch.arange(n_ctx, device=ctx.device)[None].expand(n, -1)
    q_pos = (anchors[:, :, None] + torch.arange(bsz, device=ctx.device)).view(n, n_q)
    return drafter.run_layers(block_embeds, ctx, torch.cat([ctx_pos, q_pos], dim=1), None,
                              lambda causal, window: training_mask(anchors, n_ctx, bsz, causal=causal, window=window))
