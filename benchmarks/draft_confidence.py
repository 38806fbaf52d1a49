"""Verifying the drafts the drafter is sure of, against verifying every draft of the block chosen: the demo pair,
adaptive blocks both ways, in one process, alternating per prompt, each way with its own round costs and
acceptance (as two loaded pairs would have), plain decoding of the same prompt beside them.

    .venv/bin/python benchmarks/draft_confidence.py                     # math, code, chat; 8 prompts each
    .venv/bin/python benchmarks/draft_confidence.py --sets math --limit 4 -n 64

`all drafts`: the controller's block, every draft verified (before); `sure drafts`: the drafts after the last
one worth its verify row cut (BlockSizeController.drafts_worth_verifying). Prints decode tok/s per set (mean
over prompts), speculative/plain, tau, the mean verify rows, and whether all three outputs agree.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
from cpu_formats import cpu_line, prompts_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["math", "code", "chat"])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", "--new-tokens", type=int, default=128)
    ap.add_argument("--quant", default=None, help="the target's format (default: the demo's auto choice)")
    args = ap.parse_args()

    import dflash_cli
    from dflash_cli.engine.adaptive import RoundCosts, adopt_costs

    rt = dflash_cli.load("demo", quant=args.quant)
    ways = {"all": mock.patch.object(type(rt.drafter), "reports_confidence", False), "sure": contextlib.nullcontext()}
    costs = {way: RoundCosts() for way in ways}

    def run(way: str, ids: list[int]):
        adopt_costs(rt.drafter, costs[way])
        with ways[way]:
            return dflash_cli.generate(rt, ids, max_new_tokens=args.new_tokens)

    print(cpu_line())
    warm = prompts_for(["math"], 1, rt.tokenizer)[0][1]
    for way in costs:
        run(way, warm)
    print(f"{args.limit} prompts a set, {args.new_tokens} new tokens, adaptive blocks; decode tok/s (mean over "
          "prompts)")
    print("| set | plain | all drafts | sure drafts | sure/all | all x plain | sure x plain | tau all / sure "
          "| verify rows all / sure | same |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for set_name in args.sets:
        rates: dict[str, list[float]] = {}
        tau: dict[str, list[float]] = {}
        rows: dict[str, list[float]] = {}
        same = 0
        for i, (_, ids) in enumerate(prompts_for([set_name], args.limit, rt.tokenizer)):
            plain = dflash_cli.generate(rt, ids, max_new_tokens=args.new_tokens, block_size=1)
            rates.setdefault("plain", []).append(plain.stats.decode_tokens_per_second)
            outputs = [plain.tokens]
            for way in (("all", "sure") if i % 2 == 0 else ("sure", "all")):
                got = run(way, ids)
                stats = got.stats
                rates.setdefault(way, []).append(stats.decode_tokens_per_second)
                tau.setdefault(way, []).append(stats.acceptance_length)
                rows.setdefault(way, []).append(1 + stats.drafted / max(stats.steps, 1))
                outputs.append(got.tokens)
            same += all(o == outputs[0] for o in outputs)
        m = {k: statistics.mean(v) for k, v in rates.items()}
        t = {k: statistics.mean(v) for k, v in tau.items()}
        r = {k: statistics.mean(v) for k, v in rows.items()}
        print(f"| {set_name} | {m['plain']:.1f} | {m['all']:.1f} | {m['sure']:.1f} | {m['sure'] / m['all']:.3f} | "
              f"{m['all'] / m['plain']:.2f}x | {m['sure'] / m['plain']:.2f}x | {t['all']:.2f} / {t['sure']:.2f} | "
              f"{r['all']:.2f} / {r['sure']:.2f} | {same}/{args.limit} |", flush=True)


if __name__ == "__main__":
    main()
