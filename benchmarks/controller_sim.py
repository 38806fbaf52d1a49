#!/usr/bin/env python
"""The adaptive controller's choices priced with measured unit costs: speculation against plain decoding
without the machine's noise.

Each reply runs the real `BlockSizeController` (engine/adaptive.py) as the decoding loop drives it
(engine/speculative.py): it chooses a block, a drafter that reports confidence q for each draft sees its
block cut to the drafts worth their verify rows, drafts hold left to right with probability q each (the
oracle drafter of the benchmarks), and the round's seconds come from the unit costs given (a decode, the
verify of 4/8/16 rows and the draft of a block kept to 4/8/16 slots, as `bench_engine.py --units-only`
prints them; sizes between on a line). Speed is tokens per second against plain decoding's decode cost.
A live run of one reply moves by 5-20% with the VM's state; this shows what the decisions cost.

    python benchmarks/controller_sim.py --shape 1.7b-1k --tokens 48 128 --taus 1 2 4 --seeds 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from dflash_cli.engine import adaptive
from dflash_cli.engine.adaptive import BlockSizeController, RoundCosts, on_line
from dflash_cli.engine.oracle import acceptance_for_tau

# decode ms, verify ms by rows, draft ms by slots kept, the drafter's block, and whether a CPU runs it. The CPU
# shapes: 2 Zen 4 cores (AMD EPYC family 25 model 17; fma avx2 avx512f avx512_bf16 avx512_vnni), q4a8; the
# Qwen3 shapes random weights (bench_engine.py --units-only), the demo as the controller timed it
# (benchmarks/README.md). "gpu-8b": Qwen3-8B's shape on an H200 in bf16, a verify of 16 about 1.2 decodes.
SHAPES = {
    "demo": dict(decode=4.4, verify={4: 6.0, 8: 8.3}, draft={2: 1.0, 4: 1.1, 8: 1.3}, block=8),
    "gpu-8b": dict(decode=10.0, verify={4: 10.4, 8: 10.9, 16: 12.0}, draft={4: 2.5, 8: 2.6, 16: 2.8}, block=16,
                   gpu=True),
    "1.7b-256": dict(decode=32.3, verify={4: 49.1, 8: 69.0, 16: 114.1}, draft={4: 36.9, 8: 42.5, 16: 50.4}, block=16),
    "1.7b-1k": dict(decode=34.6, verify={4: 58.5, 8: 80.1, 16: 146.7}, draft={4: 44.9, 8: 51.5, 16: 54.7}, block=16),
    "1.7b-4k": dict(decode=59.2, verify={4: 103.3, 8: 156.0, 16: 252.4}, draft={4: 33.9, 8: 50.6, 16: 83.6}, block=16),
    "4b-256": dict(decode=75.9, verify={4: 99.4, 8: 145.3, 16: 262.9}, draft={4: 48.4, 8: 47.3, 16: 68.3}, block=16),
    "4b-1k": dict(decode=68.6, verify={4: 123.0, 8: 170.1, 16: 314.9}, draft={4: 32.9, 8: 49.6, 16: 67.6}, block=16),
}


def round_seconds(shape: dict) -> tuple:
    """(verify(n), draft(n)) in seconds from the unit costs, on a line between the sizes given (a verify of one
    row is a decode; a draft below 4 slots costs a draft of 4, past 16 one of 16)."""
    verify = sorted({1: shape["decode"], **shape["verify"]}.items())
    draft = sorted(shape["draft"].items())
    return (lambda n: on_line(verify, n) / 1e3,
            lambda n: on_line(draft, min(max(n, draft[0][0]), draft[-1][0])) / 1e3)


def reply(controller: BlockSizeController, q: float, tokens: int, verify, draft, rng: random.Random,
          confident: bool) -> float:
    """Seconds to commit `tokens` tokens, every round as the decoding loop runs it."""
    done, seconds = 0, 0.0
    while done < tokens:
        n = min(controller.choose(), tokens - done)
        drafted, confidence = n, []
        if n > 2 and confident and controller.wants_confidence():
            confidence = [q] * (n - 1)
            n = 1 + controller.drafts_worth_verifying(confidence)
        accepted = 0
        while accepted < n - 1 and rng.random() < q:
            accepted += 1
        drafting = draft(drafted) if drafted > 1 else None
        spent = verify(n) + (drafting or 0.0)
        controller.observe(n, accepted, spent, drafting, confidence, drafted)
        seconds += spent
        done += accepted + 1
    return seconds


def controller(shape: dict, shared: RoundCosts) -> BlockSizeController:
    """As engine/state.py makes it (a CPU's first price where this build has one)."""
    price = getattr(adaptive, "CPU_FIRST_ROW_PRICE", None)
    extra = {"first_row_price": price} if price is not None and not shape.get("gpu") else {}
    return BlockSizeController(shape["block"], shared=shared, **extra)


def speed(shape: dict, q: float, tokens: int, seeds: int, kept: bool, confident: bool) -> list[float]:
    """Speed against plain decoding, one value a seed; `kept`: the reply of a process that starts from the
    round costs an earlier process of the same pair kept (one reply of its own first)."""
    verify, draft = round_seconds(shape)
    out = []
    for seed in range(seeds):
        rng = random.Random(seed)
        shared = RoundCosts()
        if kept:
            reply(controller(shape, shared), q, tokens, verify, draft, rng, confident)
            shared = RoundCosts.from_dict(json.loads(json.dumps(shared.to_dict())))
        seconds = reply(controller(shape, shared), q, tokens, verify, draft, rng, confident)
        out.append(tokens * shape["decode"] / 1e3 / seconds)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[48, 128], help="reply lengths (default 48 128)")
    p.add_argument("--taus", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                   help="the oracle's tau at the drafter's block (1: never accepted)")
    p.add_argument("--seeds", type=int, default=64)
    p.add_argument("--no-confidence", action="store_true", help="the drafter reports no confidence (no cuts)")
    args = p.parse_args(argv)
    print("| shape | tokens | tau | fresh process: mean (min) | later process: mean (min) |")
    print("|---|---:|---:|---:|---:|")
    for name in args.shape:
        shape = SHAPES[name]
        for tokens in args.tokens:
            for tau in args.taus:
                q = 0.0 if tau <= 1.0 else acceptance_for_tau(tau, shape["block"])
                cells = []
                for kept in (False, True):
                    got = speed(shape, q, tokens, args.seeds, kept, not args.no_confidence)
                    cells.append(f"{statistics.mean(got):.3f} ({min(got):.3f})")
                print(f"| {name} | {tokens} | {tau:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
