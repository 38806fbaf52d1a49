#!/usr/bin/env python
"""A greedy draft's head read through a shortlist (engine/cpu/int8act.ShortlistHead: a 4-bit copy scores every
row, the 8-bit codes each row's best 16 again) against the 8-bit head alone, alternating in one process, on
random heads of the demo drafter's draft vocabulary (21902 x 576), the demo's whole head (49152 x 576) and a
Qwen3-1.7B-shaped one (151936 x 2048), for the rows a draft keeps.

    .venv/bin/python benchmarks/shortlist_head.py --rounds 12

Per shape: how long the copy took to make, then per row count the median of the rounds' times (3 calls each)
and of their ratios, and whether both gave every row the same largest logit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash_cli.engine.cpu.int8act import Q8A8Linear, ShortlistHead

sys.path.insert(0, str(Path(__file__).parent))
from cpu_formats import cpu_line  # noqa: E402

SHAPES = ((21902, 576), (49152, 576), (151936, 2048))


def per_call(head: torch.nn.Module, x: torch.Tensor, calls: int = 3) -> float:
    head(x)
    started = time.perf_counter()
    for _ in range(calls):
        head(x)
    return (time.perf_counter() - started) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 7, 15])
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"CPU: {cpu_line()}; {torch.get_num_threads()} threads")
    print("| head | copy made in | rows | 8-bit ms | shortlist ms | shortlist / 8-bit | same argmax |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for vocab, width in SHAPES:
        exact = Q8A8Linear(torch.randn(vocab, width) * 0.02, [vocab], None)
        started = time.perf_counter()
        short = ShortlistHead(exact)
        made = time.perf_counter() - started
        for rows in args.rows:
            x = torch.randn(rows, width)
            times: dict[str, list[float]] = {"8-bit": [], "shortlist": []}
            for r in range(args.rounds):
                for name in (("8-bit", "shortlist") if r % 2 == 0 else ("shortlist", "8-bit")):
                    times[name].append(per_call(exact if name == "8-bit" else short, x))
            ratio = statistics.median(s / e for e, s in zip(times["8-bit"], times["shortlist"]))
            same = torch.equal(short(x).argmax(-1), exact(x).argmax(-1))
            print(f"| {vocab} x {width} | {made:.2f} s | {rows} | {statistics.median(times['8-bit']) * 1e3:.2f} | "
                  f"{statistics.median(times['shortlist']) * 1e3:.2f} | {ratio:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
