"""The held-out acceptance estimate: greedy speculative decoding replayed over the target's own replies.

Greedy decoding with a drafter commits exactly the target's greedy reply, so the path it takes through a
stored reply is known without running the target: at anchor p (the last committed token) the drafter
proposes x_{p+1..p+B-1} from the tapped states of positions < p, the target accepts the leading drafts
that equal the reply (a of them) and adds its own next token, and the next anchor is p + a + 1. This walks
that path with the full trained block over each reply's first REPLY_TOKENS tokens (what `bench` does
without --adaptive, at its default -n) and reports tau as `bench` does: decode tokens per verify step, the
first token (from the prefill) excluded, macro-averaged over replies (docs/format.md section 6).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.train.data import Example
from dflash_cli.train.forward import IGNORE, block_embeddings, block_labels, training_forward

REPLY_TOKENS = 128  # `bench`'s default -n: the later tokens of long replies are often easier to draft


def first_tokens(example: Example, max_tokens: int = REPLY_TOKENS) -> Example:
    """The example cut after its reply's first `max_tokens` tokens (as generation with that limit stops)."""
    end = min(len(example.ids), example.prompt_len + max_tokens)
    return Example(example.ids[:end], example.features[: end - 1], example.prompt_len)


@torch.no_grad()
def accepted_runs(drafter: DFlashDrafter, embed: torch.Tensor, draft_ids: Callable[[torch.Tensor], torch.Tensor],
                  example: Example, chunk: int = 64) -> list[int]:
    """For every anchor p = prompt_len .. len-2 of the reply, how many leading drafts of a full block equal
    the reply's next tokens (what greedy verification would accept at p).

    `draft_ids` maps the drafter's normed hidden states (..., H) to drafted token ids (...), as the engine
    drafts: argmax over the full LM head, or over the draft vocabulary's rows.
    """
    device = embed.device
    ids = example.ids.to(device)[None]
    n = ids.shape[1]
    features = example.features.to(device)[None]  # (1, n-1, D): a block at p reads rows < p <= n-2
    bsz = drafter.block_size
    lengths = torch.tensor([n], device=device)
    runs: list[int] = []
    for lo in range(example.prompt_len, n - 1, chunk):
        anchors = torch.arange(lo, min(lo + chunk, n - 1), device=device)[None]  # (1, A)
        labels = block_labels(ids, lengths, anchors, bsz, IGNORE)[0]  # (A, B); slot k is x_{p+k}
        h = training_forward(drafter, features, block_embeddings(drafter, ids, anchors, embed), anchors)
        h = h.view(anchors.shape[1], bsz, -1)
        run = torch.zeros(anchors.shape[1], dtype=torch.long, device=device)
        alive = torch.arange(anchors.shape[1], device=device)  # anchors whose drafts all matched so far
        for k in range(1, bsz):  # slot k drafts x_{p+k}; the LM head runs only where it can still count
            hit = draft_ids(h[alive, k]) == labels[alive, k]  # IGNORE (past the reply's end) matches no id
            alive = alive[hit]
            if not len(alive):
                break
            run[alive] += 1
        runs += run.tolist()
    return runs


def replay(runs: list[int]) -> tuple[int, int]:
    """(decode tokens, verify steps) of greedy speculative decoding along a reply, from `accepted_runs`:
    runs[i] drafts are accepted at the i-th anchor after the first token, and a step commits them plus the
    target's own token, never past the reply's end."""
    tokens = steps = i = 0
    while i < len(runs):
        committed = min(runs[i] + 1, len(runs) - i)
        tokens, steps, i = tokens + committed, steps + 1, i + committed
    return tokens, steps


def replay_tau(per_reply: list[tuple[int, int]], sets: list[str] | None = None) -> tuple[float, dict[str, float]]:
    """Macro tau over replies ((tokens, steps) each), overall and per named set (when `sets` names each
    reply's set); replies without a decode step count for nothing."""
    taus = [t / s for t, s in per_reply if s]
    overall = sum(taus) / len(taus) if taus else 1.0
    by_set: dict[str, list[float]] = {}
    for name, (t, s) in zip(sets, per_reply, strict=True) if sets is not None else ():
        if s:
            by_set.setdefault(name, []).append(t / s)
    return overall, {name: sum(v) / len(v) for name, v in sorted(by_set.items())}
