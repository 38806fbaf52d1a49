#!/usr/bin/env python
"""The adaptive controller's choices priced with measured unit costs: speculation against plain decoding
without the machine's noise, and two builds of the controller side by side.

Each reply runs the real `BlockSizeController` (engine/adaptive.py) as the decoding loop drives it
(engine/speculative.py): it chooses a block; a drafter that reports its confidence in each draft sees the block
cut to the drafts worth their verify rows; and the round's seconds come from unit costs (a decode, the verify
of 4/8/16 rows and the draft of a block kept to 4/8/16 slots, as `bench_engine.py --units-only` prints them;
sizes between on a line). Where the drafts come from:
- the oracle (default): each draft holds with probability q, left to right, and the drafter says it is q sure
  of each, as OracleDrafter does;
- `--record`: the demo drafter's own rounds, recorded at fixed full blocks on this machine (each draft's
  confidence and how many the target accepted) with the demo's decode, verify and draft timed in the same
  run, each round of a replay drawn from them.
Speed is tokens per second against plain decoding's. A live run of one reply moved by 5-20% with this VM's
state; this shows what the decisions cost. `--base DIR` adds another checkout's controller (its
engine/adaptive.py, standard library only) as a second column, on the same draws.

    python benchmarks/controller_sim.py --shape 1.7b-1k --tokens 48 128 --taus 1 2 4 --seeds 64
    python benchmarks/controller_sim.py --base /tmp/base
    python benchmarks/controller_sim.py --base /tmp/base --replies 3 --tokens 48   # a bench cell of 3 prompts
    python benchmarks/controller_sim.py --record --sets math code chat --base /tmp/base
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from dflash_cli.engine import adaptive
from dflash_cli.engine.adaptive import on_line
from dflash_cli.engine.oracle import acceptance_for_tau

# decode ms, verify ms by rows, draft ms by slots kept, the drafter's block, and whether a CPU runs it. The CPU
# shapes: 2 Zen 4 cores (AMD EPYC family 25 model 17; fma avx2 avx512f avx512_bf16 avx512_vnni), q4a8; the
# Qwen3 shapes random weights (bench_engine.py --units-only), the demo as the controller timed it
# (benchmarks/README.md). "gpu-8b": an assumed curve for Qwen3-8B on a GPU, a verify of 16 about 1.2 decodes.
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

Draw = Callable[[random.Random], tuple[list[float], int]]  # a full block's confidences and how many drafts held


def round_seconds(shape: dict) -> tuple:
    """(verify(n), draft(n)) in seconds from the unit costs, on a line between the sizes given (a verify of one
    row is a decode; a draft below the smallest size timed costs that one's, past the largest the largest's)."""
    verify = sorted({1: shape["decode"], **shape["verify"]}.items())
    draft = sorted(shape["draft"].items())
    return (lambda n: on_line(verify, n) / 1e3,
            lambda n: on_line(draft, min(max(n, draft[0][0]), draft[-1][0])) / 1e3)


def oracle(q: float, block: int) -> Draw:
    def draw(rng: random.Random) -> tuple[list[float], int]:
        held = 0
        while held < block - 1 and rng.random() < q:
            held += 1
        return [q] * (block - 1), held
    return draw


def reply(controller, draw: Draw, tokens: int, verify, draft, rng: random.Random, spikes: float = 0.0) -> float:
    """Seconds to commit `tokens` tokens, every round as the decoding loop runs it; `spikes`: the share of rounds
    a busy VM slows 1.5-3x (the rest within 3%), as the controller then times them."""
    done, seconds = 0, 0.0
    while done < tokens:
        n = min(controller.choose(), tokens - done)
        drafted, confidence, held = n, [], 0
        if n > 1:
            said, held = draw(rng)
            if n > 2 and controller.wants_confidence():
                confidence = said[: n - 1]
                n = 1 + controller.drafts_worth_verifying(confidence)
        accepted = min(held, n - 1)
        drafting = draft(drafted) if drafted > 1 else None
        spent = verify(n) + (drafting or 0.0)
        if spikes:
            slow = rng.uniform(1.5, 3.0) if rng.random() < spikes else rng.uniform(0.97, 1.03)
            spent, drafting = spent * slow, drafting and drafting * slow
        controller.observe(n, accepted, spent, drafting, confidence, drafted)
        seconds += spent
        done += accepted + 1
    return seconds


def load_controller_module(base: Path) -> ModuleType:
    """Another checkout's engine/adaptive.py."""
    spec = importlib.util.spec_from_file_location("base_adaptive", base / "src/dflash_cli/engine/adaptive.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_controller(module: ModuleType, shape: dict, shared):
    """As engine/state.py makes it (a CPU's first price where that build has one)."""
    rule = getattr(module, "first_row_price", None)
    extra = {"first_row_price": rule("cuda" if shape.get("gpu") else "cpu", shape["block"])} if rule else {}
    return module.BlockSizeController(shape["block"], shared=shared, **extra)


def speed(module: ModuleType, shape: dict, draw: Draw, tokens: int, seeds: int, kept: bool,
          replies: int = 1, spikes: float = 0.0) -> list[float]:
    """Speed against plain decoding, one value a seed, over `replies` replies of one process (sharing their
    costs, as bench's prompts or serve's requests do); `kept`: a process that starts from the round costs an
    earlier process of the same pair kept (as many replies of its own first). With `spikes`, plain decoding
    meets the same VM: its time is the mean round's (1 + spikes x 1.25 beyond the jitter's)."""
    verify, draft = round_seconds(shape)
    out = []
    for seed in range(seeds):
        rng = random.Random(seed)
        shared = module.RoundCosts()
        if kept:
            for _ in range(replies):
                reply(make_controller(module, shape, shared), draw, tokens, verify, draft, rng, spikes)
            shared = module.RoundCosts.from_dict(json.loads(json.dumps(shared.to_dict())))
        seconds = sum(reply(make_controller(module, shape, shared), draw, tokens, verify, draft, rng, spikes)
                      for _ in range(replies))
        out.append(replies * tokens * shape["decode"] * (1 + 1.25 * spikes) / 1e3 / seconds)
    return out


def recorded_demo(sets: list[str], limit: int, new_tokens: int) -> dict[str, tuple[dict, Draw]]:
    """Per prompt set, the demo's shape as timed in this run and a draw from its recorded rounds."""
    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_formats import cpu_line
    from draft_confidence import record  # beside this script

    import dflash_cli

    rt = dflash_cli.load("demo")
    print(f"CPU: {cpu_line()}; the demo's drafter in {getattr(rt.drafter, 'head_quant', None) or 'its own format'}",
          flush=True)
    block = rt.drafter.block_size
    out = {}
    for name in sets:
        rounds, s = record(rt, name, limit, new_tokens, block)
        rows = {block: 1e3 * s["verify"]}
        shape = dict(decode=1e3 * s["decode"], verify=rows, draft={block: 1e3 * s["draft"]}, block=block)
        print(f"demo {name}, timed in these generations: decode {shape['decode']:.2f} ms, verify of {block} "
              f"{rows[block]:.2f} ms ({rows[block] / shape['decode']:.2f} decodes), draft "
              f"{shape['draft'][block]:.2f} ms ({shape['draft'][block] / shape['decode']:.2f} decodes)", flush=True)
        out[f"demo {name} ({len(rounds)} rounds)"] = (shape, lambda rng, rounds=rounds: rng.choice(rounds))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[48, 128], help="reply lengths (default 48 128)")
    p.add_argument("--taus", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                   help="the oracle's tau at the drafter's block (1: never accepted)")
    p.add_argument("--seeds", type=int, default=64)
    p.add_argument("--spikes", type=float, default=0.0,
                   help="share of rounds slowed 1.5-3x, as a busy VM does (default 0: the unit costs exactly)")
    p.add_argument("--replies", type=int, default=1,
                   help="replies a process (a bench cell's prompts: they share the costs); speed over all of them")
    p.add_argument("--base", type=Path, help="another checkout whose controller runs beside this one")
    p.add_argument("--record", action="store_true", help="the demo drafter's recorded rounds instead of the oracle")
    p.add_argument("--sets", nargs="+", default=["math", "code", "chat"], help="with --record")
    p.add_argument("--limit", type=int, default=8, help="with --record: prompts a set")
    args = p.parse_args(argv)
    builds = {"this build": adaptive, **({"base": load_controller_module(args.base)} if args.base else {})}
    if args.record:
        cases = [(name, shape, "-", draw) for name, (shape, draw) in recorded_demo(args.sets, args.limit, 128).items()]
    else:
        cases = [(name, SHAPES[name], f"{tau:g}", oracle(0.0 if tau <= 1.0 else acceptance_for_tau(
            tau, SHAPES[name]["block"]), SHAPES[name]["block"])) for name in args.shape for tau in args.taus]
    heads = [f"{build}, {process}" for build in builds for process in ("fresh", "later")]
    print("| drafts | tokens | tau | " + " | ".join(f"{h}: mean (min)" for h in heads) + " |")
    print("|---|---:|---:|" + "---:|" * len(heads))
    for name, shape, tau, draw in cases:
        for tokens in args.tokens:
            cells = []
            for module in builds.values():
                for kept in (False, True):
                    got = speed(module, shape, draw, tokens, args.seeds, kept, args.replies, args.spikes)
                    cells.append(f"{statistics.mean(got):.3f} ({min(got):.3f})")
            print(f"| {name} | {tokens} | {tau} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
