"""A drafter of controlled quality, for measuring the engine independently of drafter training.

It runs a real drafter forward (so it costs what drafting costs), then proposes the target's known
continuation instead, with each position wrong at a chosen rate. Used by the benchmarks and tests.
"""

from __future__ import annotations

import torch

from dflash_cli.engine.drafter import DFlashDrafter, DraftCache


def acceptance_for_tau(tau: float, block_size: int) -> float:
    """Per-position acceptance q giving mean committed tokens (1 - q^B) / (1 - q) = tau, by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        value = sum(q**k for k in range(block_size))
        lo, hi = (q, hi) if value < tau else (lo, q)
    return (lo + hi) / 2


class OracleDrafter:
    """A `Drafter` proposing `reference[start+1 : start+B]`, each token replaced by a wrong one with probability
    `1 - q`. It says it is q sure of each draft: what a calibrated drafter whose confidence tells nothing about
    which of its drafts hold would say (a trained drafter's tells more), so the adaptive controller's cut of
    unlikely drafts (engine/adaptive.py) applies to it as it does to every drafter the CLI loads."""

    reports_confidence = True

    def __init__(self, drafter: DFlashDrafter, reference: list[int], acceptance: float = 1.0, seed: int = 0,
                 vocab_size: int | None = None):
        self.drafter = drafter
        self.config = drafter.config
        device = drafter.hidden_norm.weight.device
        generator = torch.Generator().manual_seed(seed)
        ref = torch.tensor(reference, dtype=torch.long)
        wrong = torch.rand(len(reference), generator=generator) >= acceptance
        vocab = vocab_size or int(ref.max()) + 2
        ref = torch.where(wrong, (ref + 1) % vocab, ref)
        self.reference = ref.to(device)  # on the device once: drafting stays free of host syncs
        self.acceptance = acceptance

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def mask_token_id(self) -> int:
        return self.drafter.mask_token_id

    def new_cache(self, capacity: int = 256) -> DraftCache:
        return self.drafter.new_cache(capacity)

    def draft(self, context, anchor, start, block_len, cache, embed_weight, lm_head, *, keep=None,
              sampler=None, confidence=None) -> torch.Tensor:
        """The real drafter's forward (its confidence asked for where ours is: it costs what it costs), then the
        reference's tokens, each q sure."""
        asked: dict[str, list[float]] = {"confidence": []} if confidence is not None else {}
        real = self.drafter.draft(context, anchor, start, block_len, cache, embed_weight, lm_head, keep=keep,
                                  sampler=sampler, **asked)
        known = self.reference[start + 1 : start + 1 + real.shape[0]]
        if known.shape[0] < real.shape[0]:  # past the end of the reference: keep the real drafts
            known = torch.cat([known, real[known.shape[0]:]])
        if confidence is not None:
            confidence.extend([self.acceptance] * known.shape[0])
        return known
