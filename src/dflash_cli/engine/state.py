"""Decoding state shared by the speculative and plain loops: committed tokens and both caches.

Invariant between steps (docs/format.md section 5):
    target cache length == draft cache length + pending context rows == start == len(tokens) - 1
The last committed token is the anchor: its K/V are not in any cache yet.
"""

from __future__ import annotations

import torch

from dflash_cli.engine.drafter import DraftCache, Drafter
from dflash_cli.engine.target import Target, cache_length, crop_cache


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DecodeState:
    """Caches and committed tokens of one sequence; reusable across turns of a conversation."""

    def __init__(self, target: Target, drafter: Drafter | None):
        self.target, self.drafter = target, drafter
        self.tokens: list[int] = []
        self.target_cache = target.new_cache()
        # on the fast path both caches are allocated once, for the whole context
        capacity = target.fast.capacity if target.fast is not None else 256
        self.draft_cache: DraftCache | None = drafter.new_cache(capacity) if drafter is not None else None
        self.pending: torch.Tensor | None = None  # (1, P, n_taps*H) tapped states not yet in the draft cache
        self.anchor: torch.Tensor | None = None  # (1,) last committed token, on the target's device

    @property
    def start(self) -> int:
        """Position of the anchor: the number of tokens whose target K/V are cached."""
        return len(self.tokens) - 1

    @property
    def pending_rows(self) -> int:
        return 0 if self.pending is None else self.pending.shape[1]

    def check(self) -> None:
        """Asserts the invariant above; the tests call it after every step."""
        assert cache_length(self.target_cache) == self.start, (cache_length(self.target_cache), self.start)
        if self.draft_cache is not None:
            assert self.draft_cache.length + self.pending_rows == self.start, (
                self.draft_cache.length, self.pending_rows, self.start)

    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """Makes `prompt` the committed prefix, reusing the cached part it shares.

        Returns the logits of the last prompt position (1, V) and how many prompt tokens were reused.
        Only the tokens after the longest common prefix with the cached tokens are run through the target.
        """
        assert prompt, "empty prompt"
        covered = cache_length(self.target_cache)
        if self.draft_cache is not None:
            covered = min(covered, self.draft_cache.length + self.pending_rows)
        keep = min(common_prefix(self.tokens[:covered], prompt), len(prompt) - 1)
        # a hybrid target's recurrent state returns only to a few points (fast.LinearStates)
        keep = getattr(self.target_cache, "reachable", lambda n: n)(keep)
        self._truncate_caches(keep)
        new = torch.tensor([prompt[keep:]], dtype=torch.long, device=self.target.device)
        logits, hidden = self.target.forward(new, self.target_cache, keep, last_logit_only=True,
                                             taps=self.drafter is not None)
        self.tokens = list(prompt)
        if hidden is not None:
            self.pending = hidden if self.pending is None else torch.cat([self.pending, hidden], dim=1)
        # The cache now holds all prompt tokens; the first generated token, committed by the caller,
        # becomes the anchor.
        return logits, keep

    def commit(self, tokens: list[int], hidden: torch.Tensor | None, anchor: torch.Tensor) -> None:
        """Appends tokens verified by the target whose forward added len(tokens) K/V rows (or more, cropped)."""
        self.tokens.extend(tokens)
        crop_cache(self.target_cache, self.start)
        if hidden is not None:
            self.pending = hidden if self.pending is None else torch.cat([self.pending, hidden], dim=1)
        self.anchor = anchor

    def rewind(self, length: int) -> None:
        """Forgets committed tokens past `length` (used when a stop token falls inside an accepted block)."""
        assert 1 <= length <= len(self.tokens)
        self._truncate_caches(length - 1)
        self.tokens = self.tokens[:length]
        self.anchor = torch.tensor(self.tokens[-1:], dtype=torch.long, device=self.target.device)

    def repair(self) -> None:
        """Restores the invariant after an interrupted step (Ctrl-C inside a forward)."""
        if self.tokens:
            self._truncate_caches(self.start)
            self.anchor = torch.tensor(self.tokens[-1:], dtype=torch.long, device=self.target.device)

    def reset(self) -> None:
        DecodeState.__init__(self, self.target, self.drafter)

    def _truncate_caches(self, keep: int) -> None:
        """Keeps the target K/V and drafter context of positions < keep."""
        if cache_length(self.target_cache) > keep:
            crop_cache(self.target_cache, keep)
        if self.draft_cache is None:
            return
        if self.draft_cache.length >= keep:
            self.draft_cache.crop(keep)
            self.pending = None
        elif self.pending is not None:
            rows = keep - self.draft_cache.length
            self.pending = self.pending[:, :rows] if rows > 0 else None
