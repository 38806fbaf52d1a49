"""Verifying the drafts the drafter is sure of, against verifying every draft of the block chosen (the demo pair).

    .venv/bin/python benchmarks/draft_confidence.py                     # math, code, chat; 8 prompts each
    .venv/bin/python benchmarks/draft_confidence.py --replay            # the same question without the noise

Live (default): adaptive blocks both ways in one process, alternating per prompt, each way with its own round
costs and acceptance (as two loaded pairs would have), plain decoding of the same prompt beside them. `all
drafts`: the controller's block, every draft verified (before); `sure drafts`: the drafts after the last one
worth its verify row cut (BlockSizeController.drafts_worth_verifying). Prints decode tok/s per set (mean over
prompts), speculative/plain, tau, the mean verify rows, and whether all three outputs agree.

--replay: the adaptive controller's choices move from run to run on a noisy machine, and so does a live
comparison. This records the demo drafter's rounds at fixed blocks of 8 (each draft's confidence and how many
the target accepted), measures a decode, a verify of 8 and a draft in the same run, then plays the real
controller over rounds drawn from the record with those costs (no timings involved), both ways, 200 replies of
64 rounds a set: speculative/plain, each way.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
from cpu_formats import cpu_line, prompts_for  # noqa: E402


def live(rt, sets: list[str], limit: int, new_tokens: int) -> None:
    import dflash_cli
    from dflash_cli.engine.adaptive import RoundCosts, adopt_costs

    ways = {"all": mock.patch.object(type(rt.drafter), "reports_confidence", False), "sure": contextlib.nullcontext()}
    costs = {way: RoundCosts() for way in ways}

    def run(way: str, ids: list[int]):
        adopt_costs(rt.drafter, costs[way])
        with ways[way]:
            return dflash_cli.generate(rt, ids, max_new_tokens=new_tokens)

    warm = prompts_for(["math"], 1, rt.tokenizer)[0][1]
    for way in costs:
        run(way, warm)
    print(f"{limit} prompts a set, {new_tokens} new tokens, adaptive blocks; decode tok/s (mean over prompts)")
    print("| set | plain | all drafts | sure drafts | sure/all | all x plain | sure x plain | tau all / sure "
          "| verify rows all / sure | same |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for set_name in sets:
        rates: dict[str, list[float]] = {}
        tau: dict[str, list[float]] = {}
        rows: dict[str, list[float]] = {}
        same = 0
        for i, (_, ids) in enumerate(prompts_for([set_name], limit, rt.tokenizer)):
            plain = dflash_cli.generate(rt, ids, max_new_tokens=new_tokens, block_size=1)
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
              f"{r['all']:.2f} / {r['sure']:.2f} | {same}/{limit} |", flush=True)


def record(rt, set_name: str, limit: int, new_tokens: int, block: int) -> tuple[list, dict[str, float]]:
    """[(confidences of a full block's drafts, drafts accepted)] of fixed blocks, and the seconds of a decode,
    a verify of `block` rows and a draft, from the same generations."""
    import dflash_cli

    drafter, seen = rt.drafter, []
    draft = drafter.draft

    def draft_and_note(*a, **k):
        confidence: list[float] = []
        drafts = draft(*a, **{**k, "confidence": confidence})
        if drafts.shape[0] == block - 1:
            seen.append(confidence)
        return drafts

    rounds, seconds = [], {"decode": [], "verify": [], "draft": []}
    for _, ids in prompts_for([set_name], limit, rt.tokenizer):
        plain = dflash_cli.generate(rt, ids, max_new_tokens=new_tokens, block_size=1)
        seconds["decode"].append(plain.stats.decode_seconds / plain.stats.steps)
        seen.clear()
        with mock.patch.object(drafter, "draft", draft_and_note):
            steps = list(dflash_cli.stream_generate(rt, ids, max_new_tokens=new_tokens, block_size=block))
        accepted = [s.accepted for s in steps if s.drafted == block - 1]
        rounds += list(zip(seen, accepted))
        stats = steps[-1].stats
        seconds["verify"].append(stats.verify_seconds / stats.steps)
        seconds["draft"].append(stats.draft_seconds / stats.steps)
    return rounds, {k: statistics.median(v) for k, v in seconds.items()}


def replay(rounds: list, cost, block: int, sure: bool, seed: int, length: int = 64) -> float:
    """Speculative/plain of one reply of `length` rounds drawn from `rounds`, the real controller choosing."""
    from dflash_cli.engine.adaptive import BlockSizeController

    rng = random.Random(seed)
    controller = BlockSizeController(block, cost=cost)
    tokens = seconds = 0.0
    for _ in range(length):
        n = controller.choose()
        accepted, confidence, drafted = 0, [], n
        if n > 1:
            confidence, full = rng.choice(rounds)
            confidence = confidence[: n - 1] if sure else []
            verified = controller.drafts_worth_verifying(confidence) if sure and n > 2 else n - 1
            accepted, n = min(full, verified), verified + 1
        controller.observe(n, accepted, cost(n), confidence=confidence, drafted=drafted)
        tokens, seconds = tokens + accepted + 1, seconds + cost(n)
    return tokens / seconds * cost(1)


def replayed(rt, sets: list[str], limit: int, new_tokens: int) -> None:
    block = rt.drafter.block_size
    print(f"recorded: {limit} prompts a set, {new_tokens} new tokens, blocks of {block}; replayed: 200 replies of "
          "64 rounds, speculative/plain")
    print("| set | rounds | decode ms | verify per row, decodes | draft, decodes | all drafts | sure drafts "
          "| sure/all |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for set_name in sets:
        rounds, s = record(rt, set_name, limit, new_tokens, block)
        slope, draft = (s["verify"] / s["decode"] - 1) / (block - 1), s["draft"] / s["decode"]

        def cost(n: int) -> float:
            return 1.0 if n == 1 else 1.0 + slope * (n - 1) + draft

        got = {sure: statistics.mean(replay(rounds, cost, block, sure, seed) for seed in range(200))
               for sure in (False, True)}
        print(f"| {set_name} | {len(rounds)} | {s['decode'] * 1e3:.2f} | {slope:.3f} | {draft:.2f} | "
              f"{got[False]:.3f}x | {got[True]:.3f}x | {got[True] / got[False]:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["math", "code", "chat"])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", "--new-tokens", type=int, default=128)
    ap.add_argument("--quant", default=None, help="the target's format (default: the demo's auto choice)")
    ap.add_argument("--replay", action="store_true", help="record fixed blocks, then replay the controller")
    args = ap.parse_args()

    import dflash_cli

    rt = dflash_cli.load("demo", quant=args.quant)
    print(cpu_line())
    (replayed if args.replay else live)(rt, args.sets, args.limit, args.new_tokens)


if __name__ == "__main__":
    main()
