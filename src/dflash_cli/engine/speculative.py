"""The DFlash round: draft a block, verify it with one target forward, accept, roll back.

Acceptance rule (the paper's, written for one block): the drafter proposes d_1..d_{B-1} after the anchor
x_0; the target, fed [x_0, d_1..d_{B-1}], yields its own choice t_0..t_{B-1} at each slot (argmax at T=0,
a sample from its filtered distribution at T>0). Accept the longest prefix with d_i == t_{i-1}, a tokens,
then commit d_1..d_a plus the target's own t_a: every committed token is exactly what the target alone
would have chosen at that position, so the output is lossless (in distribution when sampling: one-hot
rejection sampling). At T>0 the drafter proposes with the sampler's own position-keyed noise, so its
drafts are samples of its distribution coupled to the target's (docs/engine.md, "Sampling: why coupled drafts").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dflash_cli.engine.adaptive import BlockSizeController
from dflash_cli.engine.device import Stopwatch
from dflash_cli.engine.drafter import Drafter
from dflash_cli.engine.sampling import Sampler, greedy_ids
from dflash_cli.engine.state import DecodeState


@dataclass(frozen=True)
class Round:
    """What one verify step committed. The first `accepted` tokens came from the drafter."""

    tokens: list[int]
    drafted: int  # block length - 1
    accepted: int
    draft_seconds: float
    verify_seconds: float
    wall_seconds: float


def read_context(state: DecodeState, drafter: Drafter) -> None:
    """Puts the prompt's tapped states into the drafter's context cache now, as part of reading the prompt.

    The first draft would do it anyway; done here it counts as prefill, and a first draft after a pause
    (a re-probe) does not carry the whole prompt's context rows. The draft it makes is thrown away.
    """
    target, anchor = state.target, state.anchor
    if not state.pending_rows or anchor is None or state.draft_cache is None:
        return
    drafter.draft(state.pending, anchor, state.start, drafter.block_size, state.draft_cache, target.embed_table,
                  target.logits_head, keep=1)
    state.pending = None


# what one more LM head call costs, in rows' worth of its per-row cost: reading the weights once (the demo's q8a8
# head on 2 Zen 1 cores: 2.5 ms for 1 row, 8.7 ms for 8, so about 1.6 ms fixed and 0.9 ms a row)
HEAD_CALL_ROWS = 2.0  # what a head call costs beyond its rows, in rows, where the target has not measured it


def first_head_rows(n: int, mean_accepted: float, head_costs: Sequence[float] | None = None) -> int:
    """How many of a verify's n rows the LM head should take first: the count that minimizes the expected
    cost of the head, its first call plus, when every draft in it is accepted, a second call on the rest,
    with drafts accepted independently at the rate that gives `mean_accepted` (a geometric count).
    `head_costs[k]`: what a call of k rows costs (Target.head_costs; past its end, its last step again);
    None: a call costs HEAD_CALL_ROWS rows beyond its own."""
    rate = mean_accepted / (1.0 + mean_accepted)

    def call(rows: int) -> float:
        if head_costs is None:
            return HEAD_CALL_ROWS + rows
        last = len(head_costs) - 1
        if rows <= last:
            return head_costs[rows]
        return head_costs[last] + (rows - last) * (head_costs[last] - head_costs[last - 1])

    def expected(first: int) -> float:
        rest = n - first
        return call(first) + (rate**first * call(rest) if rest else 0.0)

    return min(range(1, n + 1), key=expected)


def greedy_prefix(logits_of: Callable[[torch.Tensor], torch.Tensor], normed: torch.Tensor, drafts: list[int],
                  first: int) -> list[int]:
    """The target's greedy tokens at a verify's slots, up to and including the first slot whose token is not
    the draft after it: what the round commits. The LM head runs on the `first` rows, then, only if all their
    drafts were accepted, on the rest; the rows after a rejected draft (most of them with a weak drafter) get
    no head.
    On a row-exact head (the CPU formats that keep speculation lossless) each row's logits are its own in
    any company, so the tokens are those the whole block's logits give."""
    tokens: list[int] = []
    at, size = 0, first
    while True:
        for token in greedy_ids(logits_of(normed[at:at + size])).tolist():
            tokens.append(token)
            if len(tokens) > len(drafts) or token != drafts[len(tokens) - 1]:
                return tokens
        at, size = at + size, normed.shape[0]


def speculative_rounds(state: DecodeState, drafter: Drafter, sample: Sampler, *, block_size: int,
                       limit: int, controller: BlockSizeController | None = None) -> Iterator[Round]:
    """Yields one Round per target verify step until len(state.tokens) reaches `limit`.

    The caller has prefilled `state` and committed the first token. Each block has `block_size` slots,
    or what `controller` chooses (1 = a plain step that still feeds the drafter's context). The last
    block is clamped so that no more than `limit` tokens are ever committed.
    """
    target = state.target
    draft_watch, verify_watch = Stopwatch(target.device), Stopwatch(target.device)
    # greedy verifies on the CPU fast path stop the LM head at the first rejected draft (greedy_prefix)
    greedy = sample.greedy and not sample.constrained
    defer_head = greedy and target.defers_head
    mean_accepted = 1.0  # drafts accepted per verify, recent rounds weighted most: sizes the head's first piece
    head_costs = target.head_costs() if defer_head else None
    no_drafts: torch.Tensor | None = None  # a plain round's drafts, made once
    while len(state.tokens) < limit:
        t0 = time.perf_counter()
        state.check_caches()
        want = controller.choose(state.start) if controller is not None else block_size  # at this length
        n = min(want, limit - len(state.tokens))  # block length, anchor included
        start, anchor = state.start, state.anchor
        assert anchor is not None  # the caller committed the first token

        draft_watch.start()
        # a drafter that knows how sure it is of each greedy draft says so, and the drafts after the last one worth
        # its verify row are not verified (drafts_worth_verifying)
        confidence: list[float] = []
        drafted = n
        ask_confidence = (controller is not None and n > 2 and greedy and getattr(drafter, "reports_confidence", False)
                          and controller.wants_confidence())
        if n > 1:  # draft the trained block, verify its first n-1 drafts
            assert state.draft_cache is not None  # a state made with a drafter has one
            # (only asked where it reports confidence: a drafter written before the keyword works on)
            asked = {"confidence": confidence} if ask_confidence else {}
            drafts = drafter.draft(state.pending, anchor, start, drafter.block_size, state.draft_cache,
                                   target.embed_table, target.logits_head, keep=n - 1, sampler=sample,
                                   **asked)  # (n-1,)
            state.pending = None  # now in the draft cache
        else:
            if no_drafts is None:
                no_drafts = anchor.new_empty(0)
            drafts = no_drafts
        if controller is not None and len(confidence) == n - 1 > 1:
            n = 1 + controller.drafts_worth_verifying(confidence)
            drafts = drafts[: n - 1]
        draft_watch.stop()

        verify_watch.start()
        block = torch.cat([anchor, drafts])[None] if n > 1 else anchor[None]  # (1, n)
        if defer_head and n > 1:
            normed, hidden = target.forward(block, state.target_cache, start, taps=True, logits=False)
            first = first_head_rows(n, mean_accepted, head_costs)
            host = greedy_prefix(target.logits_of, normed, drafts.tolist(), first=first)
            host.append(len(host) - 1)
            mean_accepted += 0.2 * (host[-1] - mean_accepted)
            choice = torch.tensor(host[:-1], device=anchor.device)
        else:
            logits, hidden = target.forward(block, state.target_cache, start, taps=True)  # (n, V), (1, n, F)
            choice = sample.verify(logits, start + 1, drafts)  # (n,) the target's own token at every slot
            # (positions start+1..; a grammar's sampler fills the slots after the first mismatch, never read)
            if n > 1:
                accepted = (drafts == choice[:-1]).cumprod(dim=0).sum()
                host = torch.cat([choice, accepted.view(1)]).tolist()  # the step's one host-device sync
            else:  # a paused drafter's plain round: as cheap as plain decoding's
                host = choice.tolist() + [0]
        verify_watch.stop()

        a = host[-1]
        assert hidden is not None  # asked for with taps=True
        if n == 1:  # (no views to take: a paused drafter's round costs what a plain step does)
            state.commit(host[:1], hidden, anchor=choice)
        else:
            state.commit(host[: a + 1], hidden[:, : a + 1], anchor=choice[a : a + 1])
        sample.advance(host[: a + 1])
        round_ = Round(host[: a + 1], n - 1, a, draft_watch.seconds, verify_watch.seconds,
                       time.perf_counter() - t0)
        if controller is not None:
            controller.observe(n, a, round_.wall_seconds, round_.draft_seconds, confidence, drafted)
        yield round_
