"""Structured output on a real model: speed and tau of constrained replies next to free text, and what the
grammar costs per token, all in one run.

For each prompt: plain decoding and speculative decoding (the model's drafter, adaptive blocks, greedy),
free and under its format; tokens/s, tau, and whether the two constrained replies are identical. Then the
grammar's cost per token of each constrained reply, replayed through a fresh matcher: a full mask (what a
sampled step pays: mask + apply to the logits) and a one-token check (what a greedy step pays when the
model's own choice is allowed), as a share of a plain decode step.

    .venv/bin/python benchmarks/structured.py                 # the demo, about 2 minutes on 2 cores
    .venv/bin/python benchmarks/structured.py -m smollm2-135m --max-tokens 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPTS = [
    ("cat schema", "Tom is a 3 year old black cat. Give his name, age and colour as JSON.",
     ("schema", "name, age int, colour")),
    ("commits json", "List these commits as JSON objects with hash and subject:\n"
                     "4b056e3 native.py: a manifest beside the kernel library\n"
                     "a069fae engine/cpu/: the CPU formats in one folder\n"
                     "54d85ca generate.py: stream_generate in named steps", ("format", "json")),
    ("people schema", "Ada Lovelace was born in 1815 and Alan Turing in 1912. Return both as JSON.",
     ("schema", json.dumps({"type": "object", "required": ["people"], "properties": {"people": {
         "type": "array", "items": {"type": "object", "required": ["name", "born"],
                                    "properties": {"name": {"type": "string"}, "born": {"type": "integer"}}}}}}))),
    ("date regex", "When did the Apollo 11 landing happen? Answer with the date only.",
     ("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
    ("yes/no grammar", "Is the Earth round? Answer yes or no, then one sentence why.",
     ("grammar", None)),
]
YES_NO = 'start: ("yes" | "no") ". " /[A-Z][^.\\n]{0,200}\\./\n'


def mask_costs(runtime, fmt, tokens: list[int]) -> tuple[float, float]:
    """(full mask + apply, one-token check) in microseconds per token, replayed over `tokens`."""
    from dflash_cli.engine.constraint import ConstrainedSampler
    from dflash_cli.engine.generate import default_stop_ids
    from dflash_cli.engine.sampling import Sampler

    vocab = runtime.target.vocab_rows
    sampler = ConstrainedSampler(Sampler(), fmt, runtime.tokenizer, vocab,
                                 default_stop_ids(runtime.target, runtime.tokenizer))
    logits = torch.randn(1, vocab)
    full, check = [], []
    for t in tokens:
        if sampler.finished:
            break
        t0 = time.perf_counter()
        logits.masked_fill(~sampler.allowed(vocab), float("-inf"))
        t1 = time.perf_counter()
        sampler.matcher.validate_tokens([t])
        t2 = time.perf_counter()
        sampler.advance([t])
        full.append(t1 - t0), check.append(t2 - t1)
    return statistics.median(full) * 1e6, statistics.median(check) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default="demo")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    import dflash_cli
    from dflash_cli.engine.generate import generate
    from dflash_cli.engine.output_format import OutputFormat, parse_format_setting
    from dflash_cli.engine.text import encode_prompt
    from dflash_cli.tables import columns

    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_formats import cpu_line

    runtime = dflash_cli.load(args.model)
    print(f"CPU: {cpu_line()}; model {args.model} ({runtime.info().get('quantization', '?')})", flush=True)
    rows = [["prompt", "format", "tokens", "plain tok/s", "spec tok/s", "speedup", "tau", "same",
             "free tau", "free speedup", "mask us", "check us", "mask % step", "check % step"]]
    for name, text, (kind, value) in PROMPTS:
        fmt = OutputFormat("grammar", YES_NO, "yes/no") if kind == "grammar" else parse_format_setting(kind, value)
        ids = encode_prompt(runtime.tokenizer, text, enable_thinking=False)
        run = {}
        for label, f in (("free", None), ("fmt", fmt)):
            for mode, drafter in (("plain", None), ("spec", runtime.drafter)):
                generate(runtime.target, drafter, ids, tokenizer=runtime.tokenizer, max_new_tokens=8, output_format=f)
                run[label, mode] = generate(runtime.target, drafter, ids, tokenizer=runtime.tokenizer,
                                            max_new_tokens=args.max_tokens, output_format=f)
        plain, spec = run["fmt", "plain"], run["fmt", "spec"]
        rate = {k: r.stats.generated_tokens / r.stats.decode_seconds for k, r in run.items()}
        step_us = 1e6 / rate["fmt", "plain"]
        full_us, check_us = mask_costs(runtime, fmt, plain.tokens)
        rows.append([name, fmt.kind, str(len(plain.tokens)), f"{rate['fmt', 'plain']:.1f}",
                     f"{rate['fmt', 'spec']:.1f}", f"{rate['fmt', 'spec'] / rate['fmt', 'plain']:.2f}x",
                     f"{spec.stats.acceptance_length:.2f}", "yes" if spec.tokens == plain.tokens else "NO",
                     f"{run['free', 'spec'].stats.acceptance_length:.2f}",
                     f"{rate['free', 'spec'] / rate['free', 'plain']:.2f}x", f"{full_us:.0f}", f"{check_us:.1f}",
                     f"{100 * full_us / step_us:.1f}%", f"{100 * check_us / step_us:.2f}%"])
        print(f"{name}: {plain.text!r}", flush=True)
    print("\n".join(columns(rows, rule=True)))


if __name__ == "__main__":
    main()
