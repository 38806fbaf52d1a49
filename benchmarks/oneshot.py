"""One-shot `generate` processes in a row, as a shell pipe runs them: does each new process decode as fast as
it could, or pay the adaptive controller's warm-up again?

Per prompt, interleaved, one `dflash-cli generate --json` process each: plain decoding (`--no-draft`); speculation
starting fresh (the cache folder's round-costs/ removed first: what every process did before the costs were
kept); speculation starting from the costs the previous speculative process kept. Decode tok/s as the command
reports it (prefill and start-up excluded), averaged per set, and each against plain decoding; whether every
speculative reply equals the plain one (greedy: it must). `--base DIR` adds a fresh process of another checkout
(DIR/src first on the path) to each prompt's turn: two builds' warm-ups compared on the same minute.

    .venv/bin/python benchmarks/oneshot.py [--model demo] [--sets chat math] [--limit 6] [-n 64] [--base DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from dflash_cli.prompts.reader import load_prompt_set
from dflash_cli.settings import cache_dir

sys.path.insert(0, str(Path(__file__).parent))
from cpu_formats import cpu_line  # noqa: E402 (beside this script)

ARMS = ("plain", "fresh", "kept")


def generate(model: str, prompt: str, tokens: int, arm: str, extra: list[str], base: str | None = None) -> dict:
    if arm.startswith("fresh"):
        shutil.rmtree(cache_dir() / "round-costs", ignore_errors=True)
    command = [sys.executable, "-m", "dflash_cli", "generate", "-m", model, "-n", str(tokens), "--json", *extra,
               *(["--no-draft"] if arm == "plain" else []), prompt]
    env = dict(os.environ, PYTHONPATH=str(Path(base) / "src")) if arm == "fresh base" and base else None
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:8])} ...: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--sets", nargs="+", default=["chat", "math"])
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--base", metavar="DIR", help="another checkout whose fresh process joins each prompt's turn")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more generate options, last")
    args = ap.parse_args()
    arms = (*ARMS, "fresh base") if args.base else ARMS
    print(f"CPU: {cpu_line()}; model {args.model}; {args.tokens} new tokens; one process per reply")
    generate(args.model, "Hello", 8, "kept", args.extra)  # the model converted and the kernels built first
    based = "fresh base tok/s (x plain) | " if args.base else ""
    print(f"| set | plain tok/s | fresh tok/s (x plain) | kept tok/s (x plain) | {based}kept: drafted rounds "
          "| identical |")
    print("|---|---|---|---|---|---|" + ("---|" if args.base else ""))
    for name in args.sets:
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        drafted, same = [], 0
        prompts = load_prompt_set(name)[:args.limit]
        for prompt in prompts:
            replies = {arm: generate(args.model, prompt.prompt, args.tokens, arm, args.extra, args.base)
                       for arm in arms}
            for arm, reply in replies.items():
                rates[arm].append(reply["decode_tokens_per_second"])
            drafted.append(sum(replies["kept"]["block_rounds"][1:]))
            same += len({reply["text"] for reply in replies.values()}) == 1
        mean = {arm: statistics.fmean(v) for arm, v in rates.items()}
        base_cell = f"{mean['fresh base']:.1f} ({mean['fresh base'] / mean['plain']:.3f}x) | " if args.base else ""
        print(f"| {name} | {mean['plain']:.1f} | {mean['fresh']:.1f} ({mean['fresh'] / mean['plain']:.3f}x) | "
              f"{mean['kept']:.1f} ({mean['kept'] / mean['plain']:.3f}x) | {base_cell}"
              f"{statistics.fmean(drafted):.1f} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
