"""Two builds of the C kernels in one process, alternating: another checkout's `engine/cpu/native` sources (the
baseline) and this tree's, each loaded with the demo pair (q4a8), measured turn by turn so that a noisy
machine's drift falls on both alike. Separate processes a minute apart moved the demo's decode 4.4 -> 8.0 ms
on one 2-core VM; alternating inside one process keeps such comparisons to a few percent.

    git worktree add /tmp/base HEAD~3
    .venv/bin/python benchmarks/kernels_ab.py /tmp/base units              # decode, verify 8, draft, per round
    .venv/bin/python benchmarks/kernels_ab.py /tmp/base units --position 2000 --rounds 10 --reverse
    .venv/bin/python benchmarks/kernels_ab.py /tmp/base generate --block-size 8   # plain and DFlash tok/s

`units`: at --position, a 1-token decode, an 8-token verify and the drafter's draft of a block (cpu_formats.py's
unit_calls; best of 20 calls each), per round, both builds in turn (the order swaps every round); prints the
ratios new/baseline per round and their medians. `generate`: 8 prompts per set, each decoded plainly and
speculatively by both builds in turn, tok/s per set and whether all four outputs agree. Only the C sources
differ: the Python code is this tree's for both, so the baseline must have this tree's kernel ABI
(`dfq_abi_version`; a function whose arguments changed bumps it); a baseline library that lacks a newer kernel
(e.g. the drafter's C norm, or the shortlist head's second pass) gets the path that kernel replaced.
`--reverse` loads this tree's build first (the first runtime loaded may run a little faster: measure both
orders).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
from cpu_formats import prompts_for, unit_calls  # noqa: E402


def base_abi(sources: Path) -> int | None:
    found = re.search(r"int dfq_abi_version\(void\) \{ return (\d+); \}", (sources / "int8_matmul.c").read_text())
    return int(found.group(1)) if found else None


def load_both(base: Path, reverse: bool) -> dict:
    """{"base": runtime, "new": runtime}, each on its own build of the kernels."""
    import dflash_cli
    from dflash_cli.engine.cpu import native

    abi = base_abi(base / "src/dflash_cli/engine/cpu/native")
    if abi != native.ABI_VERSION:  # this tree's Python would call its functions with other arguments
        sys.exit(f"{base}'s kernels have ABI {abi}, this tree's {native.ABI_VERSION}: compare them in alternating "
                 "processes instead (cpu_formats.py --before, or dflash-cli bench from each checkout)")

    signatures = dict(native.SIGNATURES)
    norm = native.rms_norm
    # a baseline library without the C norm: its drafter keeps torch's norms
    native.rms_norm = lambda lib, *a: norm(lib, *a) if hasattr(lib, "dfq_rms_norm_rows") else None
    order = [("base", base / "src/dflash_cli/engine/cpu/native"), ("new", native.source_dir())]
    runtimes = {}
    for name, src in order[::-1] if reverse else order:
        native._state.clear()
        native.SIGNATURES.clear()  # only the functions this build has
        source = "".join(p.read_text() for p in src.glob("*.c"))
        native.SIGNATURES.update({k: v for k, v in signatures.items() if f" {k}(" in source})
        sources = tuple(s for s in native.SOURCES if (src / s).exists())  # a baseline from before a file
        with mock.patch.object(native, "source_dir", lambda src=src: src), \
                mock.patch.object(native, "SOURCES", sources):
            runtimes[name] = dflash_cli.load("demo", quant="q4a8", device="cpu")
        built = native.library()
        print(f"{name}: {built.path if built else native.unavailable()}", file=sys.stderr)
    native.SIGNATURES.update(signatures)
    return runtimes


def units(runtimes: dict, position: int, rounds: int) -> None:
    calls = {name: unit_calls(rt, position) for name, rt in runtimes.items()}
    kinds = list(calls["new"])
    got: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in kinds} for name in runtimes}
    for r in range(rounds):
        for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
            for kind in kinds:  # best of 20 calls
                best = float("inf")
                for _ in range(20):
                    start = time.perf_counter()
                    calls[name][kind]()
                    best = min(best, time.perf_counter() - start)
                got[name][kind].append(best * 1000)
    print(f"the demo at position {position}: a decode, a verify of 8 and a draft of a block, best of 20 calls, "
          f"{rounds} rounds (ms):")
    for name, rows in got.items():
        decode = statistics.median(rows["decode"])
        print(f"  {name:4s} " + "  ".join(f"{kind} {statistics.median(rows[kind]):.2f}" for kind in kinds)
              + "  (" + ", ".join(f"{kind} {statistics.median(rows[kind]) / decode:.2f}x" for kind in kinds[1:])
              + " a decode)")
    for kind in kinds:
        ratios = [n / b for b, n in zip(got["base"][kind], got["new"][kind])]
        print(f"  new/base {kind}: median {statistics.median(ratios):.3f}; rounds "
              + " ".join(f"{x:.2f}" for x in ratios))


def generate(runtimes: dict, sets: list[str], limit: int, new_tokens: int, block_size: int | None) -> None:
    import dflash_cli

    tokenizer = runtimes["new"].tokenizer
    speculative = {"block_size": block_size} if block_size else {}
    for rt in runtimes.values():  # warm-up, both loops
        ids = prompts_for(["math"], 1, tokenizer)[0][1]
        dflash_cli.generate(rt, ids, max_new_tokens=16, **speculative)
        dflash_cli.generate(rt, ids, max_new_tokens=16, block_size=1)
    blocks = f"blocks of {block_size}" if block_size else "adaptive blocks"
    print(f"{limit} prompts a set, {new_tokens} new tokens, {blocks}; decode tok/s (mean over prompts):")
    print("| set | plain base | plain new | DFlash base | DFlash new | DFlash new/base | DFlash/plain new | same |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for set_name in sets:
        rates: dict[tuple[str, str], list[float]] = {}
        same = 0
        for i, (_, ids) in enumerate(prompts_for([set_name], limit, tokenizer)):
            outputs = []
            for name in (("base", "new") if i % 2 == 0 else ("new", "base")):
                plain = dflash_cli.generate(runtimes[name], ids, max_new_tokens=new_tokens, block_size=1)
                spec = dflash_cli.generate(runtimes[name], ids, max_new_tokens=new_tokens, **speculative)
                rates.setdefault((name, "plain"), []).append(plain.stats.decode_tokens_per_second)
                rates.setdefault((name, "spec"), []).append(spec.stats.decode_tokens_per_second)
                outputs += [plain.tokens, spec.tokens]
            same += all(o == outputs[0] for o in outputs)
        m = {k: statistics.mean(v) for k, v in rates.items()}
        print(f"| {set_name} | {m['base', 'plain']:.1f} | {m['new', 'plain']:.1f} | {m['base', 'spec']:.1f} | "
              f"{m['new', 'spec']:.1f} | {m['new', 'spec'] / m['base', 'spec']:.3f} | "
              f"{m['new', 'spec'] / m['new', 'plain']:.2f}x | {same}/{limit} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path, help="a checkout (git worktree) whose kernels are the baseline")
    ap.add_argument("what", choices=("units", "generate"))
    ap.add_argument("--position", type=int, default=200, help="units: the cache's length before the forward")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--sets", nargs="+", default=["math", "code", "chat"])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", "--new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None, help="generate: fixed blocks (default adaptive)")
    ap.add_argument("--reverse", action="store_true", help="load this tree's build first")
    args = ap.parse_args()
    runtimes = load_both(args.base, args.reverse)
    if args.what == "units":
        units(runtimes, args.position, args.rounds)
    else:
        generate(runtimes, args.sets, args.limit, args.new_tokens, args.block_size)


if __name__ == "__main__":
    main()
