"""The demo pair on this CPU in every target format, side by side with llama.cpp on the same weights.

One run, greedy, the same chat-templated prompts and number of new tokens everywhere, decode tokens/s with
the prefill excluded:

- llama.cpp (llama-cpp-python, built by benchmarks/llama_cpp_setup.sh) on the built-in GGUF (Q4_1), plain
  decoding, read from llama.cpp's own counters; skipped with a note when llama_cpp is not installed;
- dflash-cli plain and speculative decoding of the demo target in fp32, bf16, q8 and q4 (the drafter
  unchanged, 16/32-bit), with tau, the speedup over our own plain decoding in the same format, and whether
  the speculative output equals our plain output (it must);
- the unit costs of each format: a 1-token decode, an 8-token verify (the demo's block) and the draft of a
  block, in ms, called in turn at 200 tokens of context, with each ratio to a decode the median of the
  turns' own (`--json` also keeps the mean draft of the speculative runs, `draft_in_generation_ms`).

`--busy N` keeps N other processes spinning for the whole run (a user's laptop with something else on), and
`--fixed-threads T` adds for each format a row forced to T threads (`--threads T`), beside the default that
chooses its threads from the free cores.

    .venv/bin/python benchmarks/cpu_formats.py                       # math prompts, 128 tokens, about 4 min
    .venv/bin/python benchmarks/cpu_formats.py --sets math code chat --limit 4 --json out.json
    .venv/bin/python benchmarks/cpu_formats.py --before /tmp/old   # + an older checkout's default, first and last

Run it on idle cores: under load llama.cpp and torch both lose their time slices (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

FORMATS = {"fp32": dict(dtype="float32", quant="none"), "bf16": dict(dtype="bfloat16", quant="none"),
           "q4-fp32": dict(dtype="float32", quant="q4"),
           "q8": dict(dtype=None, quant="q8"), "q4": dict(dtype=None, quant="q4"),
           "q8a8": dict(dtype=None, quant="q8a8"), "q4a8": dict(dtype=None, quant="q4a8"),
           "auto": dict(dtype=None, quant=None)}


def cpu_line() -> str:
    name, family, model, flags = platform.processor() or "?", "?", "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and name in ("?", "", "x86_64"):
                name = value
            elif key == "cpu family":
                family = value
            elif key == "model":
                model = value
            elif key == "flags":
                wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "avx_vnni", "fma")
                flags = " ".join(f for f in value.split() if f in wanted)
                break
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability()
    return (f"{name} (family {family} model {model}), {torch.get_num_threads()} threads, torch capability {cap}, "
            f"flags: {flags or '?'}")


def prompts_for(sets: list[str], limit: int, tokenizer) -> list[tuple[str, list[int]]]:
    from dflash_cli.engine.text import encode_prompt
    from dflash_cli.prompts.reader import load_prompt_set

    out = []
    for name in sets:
        for p in load_prompt_set(name)[:limit]:
            out.append((name, encode_prompt(tokenizer, p.prompt)))
    return out


def llama_cpp_rows(prompts, new_tokens: int, threads: int) -> tuple[list[float], str]:
    try:
        import llama_cpp
    except ImportError:
        return [], "llama_cpp not installed (bash benchmarks/llama_cpp_setup.sh builds it, once)"
    from dflash_cli.models.smollm2 import gguf_path

    llm = llama_cpp.Llama(str(gguf_path()), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.create_completion(prompt=prompts[0][1], max_tokens=16, temperature=0.0, top_k=1)  # warm-up
    rates = []
    for _, ids in prompts:
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
        llm.create_completion(prompt=ids, max_tokens=new_tokens, temperature=0.0, top_k=1)
        perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
        rates.append(perf.n_eval / (perf.t_eval_ms / 1000))
    return rates, "Q4_1 GGUF as shipped (token embedding Q8_0)"


CONTEXT = 200  # tokens cached before the timed calls


def unit_calls(runtime, context: int = CONTEXT) -> dict:
    """{name: call} of a 1-row decode, a verify of 8 rows (taps) and, with a drafter, its draft of a full block
    (keeping B - 1, right after the verify, as generation meets it) at `context` tokens cached: each call leaves
    the caches as it found them."""
    target, drafter = runtime.target, runtime.drafter
    ids = torch.randint(100, 2000, (1, context + 8))
    cache = target.new_cache()
    _, hidden = target.forward(ids[:, :context], cache, 0, last_logit_only=True, taps=True)

    def forward(n: int) -> None:
        target.forward(ids[:, context:context + n], cache, context, taps=n > 1)
        cache.crop(context)

    calls = {"decode": lambda: forward(1), "verify": lambda: forward(8)}
    if drafter is not None:
        p, block = 4, drafter.block_size  # each draft commits the last p context rows, then rolls them back
        dcache, anchor = drafter.new_cache(context + 2 * block), ids[0, context:context + 1]
        drafter.draft(hidden[:, :context - p], anchor, context - p, 2, dcache, target.embed_table, target.logits_head)

        def draft() -> None:
            drafter.draft(hidden[:, context - p:], anchor, context, block, dcache, target.embed_table,
                          target.logits_head, keep=block - 1)
            dcache.crop(context - p)

        calls["draft"] = draft
    return calls


def unit_costs(runtime, repeats: int = 30) -> dict:
    """unit_calls at CONTEXT tokens, called in turn `repeats` times. This VM's speed moved by 10-40% between runs
    of one kind of call timed apart (a decode read 4.1 and 5.3 ms in two rows of one run), so each ratio is the
    median of the turns' own ratios to their decode."""
    calls = unit_calls(runtime)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for turn in range(repeats + 3):  # the first three untimed
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            if turn >= 3:
                times[name].append(time.perf_counter() - t)
    out = {f"{name}_ms": statistics.median(ts) * 1000 for name, ts in times.items()}
    for name in calls.keys() - {"decode"}:
        out[f"{name}_per_decode"] = statistics.median(t / d for t, d in zip(times[name], times["decode"]))
    return out


def run_format(name: str, spec: dict, prompts, new_tokens: int, debug_same: bool = False,
               threads: int | None = None) -> dict:
    import dflash_cli

    started = time.perf_counter()
    runtime = dflash_cli.load("demo", dtype=spec["dtype"], quant=spec["quant"], device="cpu", threads=threads)
    load_s = time.perf_counter() - started
    dflash_cli.generate(runtime, prompts[0][1], max_new_tokens=16)  # warm-up, both loops
    dflash_cli.generate(runtime, prompts[0][1], max_new_tokens=16, block_size=1)
    plain, spec_rates, taus, same, drafts = [], [], [], 0, []
    for _, ids in prompts:
        p = dflash_cli.generate(runtime, ids, max_new_tokens=new_tokens, block_size=1)
        s = dflash_cli.generate(runtime, ids, max_new_tokens=new_tokens)
        plain.append(p.stats.decode_tokens_per_second)
        spec_rates.append(s.stats.decode_tokens_per_second)
        taus.append(s.stats.acceptance_length)
        drafted_rounds = sum(s.stats.block_rounds[1:]) if s.stats.adaptive else s.stats.steps
        if drafted_rounds:
            drafts.append(s.stats.draft_seconds / drafted_rounds * 1000)
        same += p.tokens == s.tokens
        if p.tokens != s.tokens and debug_same:
            at = next(i for i, (x, y) in enumerate(zip(p.tokens + [-1], s.tokens + [-2])) if x != y)
            print(f"differs at token {at} of {len(p.tokens)} (prompt {len(ids)} tokens)", file=sys.stderr)
    units = unit_costs(runtime)
    if threads:
        name += f", --threads {threads}"
    return dict(format=name, dtype=runtime.dtype, forward=runtime.forward, load_seconds=load_s,
                draft_in_generation_ms=statistics.median(drafts) if drafts else None,
                threads=runtime.target.threads.describe() if runtime.target.threads else None,
                plain_tok_s=statistics.median(plain), spec_tok_s=statistics.median(spec_rates),
                tau=statistics.mean(taus), identical=f"{same}/{len(prompts)}", decode_1_ms=units["decode_ms"],
                verify_8_ms=units["verify_ms"], verify_per_decode=units["verify_per_decode"],
                draft_ms=units.get("draft_ms"), draft_per_decode=units.get("draft_per_decode"))


def spinner():
    """Another process keeping one core busy until killed."""
    import subprocess

    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def before_row(args, when: str) -> dict:
    """The --before checkout's default, run by this script in a subprocess on that checkout's code; `when`
    (first, last) goes into its name."""
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(args.before / "src"))
    cmd = [sys.executable, __file__, "--rows-for", "before", "--sets", *args.sets, "--limit", str(args.limit),
           "-n", str(args.new_tokens), "--threads", str(torch.get_num_threads())]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["format"] = f"before ({args.before.name}, its default; {when})"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["math"], help="built-in prompt sets (math, code, chat)")
    ap.add_argument("--limit", type=int, default=6, help="prompts per set")
    ap.add_argument("-n", "--new-tokens", type=int, default=128)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: torch's)")
    ap.add_argument("--busy", type=int, default=0, help="other processes kept spinning during the run")
    ap.add_argument("--fixed-threads", type=int, default=None,
                    help="also run each format forced to this many threads")
    ap.add_argument("--json", type=Path, help="also write every number here")
    ap.add_argument("--before", type=Path, help="a checkout of an earlier version: its default format (the "
                    "API's dtype and quant defaults) is measured too, in a subprocess, first and again last")
    ap.add_argument("--rows-for", help=argparse.SUPPRESS)  # internal: the --before subprocess
    ap.add_argument("--debug-same", action="store_true", help="name the first token where DFlash and plain differ")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    import dflash_cli

    tokenizer = dflash_cli.load("demo", device="cpu").tokenizer
    prompts = prompts_for(args.sets, args.limit, tokenizer)
    if args.rows_for:
        print(json.dumps(run_format(args.rows_for, dict(dtype=None, quant=None), prompts, args.new_tokens)))
        return
    print(f"CPU: {cpu_line()}", flush=True)
    print(f"{len(prompts)} prompts ({', '.join(args.sets)}), {args.new_tokens} new tokens, greedy, "
          f"chat template; {time.strftime('%Y-%m-%d')}"
          + (f"; {args.busy} other process(es) spinning throughout" if args.busy else ""), flush=True)
    spinners = [spinner() for _ in range(args.busy)]
    try:
        rates, note = llama_cpp_rows(prompts, args.new_tokens, threads)
        base = statistics.median(rates) if rates else None
        # the checkout before and after ours: a machine whose speed drifts during the run shows in its two rows
        rows = [before_row(args, "first")] if args.before else []
        for name in args.formats:
            rows.append(run_format(name, FORMATS[name], prompts, args.new_tokens, args.debug_same))
            if args.fixed_threads:
                rows.append(run_format(name, FORMATS[name], prompts, args.new_tokens, args.debug_same,
                                       threads=args.fixed_threads))
        if args.before:
            rows.append(before_row(args, "last"))
    finally:
        for s in spinners:
            s.kill()

    def vs(x: float) -> str:
        return f"{x / base:.2f}x" if base else "-"

    print()
    print("| engine, format | plain tok/s | vs llama.cpp | DFlash tok/s | vs llama.cpp | tau | DFlash/plain |"
          " same output | decode 1 ms | verify 8 ms | verify/decode | draft ms | draft/decode | load s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    if base:
        print(f"| llama.cpp {note} | {base:.1f} | 1.00x | | | | | | | | | | | |")
    else:
        print(f"| llama.cpp: {note} | | | | | | | | | | | | | |")
    for r in rows:
        draft = r.get("draft_ms")
        drafting = f"{draft:.1f} | {r['draft_per_decode']:.2f}x" if draft else "- | -"
        print(f"| dflash-cli {r['format']} ({r['dtype']}) | {r['plain_tok_s']:.1f} | {vs(r['plain_tok_s'])} | "
              f"{r['spec_tok_s']:.1f} | {vs(r['spec_tok_s'])} | {r['tau']:.2f} | "
              f"{r['spec_tok_s'] / r['plain_tok_s']:.2f}x | {r['identical']} | {r['decode_1_ms']:.1f} | "
              f"{r['verify_8_ms']:.1f} | {r['verify_per_decode']:.2f}x | {drafting} | "
              f"{r['load_seconds']:.1f} |")
    for r in rows:
        if r.get("threads"):
            print(f"threads, {r['format']}: {r['threads']}")
    if args.json:
        args.json.write_text(json.dumps(dict(cpu=cpu_line(), llama_cpp=dict(rates=rates, note=note), rows=rows,
                                             sets=args.sets, new_tokens=args.new_tokens), indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
