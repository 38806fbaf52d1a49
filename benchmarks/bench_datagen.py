#!/usr/bin/env python
"""Training-data generation on this CPU: transformers' generate (train/data.py:generate_batch, what `train`
used before) against the batched generator (train/batched.py), side by side in one run.

The built-in SmolLM2-135M-Instruct answers the same chat-templated `mix` prompts with the same
max_new_tokens and stop ids in every row; tapped features are captured as `train` captures them (the demo
drafter's taps). Rows run interleaved, round after round, so that load from other processes falls on all
of them alike; each row's tokens/s is its median over the rounds, and its ratio is against the baselines
measured in the same run. "same answers" counts the prompts answered exactly as transformers' generate
answers them in the same dtype (fp32 should give all of them; bf16 rounds differently by batch shape).

    .venv/bin/python benchmarks/bench_datagen.py                       # about 5 minutes on 2 cores
    .venv/bin/python benchmarks/bench_datagen.py --prompts 64 --max-new-tokens 32 --widths 16 64 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_formats import cpu_line  # noqa: E402 - the same CPU line as the other CPU benchmark

from dflash_cli.train.data import Example  # noqa: E402


def demo_taps() -> list[int]:
    from dflash_cli.models.registry import demo_drafter_dir

    config = json.loads((demo_drafter_dir() / "config.json").read_text())
    return list(config["dflash_config"]["target_layer_ids"])


def baseline_run(target, prompts: list[list[int]], taps: list[int], args, stops: list[int], pad_id: int):
    """generate_batch over batches of 16 in build_dataset's order (similar lengths together)."""
    from dflash_cli.train.data import generate_batch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    found: dict[int, Example] = {}
    for at in range(0, len(order), args.baseline_batch):
        chunk = order[at:at + args.baseline_batch]
        examples = generate_batch(target, [prompts[i] for i in chunk], taps, max_new_tokens=args.max_new_tokens,
                                  stop_ids=stops, pad_id=pad_id)
        found.update(zip(chunk, examples))
    return [found[i] for i in range(len(prompts))]


def batched_run(target, prompts: list[list[int]], taps: list[int], args, stops: list[int], width: int, weights):
    from dflash_cli.train.batched import GenFormat, generate_batched

    fmt = GenFormat(target.embed_weight.dtype, weights, "benchmark")
    return generate_batched(target, prompts, taps, max_new_tokens=args.max_new_tokens, stop_ids=stops,
                            width=width, fmt=fmt)


def plan(args, targets: dict, prompts, taps, stops, pad_id) -> list[tuple[str, str, int, str, Callable]]:
    """(generator, format, batch, dtype of its target, run) per row."""
    rows: list[tuple[str, str, int, str, Callable]] = []
    for dtype in args.baselines:
        rows.append(("transformers generate", dtype, args.baseline_batch, dtype,
                     lambda t=targets[dtype]: baseline_run(t, prompts, taps, args, stops, pad_id)))
    for fmt in args.formats:
        dtype = "fp32" if fmt in ("fp32", "q4a8", "q8a8") else "bf16"  # 8-bit activations: fp32 around them
        for width in (args.widths if fmt == args.formats[0] else [args.width]):
            rows.append(("batched (fast path)", fmt, width, dtype,
                         lambda t=targets[dtype], w=width, q=(fmt if fmt in ("q4", "q4a8", "q8a8") else None):
                         batched_run(t, prompts, taps, args, stops, w, q)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256, help="mix prompts answered per row")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64, 128],
                        help="batch widths of the first format")
    parser.add_argument("--width", type=int, default=64, help="batch width of the other formats")
    parser.add_argument("--formats", nargs="+", default=["bf16", "q4", "fp32"],
                        choices=["bf16", "q4", "fp32", "q4a8", "q8a8"])
    parser.add_argument("--baselines", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                        help="transformers' generate in these dtypes (the first is the ratios' reference)")
    parser.add_argument("--baseline-batch", type=int, default=16, help="`train --gen-batch`'s default")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from dflash_cli.engine.generate import default_stop_ids
    from dflash_cli.engine.load import load_target
    from dflash_cli.engine.text import encode_prompt
    from dflash_cli.models.smollm2 import ensure_smollm2
    from dflash_cli.train.prompts.mix import mix_prompts

    folder = ensure_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    targets = {name: load_target(folder, device="cpu", dtype=dtype)
               for name, dtype in (("bf16", "bfloat16"), ("fp32", "float32"))}
    stops = default_stop_ids(targets["bf16"], tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    prompts = [encode_prompt(tokenizer, p) for p in mix_prompts(args.prompts)]
    taps = demo_taps()
    rows = plan(args, targets, prompts, taps, stops, pad_id)
    rates: list[list[float]] = [[] for _ in rows]
    answers: list[list[Example]] = [[] for _ in rows]
    for r in range(args.rounds):
        for i, (name, fmt, width, _, run) in enumerate(rows):
            started = time.perf_counter()
            answers[i] = run()
            seconds = time.perf_counter() - started
            tokens = sum(len(e.ids) - e.prompt_len for e in answers[i])
            rates[i].append(tokens / seconds)
            print(f"round {r + 1}: {name} {fmt} batch {width}: {tokens} tokens in {seconds:.1f} s "
                  f"({tokens / seconds:.0f} tok/s)", file=sys.stderr, flush=True)
    report(args, rows, rates, answers, taps)


def report(args, rows, rates, answers, taps) -> None:
    medians = [statistics.median(r) for r in rates]
    baseline = {fmt: (medians[i], answers[i]) for i, (name, fmt, *_rest) in enumerate(rows)
                if name.startswith("transformers")}
    refs = list(baseline)
    print(f"\nCPU: {cpu_line()}")
    print(f"SmolLM2-135M-Instruct, {args.prompts} mix prompts, max_new_tokens {args.max_new_tokens}, taps {taps}, "
          f"torch {torch.__version__}, median of {args.rounds} round(s)\n")
    head = ["generator", "format", "batch", "tok/s"] + [f"x {r} generate" for r in refs] + ["same answers"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    record = []
    for (name, fmt, width, dtype, _), rate, got in zip(rows, medians, answers):
        ratios = [f"{rate / baseline[r][0]:.2f}" for r in refs]
        same = "-"
        if dtype in baseline and not name.startswith("transformers"):
            equal = sum(a.ids.tolist() == b.ids.tolist() for a, b in zip(got, baseline[dtype][1]))
            same = f"{equal}/{len(got)} ({dtype})"
        print(f"| {name} | {fmt} | {width} | {rate:.0f} | " + " | ".join(ratios) + f" | {same} |")
        record.append(dict(generator=name, format=fmt, batch=width, tokens_per_s=rate, same_answers=same))
    if args.json:
        args.json.write_text(json.dumps(dict(cpu=cpu_line(), rows=record, args=vars(args) | {"json": str(args.json)}),
                                        indent=1))


if __name__ == "__main__":
    main()
