"""DFlash 2 drafters (`DFlash2DraftModel`): a v1 drafter plus a grouped dynamic causal convolution around
each sublayer and a candidate selector that replaces the per-slot argmax by a left-to-right walk.

Attention, MLP, norms, masks and the context cache are the v1 modules (engine/drafter.py); module names
match the checkpoint keys. The equations are in docs/format.md section 7.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig, DraftLayer
from dflash_cli.engine.sampling import Sampler, sampling_probs


class DynamicConv(nn.Module):
    """Grouped dynamic causal convolution over the block's slots (the context rows are not part of it)."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        base = torch.zeros(2, kernel, hidden)
        base[:, 0] = 1.0  # the identity until trained or loaded
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (1, B, H) -> (the convolved x, the dynamic weights (1, B, K, H/G) that `finish` uses)."""
        d = self.kernel_projection(x).unflatten(-1, (2, self.kernel, -1))
        return self.conv(x, d[..., 0, :, :], self.base_kernel[0]), d[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self.conv(y, dynamic, self.base_kernel[1])

    def conv(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        # out[t] = sum_o (base[o] + dynamic[t, o, group of the channel]) * x[t - o], x[<0] = 0
        weight = base + dynamic.repeat_interleave(self.group, dim=-1)  # (1, B, K, H)
        out = weight[:, :, 0] * x
        for o in range(1, self.kernel):
            shifted = torch.nn.functional.pad(x[:, :-o], (0, 0, o, 0)) if o < x.shape[1] else torch.zeros_like(x)
            out = out + weight[:, :, o] * shifted
        return out


class DFlash2Layer(DraftLayer):
    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__(cfg, index)
        kernel, group = cfg.conv_kernel_size, cfg.conv_group_size
        assert kernel is not None and group is not None  # set in every DFlash 2 config (DrafterConfig.from_dict)
        self.attention_conv = DynamicConv(cfg.hidden_size, kernel, group)
        self.mlp_conv = DynamicConv(cfg.hidden_size, kernel, group)

    def forward(self, h, ctx, cos, sin, cache, mask):
        x, dynamic = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, ctx, cos, sin, cache, self.index, mask), dynamic)
        x, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), dynamic)


class CandidateSelector(nn.Module):
    """Scores the top-k candidates of each slot given the token chosen at the slot before:
    score_j = unary_j + sum_r pred[prev, r] * hp[r] * succ[cand_j, r], hp = hidden_projection(h_slot)."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        # stored without a .weight suffix in the checkpoints
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))

    def walk(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, start: int,
             sampler: Sampler | None = None) -> torch.Tensor:
        """Draft tokens (P,) for slots 1..P from their logits (P, V) and hidden states (P, H).

        Greedy takes argmax_j score_j; sampling draws j from q = the sampler's filtered softmax(score/T)
        over the candidates, by Gumbel-max with the noise the sampler uses for the target at that position.
        The walk never reads a value back to the host (no `.item()`, no indexing by a 0-d tensor, which
        is a hidden `.item()`): every pick stays a (1,) device tensor that selects rows with index_select.
        """
        if sampler is not None and sampler.constrained:
            return self.walk_in_grammar(logits, hidden, anchor, start, sampler)
        unary, cand = logits.float().topk(min(self.top_k, logits.shape[-1]), dim=-1)  # (P, k)
        hp = self.hidden_projection(hidden.to(self.successor_codebook.dtype)).float()  # (P, R) (may be packed)
        succ = self.successor_codebook[cand].float() * hp[:, None]  # (P, k, R)
        pred = self.predecessor_codebook  # rows are gathered before the cast: the codebook is vocabulary-sized
        # pair[p - 1][i, j]: the pair term between candidate i of slot p-1 and candidate j of slot p
        first = (succ[0] @ pred.index_select(0, anchor[:1])[0].float())[None]  # (1, k)
        pair = torch.einsum("pir,pjr->pij", pred[cand[:-1]].float(), succ[1:])  # (P-1, k, k)
        sampling = sampler if sampler is not None and not sampler.greedy else None
        noise = (sampling.gumbel(start + 1, cand.shape[0], logits.shape[-1], logits.device).gather(1, cand)
                 if sampling is not None else None)
        picks = []
        j = None
        for p in range(cand.shape[0]):
            # (1, k); j is the (1,) index of the candidate picked at slot p-1
            score = unary[p:p + 1] + (first if j is None else pair[p - 1].index_select(0, j))
            j = self._pick(score, sampling, noise[p:p + 1] if noise is not None else None)
            picks.append(j)
        return cand.gather(1, torch.stack(picks))[:, 0]

    def walk_in_grammar(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, start: int,
                        grammar: Any) -> torch.Tensor:
        """`walk` inside a grammar (engine/constraint.py's sampler): slot p's candidates are the top k of its
        logits among the tokens the grammar allows after the picks before p, so one is always allowed.
        Reads every pick back to the host (the grammar advances on the CPU)."""
        hp = self.hidden_projection(hidden.to(self.successor_codebook.dtype)).float()  # (P, R)
        pred = self.predecessor_codebook
        sampling = grammar if not grammar.greedy else None
        previous = anchor[:1]  # the token picked at the slot before
        picks: list[int] = []
        try:
            for p in range(logits.shape[0]):
                row = logits[p:p + 1].float()
                row = row.masked_fill(~grammar.allowed(row.shape[-1], row.device), -torch.inf)
                unary, cand = row.topk(min(self.top_k, row.shape[-1]), dim=-1)  # (1, k)
                succ = self.successor_codebook[cand[0]].float() * hp[p]  # (k, R)
                score = unary + (succ @ pred.index_select(0, previous)[0].float())[None]  # (1, k)
                noise = (sampling.gumbel(start + 1 + p, 1, row.shape[-1], row.device).gather(1, cand)
                         if sampling is not None else None)
                token = int(cand[0, self._pick(score, sampling, noise)])
                picks.append(token)
                previous = cand.new_tensor([token])
                if not grammar.take(token):
                    break  # an end token: nothing follows it
        finally:
            grammar.rollback_taken()
        picks += [picks[-1]] * (logits.shape[0] - len(picks))
        return torch.tensor(picks, device=logits.device)

    @staticmethod
    def _pick(score: torch.Tensor, sampling: Sampler | None, noise: torch.Tensor | None) -> torch.Tensor:
        """The (1,) index of the candidate a (1, k) score picks: argmax, or the coupled draw when sampling."""
        if sampling is not None and noise is not None:
            q = sampling_probs(score, sampling.temperature, sampling.top_p, sampling.top_k)
            score = q.log() + noise
        return score.argmax(dim=-1)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash 2 drafter: the v1 forward pass with DFlash2Layer layers, then the selector's walk."""

    layer_class = DFlash2Layer
    reports_confidence = False  # its drafts come from the selector's walk

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        vocab, rank, top_k = cfg.raw.get("vocab_size"), cfg.selector_rank, cfg.selector_top_k
        # set in every DFlash 2 config (DrafterConfig.from_dict)
        assert vocab is not None and rank is not None and top_k is not None
        self.candidate_selector = CandidateSelector(cfg.hidden_size, int(vocab), rank, top_k)

    @torch.inference_mode()
    def draft(self, context, anchor, start, block_len, cache, embed_weight, lm_head, *, keep=None,
              sampler: Sampler | None = None, confidence: list[float] | None = None) -> torch.Tensor:
        """The selector's walk over the draft logits (no confidence: its drafts are not each row's maximum)."""
        hidden, logits = self.draft_logits(context, anchor, start, block_len, cache, embed_weight, lm_head, keep)
        return self.candidate_selector.walk(logits, hidden, anchor, start, sampler)


def drafter_class(cfg: DrafterConfig) -> type[DFlashDrafter]:
    return DFlash2Drafter if cfg.is_dflash2 else DFlashDrafter
