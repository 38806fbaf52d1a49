"""Adaptive speculation: pick each round's block size to maximise expected tokens per second.

The controller keeps, with exponential forgetting, the acceptance rate at each draft position given
that the earlier ones were accepted (q_k; before the target has ruled on a position, what the drafter's own
calibrated confidence in its warm-up drafts said of it, else 1/2), and the measured cost of a draft and of a
verify at each block size it has used. The expected tokens of a round of n slots are 1 + sum_k prod_{j<=k} q_j
(the bonus token always counts), its cost draft(n) + verify(n); a plain round (n = 1) commits one token for
verify(1). A size not measured yet is estimated as a draft between the sizes timed plus a verify on a line
through them and the plain round: the draft runs the whole block but its LM head only on the rows kept, and
that head is much of a real-size drafter's draft on a CPU (a Qwen3-1.7B-shaped drafter's 311 MB), so before
pausing on the draft of a full block the controller times a block of 2 once. When nothing beats plain
decoding, drafting pauses and is re-probed now and then with one draft (each probe that fails doubling the
wait, up to 8 times, and none oftener than keeps what probes cost beyond plain rounds to 2% of the time, 0.5%
for a drafter not worth drafting for a few hundred rounds whose confidence in its warm-up drafts said no block
pays), so a drafter that starts to pay again (code after prose, say) is noticed. Between probes a paused
drafter's round costs what a plain step does: the rates are priced again only every PAUSED_RECHECK_ROUNDS plain
rounds. Output stays lossless whatever is chosen: the block size only changes how many tokens each verify step
can commit.

A fresh controller warms up with up to three full blocks, a plain round timed after the first. On a CPU, a
drafter of blocks of 16 or more (`first_row_price`) has even its first block verified only as far as its drafts
are sure enough, at a verify row's usual price there, until that price is measured. The warm-up ends after
one block where a full block costs more than four plain rounds (measured, or estimated from a cut block), or
where neither the acceptance seen nor the drafter's own confidence in its drafts says any block beats plain
decoding: a weak drafter stops costing warm-up blocks, and one sure of drafts the target happened to reject
goes on.

Costs are kept per context length (buckets that double from 512 tokens): a verify of n rows attends over
every cached position, and a draft over the drafter's context, so the costs learned at 200 tokens are not
the ones at 7,000. A bucket the controller has not measured yet is measured first (a full block, then a
plain round, as at the start), its costs estimated meanwhile from the nearest bucket measured; acceptance
is one estimate over all lengths, forgotten as it goes. So speculation pauses where, at this length, no
block beats plain decoding, and comes back when a shorter context makes it pay again.

What rounds cost depends on the machine and the pair, not on the request, so the costs live in a
`RoundCosts` shared by every controller of one loaded drafter (bench's prompts, serve's requests, calls
from Python). A request after the first starts from measured costs and from the last request's acceptance
(weighted as a few rounds, so its own text takes over quickly) instead of three full blocks of warm-up:
where drafting does not pay, it pays nothing to find that out again, and a paused drafter's re-probes keep
the schedule they had backed off to. A cost's first rounds keep the least time seen (a one-time cost, a
first call or a page fault, only ever adds time), the later ones a moving average in which a round counts at no
more than 1.25 times the cost so far (a busy VM slows one round in tens 2-3x: followed, those made a paused
drafter's plain rounds look dear enough to draft again), and plain decoding measured once is measured again
while drafting, so one unlucky round does not keep a drafter on that is slower than plain decoding.
A later process of the same pair starts from the costs too (`to_dict`/`from_dict`, kept in the cache folder
by runtime/round_costs.py), after one block of its own (none where a full block costs more than four plain
rounds: the rates choose from the first round, a paused drafter re-probed as usual).
"""

from __future__ import annotations

import bisect
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

FIRST_BUCKET = 512  # context lengths below this share one set of costs; each bucket above doubles it


def length_bucket(length: int) -> int:
    """0 below FIRST_BUCKET tokens, then 1 up to twice that, 2 up to four times, ..."""
    return max(0, int(length) // FIRST_BUCKET).bit_length()


def draft_key(n: int) -> int:
    """The key of a bucket's cost table that holds the draft's own seconds in rounds of n slots (the draft runs
    the whole block, its LM head only the n - 1 rows kept: a real-size drafter's head read per draft is most
    of its cost on a CPU)."""
    return -n


def on_line(points: list[tuple[int, float]], n: int) -> float | None:
    """The value at n of the broken line through `points` (sorted by x), extended past either end along its
    nearest segment; the one value where there is one point; None where there is none."""
    if len(points) < 2:
        return points[0][1] if points else None
    i = bisect.bisect_left(points, (n, -math.inf))  # the first point at or past n
    if i < len(points) and points[i][0] == n:
        return points[i][1]
    (x0, y0), (x1, y1) = points[min(max(i - 1, 0), len(points) - 2):][:2]
    return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


def within(points: list[tuple[int, float]], n: int) -> float | None:
    """on_line between the first and last points, their values outside them."""
    return on_line(points, min(max(n, points[0][0]), points[-1][0])) if points else None

MAX_PROBE_GAP = 8  # re-probes back off up to this many times probe_every
PROBE_SHARE = 0.02  # and come no oftener than keeps what they cost beyond plain rounds to this share of the time
# ... this share for a drafter not worth drafting lately whose own confidence in its warm-up said no block pays
DOUBTED_PROBE_SHARE = 0.005
# while the rates keep drafting paused, they are worked out again only this often (or when the length moves to
# another bucket, or a round drafts): between, only the plain round's cost moves, a little each round, and
# pricing every block size each round cost 20-70 us of a 4-5 ms decode of the demo (1-1.5%)
PAUSED_RECHECK_ROUNDS = 8
WORTH_DECAY = 0.99  # per round: the rounds the rates chose to draft, counted over the last few hundred
PRIOR_ROUNDS = 4.0  # the weight, in rounds, a new request gives the previous requests' acceptance
WARMUP_MAX_COST = 4.0  # a full block dearer than this many plain rounds ends the warm-up after one
FIRST_SAMPLES = 3  # a cost's first rounds keep the least seconds seen, the later ones a moving average
SLOW_ROUND = 1.25  # ... in which a round counts at no more than this many times the cost so far (a busy VM's)
# a second draft's verify row that pays for drafts less likely than this (a GPU's: next to nothing) does not make
# asking a drafter how sure it is worth it
MIN_ROW_PRICE = 0.05
CALIBRATION_PRIOR = 4.0  # drafts' worth of trust in a drafter's confidence before its verified drafts are counted
RESTORED_PRIOR_ROUNDS = 1.0  # the weight, in rounds, of the acceptance an earlier process kept
# the chance of acceptance a verify row costs on a CPU before two sizes are measured: a row costs a tenth to a
# quarter of a decode there (the demo 0.09, a Qwen3-1.7B shape 0.2 at 1k tokens on 2 Zen 4 cores), so a fresh
# process's first full block verifies what its drafter is sure enough of, not every draft
CPU_FIRST_ROW_PRICE = 0.1
# ... for blocks of at least this many slots: cutting a first block of 8 saves at most 0.6 of the demo's decodes
# and hides from the warm-up how its last drafts fare (live on 2 Zen 4 cores, fresh replies to math prompts: tau
# 2.13-2.24 against 2.23-2.33 verifying the whole block, five runs), where a Qwen3-1.7B-shaped pair's block of 16
# cut to its sure drafts costs 97 ms instead of 201 (benchmarks/README.md, "The warm-up on a CPU")
FIRST_CUT_MIN_BLOCK = 16


def first_row_price(device_type: str, block: int) -> float | None:
    """The `first_row_price` of a controller of blocks of up to `block` slots on a device of this type."""
    return CPU_FIRST_ROW_PRICE if device_type == "cpu" and block >= FIRST_CUT_MIN_BLOCK else None


class RoundCosts:
    """Seconds per round by context-length bucket and block length, and the latest acceptance counts: what
    the controllers of one drafter learn that outlives a request."""

    def __init__(self) -> None:
        self.seconds: dict[int, dict[int, float]] = {}  # length bucket -> block length -> smoothed seconds
        self.samples: dict[int, dict[int, int]] = {}  # how many rounds each of those has seen
        self.reached: list[float] = []  # the latest controller's decayed counts (BlockSizeController's)
        self.accepted: list[float] = []
        # a paused drafter's re-probe schedule goes on from request to request: a reply of 64 tokens would
        # otherwise pay a probe or two (a draft and a verify of 2: ~3 decodes on a CPU) however often
        # probes have failed before
        self.probe_gap = 0  # 0: no controller has paused yet
        self.plain_streak = 0
        self.warmup_next = 0  # full blocks the next controller starts with, where not 0 (a restored process)
        # the drafter's confidence in its verified drafts, summed, against how many of them were accepted (decayed)
        self.said = self.held = 0.0
        # whether the drafter's calibrated confidence in its latest warm-up's drafts said some block beats plain
        # decoding (None: it reported none), and the rounds whose block the rates chose to draft (decayed): a
        # drafter that was worth drafting and paused had a bad stretch, one never worth it may be weak
        self.forecast_pays: bool | None = None
        self.worth = 0.0
        self.version = 0  # bumped by every cost recorded: the estimates drawn from the costs are kept until then

    def drafting_measured(self) -> bool:
        return any(n > 1 for costs in self.seconds.values() for n in costs)

    def to_dict(self) -> dict[str, Any]:
        """What a later process of the same pair on the same machine starts from (runtime/round_costs.py)."""
        return {"seconds": {str(b): {str(n): s for n, s in t.items()} for b, t in self.seconds.items()},
                "reached": self.reached, "accepted": self.accepted,
                "forecast_pays": self.forecast_pays, "worth": self.worth}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoundCosts:
        """The costs `to_dict` kept, each counted as one round: a cost measured in another process is a first
        sample (a later round's smaller time replaces it, plain decoding is timed again while drafting), so a
        machine that was busier or idler then misleads for a few rounds at most. The acceptance is a prior
        worth one round, and the first controller drafts one block before it decides (none where a full block
        costs more than WARMUP_MAX_COST plain rounds; on a CPU the block is cut to its sure drafts): the last
        process's last request may have been of another kind (prose after code), and a request that inherited
        its pause with no probe due would never measure its own. Raises ValueError (or TypeError, KeyError) on anything
        else."""
        costs = cls()
        for bucket, table in data["seconds"].items():
            row = {int(n): float(s) for n, s in table.items()}
            if any(not (0.0 < s < 3600.0) for s in row.values()) or any(n in (0, -1) for n in row):
                raise ValueError("a round cost out of range")
            costs.seconds[int(bucket)] = row
            costs.samples[int(bucket)] = dict.fromkeys(row, 1)
        costs.reached, costs.accepted = [float(x) for x in data["reached"]], [float(x) for x in data["accepted"]]
        if len(costs.reached) != len(costs.accepted) or any(
                not 0.0 <= a <= r for a, r in zip(costs.accepted, costs.reached)):
            raise ValueError("acceptance counts out of range")
        weight = costs.reached[1] if len(costs.reached) > 1 else 0.0
        if weight > RESTORED_PRIOR_ROUNDS:
            costs.reached = [x * RESTORED_PRIOR_ROUNDS / weight for x in costs.reached]
            costs.accepted = [x * RESTORED_PRIOR_ROUNDS / weight for x in costs.accepted]
        forecast, worth = data.get("forecast_pays"), float(data.get("worth", 0.0))  # absent from older files
        if (forecast is not None and not isinstance(forecast, bool)) or not 0.0 <= worth <= 1.0 / (1.0 - WORTH_DECAY):
            raise ValueError("forecast_pays or worth out of range")
        costs.forecast_pays, costs.worth = forecast, worth
        costs.warmup_next = 1
        return costs


_SHARED: weakref.WeakKeyDictionary[object, RoundCosts] = weakref.WeakKeyDictionary()


def adopt_costs(drafter: object, costs: RoundCosts) -> None:
    """Makes `costs` the drafter's shared ones (an earlier process's, runtime/round_costs.py)."""
    _SHARED[drafter] = costs


def shared_costs(drafter: object) -> RoundCosts:
    """The RoundCosts of a loaded drafter (it goes when the drafter does)."""
    costs = _SHARED.get(drafter)
    if costs is None:
        costs = _SHARED[drafter] = RoundCosts()
    return costs


class BlockSizeController:
    """Chooses the block length (anchor included) of the next round, from 1 to `max_block`."""

    def __init__(self, max_block: int, *, decay: float = 0.97, probe_every: int = 24, warmup: int = 3,
                 cost: Callable[[int], float] | None = None, shared: RoundCosts | None = None,
                 first_row_price: float | None = None):
        """`cost(n)`, when given, replaces measured round costs (tests and simulations); `shared`: the costs
        and acceptance earlier requests of the same drafter measured (`shared_costs`); `first_row_price`: the
        chance of acceptance a verify row is taken to cost until two sizes are measured (the module's
        `first_row_price()` gives a CPU's for blocks of 16 or more; None: every draft of those rounds is
        verified)."""
        self.max_block = max_block
        self.first_row_price = first_row_price
        self.decay, self.probe_every = decay, probe_every
        self.injected_cost = cost
        self.shared = shared if shared is not None else RoundCosts()
        self.reached = [0.0] * max_block  # [k] = weighted rounds whose block drafted position k (k >= 1)
        self.accepted = [0.0] * max_block  # [k] = ... that accepted it
        self._start_from(self.shared)
        # full blocks first, unless earlier requests measured what drafting costs and is worth here
        self.warmup = 0 if self.shared.drafting_measured() and any(self.reached) else warmup
        if self.shared.warmup_next:  # the first request of a process that restored its costs
            self.warmup, self.shared.warmup_next = self.shared.warmup_next, 0
        self._costs = self.shared.seconds
        self.bucket = 0  # the bucket of the context the next rounds run at
        self.rounds = 0
        # plain rounds since the last drafted one, and before the next re-probe of a paused drafter
        self._plain_streak = self.shared.plain_streak
        self._probe_gap = self.shared.probe_gap or probe_every
        self._since_plain = 0  # drafted rounds since the last plain one
        self.choice = max_block
        self._rate: float | None = None  # tokens per second expected of this round's choice, where the rates chose it
        self._worth_drafting = False  # whether the rates chose to draft this round
        self._priced: tuple[tuple, float | None] | None = None  # _row_price's last (inputs, answer)
        # the drafter's calibrated confidence in each draft of each warm-up block: a drafter sure of drafts the
        # target rejected was unlucky, one unsure of them is weak (a weak one's warm-up ends after one block)
        self._forecast: list[list[float]] = []
        self._forecast_means: list[float] = []  # ... its mean by position (read by every round's rates)
        self._probe_wait: int | None = None  # a paused drafter's affordable re-probe gap, worked out once a pause
        self.pause_reason = ""  # why the latest pause: the measured costs against the measured acceptance
        self._drawn: tuple[tuple[int, int], tuple[list[tuple[int, float]], list[tuple[int, float]]]] | None = None
        self._paused_at: tuple[int, int] | None = None  # (bucket, plain streak) where the rates last chose to pause

    def _start_from(self, shared: RoundCosts) -> None:
        """Takes the earlier requests' acceptance as a prior worth PRIOR_ROUNDS rounds."""
        weight = shared.reached[1] if len(shared.reached) > 1 else 0.0
        scale = min(1.0, PRIOR_ROUNDS / weight) if weight > 0 else 0.0
        for k in range(1, min(self.max_block, len(shared.reached))):
            self.reached[k] = shared.reached[k] * scale
            self.accepted[k] = shared.accepted[k] * scale

    def at(self, length: int) -> None:
        """The context length the next rounds run at (the committed tokens): its bucket's costs apply."""
        self.bucket = length_bucket(length)

    def measured_here(self, n: int) -> bool:
        return n in self._costs.get(self.bucket, {})

    @property
    def _cost(self) -> dict[int, float]:
        """Seconds per round by block length at the current length: this bucket's measurements once it has
        any (interpolated between them as at the start), else the nearest measured bucket's (the longer one
        of two as near: a cost that grows with length is not underestimated)."""
        if self._costs.get(self.bucket):
            return self._costs[self.bucket]
        near = min(self._costs, key=lambda b: (abs(b - self.bucket), -b), default=None)
        return self._costs[near] if near is not None else {}

    # -- estimates ---------------------------------------------------------------------------------
    def acceptance(self, k: int) -> float:
        """Estimated P(draft k accepted | drafts 1..k-1 accepted), with a weak prior: what the drafter's own
        (calibrated) confidence in its warm-up drafts said of draft k, else 1/2."""
        return (self.accepted[k] + self._forecast_acceptance(k)) / (self.reached[k] + 1.0)

    def expected_tokens(self, n: int) -> float:
        total, run = 1.0, 1.0
        for k in range(1, n):
            run *= self.acceptance(k)
            total += run
        return total

    def cost(self, n: int) -> float | None:
        """Seconds per round of n slots: measured, or estimated as a draft plus a verify, from the sizes measured
        (a plain round is a verify of one row)."""
        return self._estimate(n, self._lines())

    def draft_cost(self, n: int) -> float | None:
        """Seconds of the draft of a round of n slots: measured, or on a line between the sizes measured (the
        nearest one's outside them: a line drawn on past them from two close sizes' noise made small blocks
        look free)."""
        return within(self._lines()[0], n)

    def _lines(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """The draft's measured (size, seconds) and the verify's (a round's less its draft), by size; drawn
        again only when a cost was recorded or the length moved to another table (each round prices every
        block size: a paused drafter's round should cost what a plain step does)."""
        table = self._cost
        key = (id(table), self.shared.version)
        if self._drawn is not None and self._drawn[0] == key:
            return self._drawn[1]
        drafts = sorted((-k, s) for k, s in table.items() if k < 0)
        verifies = [(1, table[1])] if 1 in table else []
        verifies += [(m, table[m] - (within(drafts, m) or 0.0)) for m in sorted(table) if m > 1]
        self._drawn = (key, (drafts, verifies))
        return drafts, verifies

    def _estimate(self, n: int, lines: tuple[list[tuple[int, float]], list[tuple[int, float]]]) -> float | None:
        if self.injected_cost is not None:
            return self.injected_cost(n)
        table = self._cost
        if n in table:
            return table[n]
        drafts, verifies = lines
        if len(verifies) < 2 or n == 1:  # nothing drafted yet, or one block and no plain round
            # one measurement: assume the block size barely matters
            return table[verifies[0][0]] if verifies and n > 1 and 1 not in table else None
        # the verify grows with its rows where compute, not weight reads, dominates (CPUs), so smaller blocks
        # get tried at what they will cost; the draft is the one size timed until a second one is
        return max((within(drafts, n) or 0.0) + (on_line(verifies, n) or 0.0), 1e-9)

    def rates(self, acceptance: Callable[[int], float] | None = None) -> dict[int, float]:
        """Expected tokens per second at each block size whose cost is known or can be estimated (at
        `acceptance(k)` where given, else the measured acceptance)."""
        acceptance = acceptance or self.acceptance
        out = {}
        lines = self._lines()
        tokens, run = 1.0, 1.0  # expected_tokens(n), built up one position at a time (this runs every round)
        for n in range(1, self.max_block + 1):
            if n > 1:
                run *= acceptance(n - 1)
                tokens += run
            c = self._estimate(n, lines)
            if c:
                out[n] = tokens / c
        return out

    # -- decisions -----------------------------------------------------------------------------------
    def choose(self, length: int | None = None) -> int:
        """The next round's block length; `length`: the context it runs at (see `at`)."""
        if length is not None:
            self.at(length)
        self._rate, self._worth_drafting = None, False
        if self.rounds >= self.warmup and self._pause_holds() and not self._probe_due():
            return self.choice  # still paused: nothing but the plain round's cost moved (PAUSED_RECHECK_ROUNDS)
        drafted_here = any(n > 1 and self.measured_here(n) for n in range(2, self.max_block + 1))
        if self.rounds < self.warmup and self._warmup_settled():
            self.warmup = self.rounds  # one block told enough: more would cost several decodes each
        if self.rounds < self.warmup:
            # measure acceptance with full blocks first, and after the first what a plain round costs
            if self.injected_cost is None and drafted_here and not self.measured_here(1):
                self.choice, self.warmup = 1, self.warmup + 1
            else:
                self.choice = self.max_block
        elif self.injected_cost is None and self._costs and not drafted_here:
            self.choice = max(self._best_drafting(), 2)  # a new context length: what a block costs here
        elif self.cost(1) is None or (self.injected_cost is None and not self.measured_here(1)):
            self.choice = 1  # measure what plain decoding costs (here) once
        elif (self.injected_cost is None and self.choice > 1 and self._since_plain >= self.probe_every
              and self.shared.samples.get(self.bucket, {}).get(1, 0) < FIRST_SAMPLES):
            self.choice = 1  # and again now and then while drafting: one round may have carried a one-time cost
        elif self._probe_due():
            # re-probe a paused drafter with the cheapest drafted round, one draft: whether the first position
            # is accepted again says whether drafting may pay (a full block's verify, 2.5 decodes on a CPU,
            # is mostly lost where the drafter still fails); the rates then choose the block as usual
            self.choice = min(2, self.max_block)
            # each probe that does not end the pause waits twice as long for the next (up to 8x): a probe
            # costs more than the plain round it replaces
            self._probe_gap = min(2 * self._probe_gap, MAX_PROBE_GAP * self.probe_every)
        else:
            rates = self.rates()
            before, self.choice = self.choice, max(rates, key=rates.__getitem__) if rates else self.max_block
            self._rate = rates.get(self.choice)
            self._worth_drafting = self._rate is not None and self.choice > 1
            if self.choice == 1 and self._one_draft_size_timed():
                # about to pause on the draft of one size (a full block's): time a block of 2 once first, whose
                # draft's head runs on one row (where that head is most of a draft, blocks of 3-4 may pay)
                self.choice = 2
            if self.choice > 1:
                self._probe_gap = self.probe_every
            elif before > 1 and length is not None:  # drafting pauses (or a probe did not end the pause): why
                self.pause_reason = self._why_paused(length)
            self._paused_at = (self.bucket, self._plain_streak) if self.choice == 1 else None
        if self.choice > 1:
            self._paused_at = None
        return self.choice

    def _probe_due(self) -> bool:
        """Whether a paused drafter has waited long enough for its next re-probe."""
        return self.choice == 1 and self._plain_streak >= self._probe_gap and self._plain_streak >= self._wait()

    def _pause_holds(self) -> bool:
        """Whether the rates chose to pause fewer than PAUSED_RECHECK_ROUNDS plain rounds ago, at this length's
        bucket, with no drafted round since (measured costs only: injected ones are asked every round). Then
        none of the choices before the rates' applies but a re-probe: in the same bucket the rates ran only
        once drafting and plain rounds were measured there, and those measurements stay."""
        at = self._paused_at
        return (at is not None and self.choice == 1 and self.injected_cost is None and at[0] == self.bucket
                and 0 <= self._plain_streak - at[1] < PAUSED_RECHECK_ROUNDS)

    def drafts_worth_verifying(self, confidence: Sequence[float]) -> int:
        """How many of this round's drafts to verify, from each one's probability under the drafter (a trained
        drafter's is close to the rate the target accepts it at: the demo's drafts at 0.8-1.0 were accepted
        87-95% of the time, at 0.2-0.4 27-32%; `calibrated` corrects one that is surer or less sure than its
        drafts hold). Draft k is worth its row of the verify while the chance that drafts 1..k are all accepted
        pays for that row at the rate this round's block was chosen for (maximizing expected tokens less rate x
        cost maximizes the rate over many rounds). A CPU verify's row costs a tenth to a quarter of a decode, so
        unlikely tails are cut; a GPU's almost nothing. The first draft is always verified: its acceptance stays
        measured. A warm-up's full block is cut too (its cut drafts count at what the drafter expects of them):
        on a short reply the warm-up is much of what a weak drafter costs."""
        price = self._row_price()
        if price is None:
            return len(confidence)
        chance = 1.0
        for k, p in enumerate(self.calibrated(confidence), start=1):
            chance *= p
            if k > 1 and chance < price:
                return k - 1
        return len(confidence)

    def wants_confidence(self) -> bool:
        """Whether this round may cut drafts: a verify row costs at least MIN_ROW_PRICE in acceptance (a GPU's
        costs next to nothing: no drafter need work out how sure it is, nor the GPU wait for that)."""
        price = self._row_price()
        return price is not None and price >= MIN_ROW_PRICE

    def calibrated(self, confidence: Sequence[float]) -> list[float]:
        """The drafter's probabilities scaled by how often its verified drafts were accepted against how sure it
        was of them (CALIBRATION_PRIOR drafts' worth of trust to start with): a drafter trained on short
        prompts can be surer than its drafts hold behind a long one."""
        ratio = (self.shared.held + CALIBRATION_PRIOR) / (self.shared.said + CALIBRATION_PRIOR)
        return [min(1.0, p * ratio) for p in confidence]

    def _row_price(self) -> float | None:
        """The chance of acceptance that pays for one more row of a verify: the rate of the round's choice
        (where the rates did not choose it, a warm-up's block, the best rate) times what a row adds to a verify,
        the least-squares slope of the verify's cost over the sizes measured (the difference of two neighbours
        on the line would be their noise: measured 0.9 and -0.5 tokens' worth for two rows of the demo's);
        `first_row_price` before two sizes are measured. Worked out once a round (wants_confidence, then
        drafts_worth_verifying)."""
        key = (self.rounds, self.shared.version, self.bucket, self._rate)
        if self._priced is None or self._priced[0] != key:
            price = self._price_now()
            self._priced = (key, price if price is not None else self.first_row_price)
        return self._priced[1]

    def _price_now(self) -> float | None:
        rate = self._rate if self._rate is not None else max(self.rates().values(), default=None)
        if rate is None:
            return None
        if self.injected_cost is not None:
            cost, top = self.injected_cost, self.max_block
            return rate * max(0.0, (cost(top) - cost(2)) / (top - 2)) if top > 2 else None
        verifies = self._lines()[1]
        drafted = [(n, s) for n, s in verifies if n > 1]
        # within drafted rounds where two sizes are measured: a plain round lacks what every drafted one pays
        # (the taps, the acceptance), which a fit through it would spread over the rows (the demo: 0.53 ms a row
        # where the rows cost 0.4)
        verifies = drafted if len(drafted) >= 2 else verifies
        if len(verifies) < 2:
            return None
        mean_n = sum(n for n, _ in verifies) / len(verifies)
        mean_s = sum(s for _, s in verifies) / len(verifies)
        spread = sum((n - mean_n) ** 2 for n, _ in verifies)
        slope = sum((n - mean_n) * (s - mean_s) for n, s in verifies) / spread
        return rate * max(0.0, slope)

    def _warmup_settled(self) -> bool:
        """Whether the warm-up told enough once a drafted round and a plain round are measured here: a full block
        costs more than WARMUP_MAX_COST plain rounds, measured or estimated from a cut block's draft and verify
        (a CPU running a big drafter: a block of 16 of a Qwen3-1.7B-shaped pair costs 14 decodes on 2 Zen 1
        cores, 6 on 2 Zen 4 cores), or no block is expected to beat plain decoding either at the acceptance
        seen or at the drafter's own confidence in its warm-up drafts (a drafter sure of drafts the target
        rejected was unlucky; with no confidence reported, a GPU's rounds, the warm-up goes on). A paused
        drafter is re-probed as usual."""
        here = self._costs.get(self.bucket, {})
        if self.injected_cost is not None or 1 not in here or not any(n > 1 for n in here):
            return False
        full = self.cost(self.max_block)  # measured, or estimated from a cut block's
        if full is not None and full > WARMUP_MAX_COST * here[1]:
            return True
        return bool(self._forecast) and not self._drafting_paid(self.acceptance) and not self._drafting_paid(
            self._forecast_acceptance)

    def _drafting_paid(self, acceptance: Callable[[int], float]) -> bool:
        """Whether some drafted round is expected to beat plain decoding at this length, at `acceptance`."""
        rates = self.rates(acceptance)
        return max((r for n, r in rates.items() if n > 1), default=0.0) > rates.get(1, 0.0)

    def _forecast_acceptance(self, k: int) -> float:
        """What the drafter expected of its draft k in the warm-up's blocks (calibrated, mean over them)."""
        return self._forecast_means[k - 1] if k <= len(self._forecast_means) else 0.5

    def _wait(self) -> int:
        """_affordable_probe_gap, once a pause (the costs it reads move little between probes)."""
        if self._probe_wait is None:
            self._probe_wait = self._affordable_probe_gap()
        return self._probe_wait

    def _affordable_probe_gap(self) -> int:
        """The fewest plain rounds between re-probes for which a probe's extra cost (a draft and a verify of 2
        rows against a plain round) stays within PROBE_SHARE of the time (24 or fewer for the demo on a CPU or
        for a GPU, about 75 for a Qwen3-1.7B-shaped pair on 2 Zen 4 cores, whose probe costs 2.5 decodes), or
        within DOUBTED_PROBE_SHARE where the rates have not chosen to draft for a few hundred rounds and the
        drafter's own confidence in its warm-up drafts said no block pays: a drafter unsure of itself
        and never worth drafting here is less likely to start paying than one that was unlucky, or that paid
        before a bad stretch (a calibrated drafter is unsure during the stretch that paused it)."""
        probe, plain = self.cost(2), self.cost(1)
        if self.injected_cost is not None or not probe or not plain:
            return 0
        if self._forecast:  # this controller's warm-up; else the latest one's, kept in the shared costs
            self.shared.forecast_pays = self._drafting_paid(self._forecast_acceptance)
        doubted = self.shared.worth < 1.0 and self.shared.forecast_pays is False
        share = DOUBTED_PROBE_SHARE if doubted else PROBE_SHARE
        return math.ceil(max(0.0, probe - plain) / (share * plain))

    def _one_draft_size_timed(self) -> bool:
        """Whether the draft was timed at one block size only here, and a block of 2 not yet."""
        table = self._cost
        return (self.injected_cost is None and self.max_block > 2 and 2 not in table
                and sum(key < 0 for key in table) == 1)

    def _why_paused(self, length: int) -> str:
        """The measured costs against the measured acceptance that paused drafting, in words."""
        best, plain = self._best_drafting(), self.cost(1)
        cost = self.cost(best)
        if not plain or not cost:
            return ""
        return (f"at {length} tokens of context a block of {best} was expected to commit "
                f"{self.expected_tokens(best):.2f} tokens in {cost * 1e3:.1f} ms, plain decoding 1 in "
                f"{plain * 1e3:.1f} ms")

    def _best_drafting(self) -> int:
        rates = {n: r for n, r in self.rates().items() if n > 1}
        return max(rates, key=rates.__getitem__) if rates else self.max_block

    def observe(self, n: int, accepted: int, seconds: float, draft_seconds: float | None = None,
                confidence: Sequence[float] = (), drafted: int | None = None) -> None:
        """Records a round of n slots that accepted `accepted` drafts and took `seconds`, `draft_seconds` of
        them drafting. `drafted`: the block drafted where drafts_worth_verifying cut it to n (default n), and
        `confidence` the drafter's probability of each of its drafts: where every verified draft was accepted,
        the cut ones count at what the (calibrated) drafter expected of them, so that cutting the unlikely
        ones does not make the later positions look better than they are."""
        drafted = n if drafted is None else drafted
        if confidence and self.rounds < self.warmup:
            self._forecast.append(self.calibrated(confidence))
            self._forecast_means = [sum(said) / len(said) for said in (
                [row[k] for row in self._forecast if len(row) > k] for k in range(max(map(len, self._forecast))))]
        self.rounds += 1
        self.shared.worth = WORTH_DECAY * self.shared.worth + (1.0 if self._worth_drafting else 0.0)
        self._plain_streak = self._plain_streak + 1 if n == 1 else 0
        self._since_plain = 0 if n == 1 else self._since_plain + 1
        self.shared.plain_streak, self.shared.probe_gap = self._plain_streak, self._probe_gap
        if n > 1:
            self._probe_wait = None
            self._count_acceptance(n, accepted, confidence)
        if drafted > 1 and draft_seconds is not None:
            self._record(draft_key(drafted), draft_seconds)
            if drafted != n:  # the draft ran the head on more rows than a round of n keeps: priced at n's size
                seconds += (within(self._lines()[0], n) or draft_seconds) - draft_seconds
        self._record(n, seconds)

    def _count_acceptance(self, n: int, accepted: int, confidence: Sequence[float]) -> None:
        for k in range(1, self.max_block):
            self.reached[k] *= self.decay
            self.accepted[k] *= self.decay
        for k in range(1, min(accepted + 1, n - 1) + 1):  # positions 1..a accepted, a+1 rejected
            self.reached[k] += 1.0
            if k <= accepted:
                self.accepted[k] += 1.0
        if confidence:
            shared = self.shared
            reached = confidence[: min(accepted + 1, n - 1)]  # the verified drafts the target ruled on
            shared.said = self.decay * shared.said + sum(reached)
            shared.held = self.decay * shared.held + min(accepted, n - 1)
            chance = 1.0 if accepted == n - 1 else 0.0  # that the round would have reached the next position
            for k, p in zip(range(n, self.max_block), self.calibrated(confidence[n - 1 :])):
                if not chance:
                    break
                self.reached[k] += chance
                chance *= p
                self.accepted[k] += chance
        self.shared.reached, self.shared.accepted = list(self.reached), list(self.accepted)

    def _record(self, key: int, value: float) -> None:
        """A round's (key n) or a draft's (key -n) seconds at the current length."""
        here = self._costs.setdefault(self.bucket, {})
        counts = self.shared.samples.setdefault(self.bucket, {})
        self.shared.version += 1
        previous, count = here.get(key), counts.get(key, 0)
        counts[key] = count + 1
        if previous is None:
            here[key] = value
        elif count < FIRST_SAMPLES:  # a one-time cost (a first call, a page fault) only ever adds time
            here[key] = min(previous, value)
        else:  # one round a busy machine slowed 2-3x would move it 20-40% (and the choice with it)
            here[key] = 0.8 * previous + 0.2 * min(value, SLOW_ROUND * previous)
