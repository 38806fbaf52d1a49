#!/usr/bin/env python
"""Two builds of the adaptive controller on the demo pair in one process, each reply a first one (a fresh
process's): how much the warm-up costs or gains, live.

`--base DIR` names another checkout; its engine/adaptive.py (standard library only) is loaded beside this
tree's. Per prompt, in an order that rotates: plain decoding, this build's controller and the base's, each
starting from no costs and no acceptance, as the first reply of a process does (`generate` in a shell pipe
with an empty cache folder, `bench`'s first prompt). Decode tok/s per set (mean over prompts), each against
plain decoding of the same prompt, tau, and whether all outputs agree (greedy: they must).

    .venv/bin/python benchmarks/warmup_ab.py --base /tmp/base [--sets math code chat] [--limit 8] [-n 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from controller_sim import load_controller_module  # noqa: E402
from cpu_formats import cpu_line, prompts_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="another checkout (its src/ holds dflash_cli)")
    ap.add_argument("--sets", nargs="+", default=["math", "code", "chat"])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", "--new-tokens", type=int, default=64)
    args = ap.parse_args()

    import dflash_cli
    from dflash_cli.engine import adaptive
    from dflash_cli.engine.generate import generate

    rt = dflash_cli.load("demo")
    target, drafter = rt.target, rt.drafter
    block = drafter.block_size
    price = adaptive.first_row_price(target.device.type, block)
    base = load_controller_module(args.base)
    makers = {
        "this build": lambda: adaptive.BlockSizeController(block, shared=adaptive.RoundCosts(), first_row_price=price),
        "base": lambda: base.BlockSizeController(block, shared=base.RoundCosts()),
    }

    def run(arm: str, ids: list[int]):
        if arm == "plain":
            return generate(target, None, ids, max_new_tokens=args.new_tokens)
        return generate(target, drafter, ids, max_new_tokens=args.new_tokens, controller=makers[arm]())

    arms = ["plain", *makers]
    warm = prompts_for(["math"], 1, rt.tokenizer)[0][1]
    for arm in arms:
        run(arm, warm)
    print(cpu_line())
    print(f"{args.limit} prompts a set, {args.new_tokens} new tokens, each reply from no costs (a first reply); "
          f"decode tok/s, mean over prompts; x plain: mean of each prompt's ratio")
    print("| set | plain | this build (x plain) | base (x plain) | this / base | tau this / base | same |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    turn = 0
    for set_name in args.sets:
        rate: dict[str, list[float]] = {arm: [] for arm in arms}
        tau: dict[str, list[float]] = {arm: [] for arm in makers}
        same = 0
        for _, ids in prompts_for([set_name], args.limit, rt.tokenizer):
            order = arms[turn % len(arms):] + arms[: turn % len(arms)]
            turn += 1
            results = {arm: run(arm, ids) for arm in order}
            for arm, result in results.items():
                rate[arm].append(result.stats.decode_tokens_per_second)
                if arm in tau:
                    tau[arm].append(result.stats.acceptance_length)
            same += len({tuple(r.tokens) for r in results.values()}) == 1
        ratio = {arm: statistics.fmean(r / p for r, p in zip(rate[arm], rate["plain"])) for arm in makers}
        print(f"| {set_name} | {statistics.fmean(rate['plain']):.1f} | "
              + " | ".join(f"{statistics.fmean(rate[a]):.1f} ({ratio[a]:.3f}x)" for a in makers)
              + f" | {ratio['this build'] / ratio['base']:.3f} | "
              + " / ".join(f"{statistics.fmean(tau[a]):.2f}" for a in makers)
              + f" | {same}/{len(rate['plain'])} |")


if __name__ == "__main__":
    main()
