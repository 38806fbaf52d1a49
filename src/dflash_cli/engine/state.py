"""Decoding state shared by the speculative and plain loops: committed tokens and both caches.

Invariant between steps (docs/format.md section 5):
    target cache length == draft cache length + pending context rows == start == len(tokens) - 1
The last committed token is the anchor: its K/V are not in any cache yet.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from dflash_cli.engine.adaptive import BlockSizeController, first_row_price, shared_costs
from dflash_cli.engine.drafter import DraftCache, Drafter
from dflash_cli.engine.errors import CacheTakenError
from dflash_cli.engine.hf_config import PREFILL_CHUNK
from dflash_cli.engine.static_cache import StaticCache
from dflash_cli.engine.target import Target, cache_length, crop_cache

_owners = itertools.count(1)
_draft_caches: weakref.WeakKeyDictionary[Drafter, DraftCache] = weakref.WeakKeyDictionary()


def shared_draft_cache(drafter: Drafter, capacity: int) -> DraftCache:
    """The drafter's one context cache for sequences of `capacity` rows (a new one only for a larger size)."""
    key = getattr(drafter, "drafter", drafter)  # an OracleDrafter drafts through the drafter it wraps
    cache = _draft_caches.get(key)
    if cache is None or cache.capacity < capacity:
        cache = _draft_caches[key] = drafter.new_cache(capacity)
    return cache


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DecodeState:
    """Caches and committed tokens of one sequence; reusable across turns of a conversation.

    A loaded model has one set of caches (the fast path's static cache, the drafter's context cache),
    allocated once, whatever number of conversations, API calls or benchmark runs use it: a new cache per
    conversation would cost a GiB-sized allocation each time and, on a GPU, recompile or re-record every
    CUDA graph that reads it. The newest state to prefill holds the caches; an older one that prefills
    again reads its prompt anew (`prefill` notices), and one that is taken over in the middle of a reply
    stops with CacheTakenError instead of decoding from another conversation's K/V. A state made with
    `own_caches` decodes alongside the others, at the cost of its own allocation. It also keeps the
    sequence's adaptive block-size choice (`block_controller`), so what it learned carries across turns.
    """

    def __init__(self, target: Target, drafter: Drafter | None, *, own_caches: bool = False):
        """`own_caches`: allocate caches for this state alone (a second conversation decoding alongside)."""
        self.target, self.drafter = target, drafter
        self.target_cache = target.new_cache() if own_caches else target.shared_cache()
        # on the fast path both caches are allocated once, for the whole context (the drafter's with a
        # block of spare rows: engine/draft_graph.py writes its padding past the block)
        capacity = target.fast.capacity + (drafter.block_size if drafter is not None else 0) \
            if target.fast is not None else 256
        self.draft_cache: DraftCache | None = None
        if drafter is not None:
            self.draft_cache = drafter.new_cache(capacity) if own_caches else shared_draft_cache(drafter, capacity)
        self._controller: BlockSizeController | None = None
        self._claim()

    def _claim(self) -> None:
        """Takes the caches over, empty, and forgets the committed tokens."""
        self.owner = next(_owners)
        self.tokens: list[int] = []
        if isinstance(self.target_cache, StaticCache):  # the fast path's: emptied by a length update
            self.target_cache.owner = self.owner
            self.target_cache.crop(0)
        elif cache_length(self.target_cache) > 0:  # a transformers cache grows as it goes: a new one is free
            self.target_cache = self.target.new_cache()
        if self.draft_cache is not None:
            self.draft_cache.owner = self.owner
            self.draft_cache.crop(0)
        self._pending: list[torch.Tensor] = []  # (1, P_i, n_taps*H) tapped states not yet in the draft cache
        self.anchor: torch.Tensor | None = None  # (1,) last committed token, on the target's device

    @property
    def holds_caches(self) -> bool:
        return all(getattr(c, "owner", self.owner) == self.owner for c in (self.target_cache, self.draft_cache)
                   if c is not None)

    def check_caches(self) -> None:
        """Raises CacheTakenError when another state took the caches (each decoding round asks first)."""
        if not self.holds_caches:
            raise CacheTakenError("another conversation used this model while this reply was decoding",
                                  hint="decode one reply at a time per loaded model (or load it twice)")

    @property
    def start(self) -> int:
        """Position of the anchor: the number of tokens whose target K/V are cached."""
        return len(self.tokens) - 1

    @property
    def pending(self) -> torch.Tensor | None:
        """(1, P, n_taps*H): the tapped states of the positions the draft cache does not hold yet, or None.

        Kept as the rounds' pieces and joined when read: joining at every commit copied the whole prompt's
        states once per plain round (12 MB a token at 1k tokens of context on the demo)."""
        if len(self._pending) > 1:
            self._pending = [torch.cat(self._pending, dim=1)]
        return self._pending[0] if self._pending else None

    @pending.setter
    def pending(self, value: torch.Tensor | None) -> None:
        self._pending = [] if value is None else [value]

    @property
    def pending_rows(self) -> int:
        return sum(p.shape[1] for p in self._pending)

    def check(self) -> None:
        """Asserts the invariant above; the tests call it after every step. Only a state that still holds the
        caches has it: another that prefilled since owns them (and this one reads its prompt anew)."""
        assert self.holds_caches, "another state took this one's caches"
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
        if not self.holds_caches:  # another conversation used the model since: read the prompt anew
            self._claim()
        covered = cache_length(self.target_cache)
        if self.draft_cache is not None:
            covered = min(covered, self.draft_cache.length + self.pending_rows)
        keep = min(common_prefix(self.tokens[:covered], prompt), len(prompt) - 1)
        # a hybrid target's recurrent state returns only to a few points (static_cache.LinearStates)
        keep = getattr(self.target_cache, "reachable", lambda n: n)(keep)
        self._truncate_caches(keep)
        self.tokens = list(prompt[:keep + 1])
        # On the fast path the prompt is read in pieces (its mask, the bias a fused kernel makes of it and
        # the MLP's intermediates then stay the size of a piece); each piece is committed as it finishes,
        # so an interrupted prompt leaves the pieces read so far, consistent and reusable.
        piece = PREFILL_CHUNK if self.target.fast is not None else len(prompt)
        for at in range(keep, len(prompt), piece):
            end = min(at + piece, len(prompt))
            new = torch.tensor([prompt[at:end]], dtype=torch.long, device=self.target.device)
            logits, hidden = self.target.forward(new, self.target_cache, at, last_logit_only=True,
                                                 taps=self.drafter is not None)
            if hidden is not None:
                self._pending.append(hidden)
            self.tokens = list(prompt[:end + 1])
        # The cache now holds all prompt tokens; the first generated token, committed by the caller,
        # becomes the anchor.
        return logits, keep

    def commit(self, tokens: list[int], hidden: torch.Tensor | None, anchor: torch.Tensor) -> None:
        """Appends tokens verified by the target whose forward added len(tokens) K/V rows (or more, cropped)."""
        self.tokens.extend(tokens)
        crop_cache(self.target_cache, self.start)
        if hidden is not None:
            self._pending.append(hidden)
        self.anchor = anchor

    def rewind(self, length: int) -> None:
        """Forgets committed tokens past `length` (used when a stop token falls inside an accepted block)."""
        assert 1 <= length <= len(self.tokens)
        self._truncate_caches(length - 1)
        self.tokens = self.tokens[:length]
        self.anchor = torch.tensor(self.tokens[-1:], dtype=torch.long, device=self.target.device)

    def repair(self) -> None:
        """Restores the invariant after an interrupted step (Ctrl-C inside a forward)."""
        if self.tokens and self.holds_caches:
            self._truncate_caches(self.start)
            self.anchor = torch.tensor(self.tokens[-1:], dtype=torch.long, device=self.target.device)

    def block_controller(self, block: int) -> BlockSizeController:
        """The adaptive block-size choice of this sequence for blocks of up to `block` (a new one when that
        changes)."""
        if self._controller is None or self._controller.max_block != block:
            self._controller = BlockSizeController(block, shared=shared_costs(self.drafter),
                                                   first_row_price=first_row_price(self.target.device.type, block))
        return self._controller

    def reset(self) -> None:
        self._claim()

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
