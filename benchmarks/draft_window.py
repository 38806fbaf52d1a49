"""Which drafter context window (`--draft-window`) drafts best: tau by context length and window.

Each prompt is read once (its target and drafter caches kept, `DecodeState`), then answered with every window
in turn at fixed blocks (tau then depends on the drafts alone, not on timing, so this VM's noise does not
enter). The output must be the same whatever the window (it changes the drafts only); a row says so.

`notes`: each prompt of the sets behind notes that fill it to about N tokens, as `bench --context` makes them
(N = 0: the prompt alone). `copy`: requests to repeat or correct a passage of about N tokens (this project's
README and sources), where a drafter seeing the whole passage could copy from it.

`--speed`: decode tok/s instead, plain decoding beside adaptive speculation with each window (default: the
drafter's own and the whole context), in one process, the arms taking turns on each prompt read once.

    python benchmarks/draft_window.py [-m demo] [--contexts 0 1024 4096] [--windows 0 64 128 256] [--limit 4]
    python benchmarks/draft_window.py --task copy --contexts 300 1000 2000
    python benchmarks/draft_window.py --speed --contexts 1024 4096 8000   # tok/s: plain, the own window, all
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cpu_formats import cpu_line, prompts_for  # noqa: E402 (beside this script)

COPY_ASKS = ("Repeat the following text exactly, word for word:\n\n{}",
             "Fix any spelling mistakes in the following text and return it in full:\n\n{}",
             "{}\n\nRepeat the last paragraph above exactly.")


def notes_prompts(tokenizer, sets: list[str], limit: int, context: int) -> list[list[int]]:
    from dflash_cli.bench.local import long_context_ids

    prompts = [ids for _, ids in prompts_for(sets, limit, tokenizer)]
    return [long_context_ids(tokenizer, tokenizer.decode(ids), context) if context else ids for ids in prompts]


def copy_prompts(tokenizer, limit: int, size: int) -> list[list[int]]:
    from dflash_cli.engine.text import encode_prompt

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text() + (root / "src/dflash_cli/engine/adaptive.py").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for i in range(limit * len(COPY_ASKS)):
        start = i * 700 % max(len(ids) - size, 1)
        passage = tokenizer.decode(ids[start:start + size])
        out.append(encode_prompt(tokenizer, COPY_ASKS[i % len(COPY_ASKS)].format(passage)))
    return out


def tau_table(rt, args, prompts_at) -> None:
    """Tau at fixed blocks for every window, each prompt read once."""
    from dflash_cli.engine.generate import generate
    from dflash_cli.engine.state import DecodeState

    drafter, shipped = rt.drafter, rt.drafter.context_window
    block = args.block_size or drafter.block_size
    print(f"{args.model}: tau at blocks of {block} ({args.task}, {args.new_tokens} new tokens, greedy) by context "
          f"length and draft window (0: the whole context); the drafter's own: {shipped or 'none'}")
    print("| context | prompts | " + " | ".join(str(w) for w in args.windows) + " | same output |")
    print("|---:|---:|" + "---:|" * len(args.windows) + "---|")
    for context in args.contexts:
        prompts = prompts_at(context)
        taus: dict[int, list[float]] = {w: [] for w in args.windows}
        same = 0
        for ids in prompts:
            state = DecodeState(rt.target, drafter)  # the prompt is read once, for every window
            outputs = []
            for w in args.windows:
                drafter.context_window = w or None
                got = generate(rt.target, drafter, ids, max_new_tokens=args.new_tokens, block_size=block,
                               adaptive=False, state=state)
                taus[w].append(got.stats.acceptance_length)
                outputs.append(got.tokens)
            same += all(o == outputs[0] for o in outputs)
        drafter.context_window = shipped
        cells = " | ".join(f"{statistics.mean(taus[w]):.2f}" for w in args.windows)
        print(f"| {context} | {len(prompts)} | {cells} | {same}/{len(prompts)} |", flush=True)


def speed_table(rt, args, prompts_at) -> None:
    """Decode tok/s of plain decoding and of adaptive speculation with each window, in one process: each prompt
    read once, then answered by every arm, the order turning from prompt to prompt (this VM drifts); each
    window keeps its own round costs, as its own loaded pair would; a context's first prompt warms up."""
    from dflash_cli.engine.adaptive import RoundCosts, adopt_costs
    from dflash_cli.engine.generate import generate
    from dflash_cli.engine.state import DecodeState

    drafter, shipped = rt.drafter, rt.drafter.context_window
    arms = ["plain", *args.windows]
    costs = {w: RoundCosts() for w in args.windows}

    def answer(arm, ids, state):
        if arm == "plain":
            return generate(rt.target, None, ids, max_new_tokens=args.new_tokens, state=state)
        drafter.context_window = arm or None
        adopt_costs(drafter, costs[arm])
        return generate(rt.target, drafter, ids, max_new_tokens=args.new_tokens, state=state)

    print(f"{args.model}: decode tok/s ({args.task}, {args.new_tokens} new tokens, greedy, adaptive blocks), tau in "
          f"brackets; x plain: of the means / median per prompt; windows {args.windows} (0: the whole context)")
    print("| context | prompts | plain | " + " | ".join(f"window {w}" for w in args.windows) + " | "
          + " | ".join(f"{w} x plain" for w in args.windows) + " | same output |")
    print("|---:|---:|---:|" + "---:|" * 2 * len(args.windows) + "---|")
    for context in args.contexts:
        rates: dict = {a: [] for a in arms}
        taus: dict = {a: [] for a in arms}
        same = 0
        for i, ids in enumerate(prompts_at(context)):
            state = DecodeState(rt.target, drafter)
            outputs = {}
            for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
                got = answer(arm, ids, state)
                outputs[arm] = got.tokens
                if i:
                    rates[arm].append(got.stats.decode_tokens_per_second)
                    taus[arm].append(got.stats.acceptance_length)
            same += i > 0 and all(o == outputs["plain"] for o in outputs.values())
        drafter.context_window = shipped
        mean = {a: statistics.mean(v) for a, v in rates.items()}
        cells = " | ".join(f"{mean[w]:.1f} ({statistics.mean(taus[w]):.2f})" for w in args.windows)
        ratios = " | ".join(
            f"{mean[w] / mean['plain']:.3f} / "
            f"{statistics.median(r / p for r, p in zip(rates[w], rates['plain'])):.3f}" for w in args.windows)
        print(f"| {context} | {len(rates['plain'])} | {mean['plain']:.1f} | {cells} | {ratios} | "
              f"{same}/{len(rates['plain'])} |", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default="demo")
    p.add_argument("--draft", default=None, help="drafter folder (default: the model's own)")
    p.add_argument("--task", choices=("notes", "copy"), default="notes")
    p.add_argument("--speed", action="store_true",
                   help="decode tok/s against plain decoding (adaptive blocks) instead of tau at fixed blocks")
    p.add_argument("--sets", nargs="+", default=["math", "code", "chat"])
    p.add_argument("--limit", type=int, default=4, help="prompts per set (copy: per kind of request)")
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 256, 1024, 2048, 4096, 8000])
    p.add_argument("--windows", type=int, nargs="+", default=None,
                   help="0: all [default: 0 32 64 128 256 512 1024; --speed: the drafter's own and 0]")
    p.add_argument("-n", "--new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's trained block")
    args = p.parse_args(argv)

    import dflash_cli

    rt = dflash_cli.load(args.model, draft=args.draft,
                         max_context=max(8192, max(args.contexts) + args.new_tokens + 64))
    assert rt.drafter is not None, "the model needs a drafter"
    if args.windows is None:
        args.windows = [rt.drafter.context_window or 0, 0] if args.speed else [0, 32, 64, 128, 256, 512, 1024]
    print(cpu_line())

    def prompts_at(context: int) -> list[list[int]]:
        return (copy_prompts(rt.tokenizer, args.limit, context) if args.task == "copy"
                else notes_prompts(rt.tokenizer, args.sets, args.limit, context))

    (speed_table if args.speed else tau_table)(rt, args, prompts_at)


if __name__ == "__main__":
    main()
