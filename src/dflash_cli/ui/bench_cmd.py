"""`dflash-cli bench`: plain vs DFlash decoding on prompt sets; the measuring itself is in dflash_cli.bench.local."""

from __future__ import annotations

import click

from dflash_cli import settings as S
from dflash_cli.ui.common import guarded
from dflash_cli.ui.options import (
    block_size_option,
    color_option,
    debug_option,
    engine_option,
    max_tokens_option,
    model_options,
    model_options_of,
    quiet_option,
    think_option,
)


@click.command()
@model_options
@engine_option
@max_tokens_option(default=S.DEFAULT_BENCH_MAX_TOKENS, envvar=None, show_envvar=False,
                   help="Most tokens to generate per prompt and mode.")
@block_size_option(envvar=None, show_envvar=False)
@click.option("--sets", default=None, metavar="NAMES",
              help="Comma-separated prompt sets: math, code, chat, json (built in; json: replies under a JSON "
                   "Schema) or .jsonl files "
                   "[default: math,code,chat, or none when --prompts is given].")
@click.option("--prompts", "prompt_files", multiple=True, type=click.Path(dir_okay=False), metavar="FILE.jsonl",
              help='Your own prompt set: one {"id": ..., "prompt": ...} object per line (repeatable).')
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use only the first N prompts of each set.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Prompts run in both modes, unmeasured, before the measurement.")
@think_option()
@click.option("--adaptive", is_flag=True,
              help="Let DFlash runs pick their block size each round, as generate does by default "
                   "(measures the speed users get; without it every round drafts a full block, which "
                   "measures the drafter).")
@click.option("--context", type=click.IntRange(min=16), default=None, metavar="TOKENS",
              help="Put each prompt behind notes that fill it to about TOKENS tokens: speed and acceptance at "
                   "long context (raise --max-context past TOKENS + -n).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as one JSON object on stdout.")
@color_option
@quiet_option(help="Print no table or progress (only --json output and errors).")
@debug_option
def bench(max_tokens, block_size, sets, prompt_files, limit, warmup, think, adaptive, context, as_json, color, quiet,
          debug, **values):
    """Measure DFlash against plain decoding on prompt sets (greedy, chat template, warm-up first).

    Each prompt runs with plain decoding, then with the drafter, interleaved. Per set: tau (acceptance
    length, macro-averaged per response and pooled), draft acceptance, per-position acceptance, decode
    tokens/s of both, speedup, and whether the outputs were identical. The table goes to stderr; --json
    puts the full report (per-prompt records included) on stdout.

    \b
    Examples:
      dflash-cli bench -m qwen3-8b --limit 10
      dflash-cli bench -m ./model --draft ./drafter --sets math -n 256 --json > math.json
      dflash-cli bench -m ./model --draft ./drafter --prompts mine.jsonl
    """
    from pathlib import Path

    from dflash_cli.prompts.reader import BUILTIN_SETS, DEFAULT_SETS, PromptSetError, load_prompt_set
    from dflash_cli.ui.render import Output

    options = model_options_of(values)
    if options.engine and (options.no_draft or block_size or adaptive):
        raise click.UsageError("with --engine the server decodes with its own drafter: drop --no-draft, "
                               "--block-size and --adaptive")
    if options.no_draft and not options.engine:
        raise click.UsageError("bench compares plain decoding with a drafter: drop --no-draft")
    if options.model and not options.engine and not options.draft and not has_known_drafter(options.model):
        raise click.UsageError("bench needs a drafter: pass --draft FOLDER or REPO (this model has no known pair)")
    names = [s.strip() for s in sets.split(",") if s.strip()] if sets is not None else (
        [] if prompt_files else list(DEFAULT_SETS))
    if sets is not None and not names:
        raise click.BadParameter("names no prompt set", param_hint="--sets")
    prompt_sets = {}
    for source, hint in [(n, "--sets") for n in names] + [(f, "--prompts") for f in prompt_files]:
        key = source if source in BUILTIN_SETS else Path(source).stem
        while key in prompt_sets:
            key += "'"
        try:
            prompt_sets[key] = load_prompt_set(source)
        except PromptSetError as e:
            raise click.BadParameter(str(e), param_hint=hint) from None
    if not prompt_sets:
        raise click.UsageError("no prompt sets: give --sets and/or --prompts")
    guarded(lambda: Output(color, provenance=False),
            lambda out: _run_bench(out, options, prompt_sets, max_tokens=max_tokens, block_size=block_size,
                                   limit=limit, warmup=warmup, think=think, adaptive=adaptive, as_json=as_json,
                                   quiet=quiet, context=context),
            debug)


def has_known_drafter(model: str) -> bool:
    """True unless the model is known to have no drafter (unknown names are left to the loader to report)."""
    from dflash_cli import settings as S
    from dflash_cli.engine.errors import DFlashError
    from dflash_cli.models.resolve import resolve_spec

    try:
        return bool(resolve_spec(model).drafter)
    except (DFlashError, S.ConfigError, OSError):
        return True


def _progress(out, quiet: bool, total: int):
    """A rich progress bar on a terminal (and its update function), else nothing."""
    import contextlib

    if not out.err_tty or quiet:
        return contextlib.nullcontext(), None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(file=out.err, force_terminal=out.color_err or None),
                        transient=True)
    task = progress.add_task("bench", total=total)
    return progress, lambda done, total_, label: progress.update(task, completed=done, description=f"bench {label}")


def _run_remote_bench(out, runtime, prompt_sets, *, max_tokens, limit, warmup, think, as_json, quiet) -> int:
    """bench --engine: the server's own acceptance and speed per set (runtime/remote.py)."""
    import json as _json

    from dflash_cli import __version__ as version
    from dflash_cli.bench.remote import format_remote_table, run_remote_bench

    total = sum(min(len(p), limit or len(p)) for p in prompt_sets.values())
    progress, on_progress = _progress(out, quiet, total)
    with progress:
        report = run_remote_bench(runtime, prompt_sets, max_new_tokens=max_tokens, warmup=warmup, per_set=limit,
                                  think=think, on_progress=on_progress)
    report["meta"]["dflash_cli"] = version
    if not quiet:
        for line in format_remote_table(report):
            out.info(line, dim=False)
    if as_json:
        out.write_out(_json.dumps(report, ensure_ascii=False) + "\n")
    return 0


def _run_bench(out, options, prompt_sets, *, max_tokens, block_size, limit, warmup, think, adaptive, as_json,
               quiet, context=None) -> int:
    from dflash_cli.conversation import GenerationSettings
    from dflash_cli.ui.opening import open_model

    runtime = open_model(out, options, quiet=quiet, settings=GenerationSettings(block_size=block_size))
    try:
        if options.engine and context:
            raise click.UsageError("--context fills prompts here: it cannot be used with --engine")
        if options.engine:  # a server has no plain mode to compare with: its own report
            return _run_remote_bench(out, runtime, prompt_sets, max_tokens=max_tokens, limit=limit, warmup=warmup,
                                     think=think, as_json=as_json, quiet=quiet)
        return _run_local_bench(out, runtime, prompt_sets, max_tokens=max_tokens, block_size=block_size, limit=limit,
                                warmup=warmup, think=think, adaptive=adaptive, as_json=as_json, quiet=quiet,
                                context=context)
    finally:
        runtime.close()


def _run_local_bench(out, runtime, prompt_sets, *, max_tokens, block_size, limit, warmup, think, adaptive, as_json,
                     quiet, context=None) -> int:
    """Plain decoding against the drafter, interleaved, on the pair loaded here (dflash_cli.bench.local)."""
    import json as _json

    from dflash_cli import __version__ as version
    from dflash_cli.bench.local import format_table, run_bench
    from dflash_cli.runtime.local import LocalRuntime

    assert isinstance(runtime, LocalRuntime)  # without --engine
    if not runtime.speculative:
        raise click.UsageError("bench needs a drafter: pass --draft FOLDER or REPO")
    total = sum(min(len(p), limit or len(p)) for p in prompt_sets.values())
    progress, on_progress = _progress(out, quiet, total)
    with progress:
        report = run_bench(runtime.target, runtime.drafter, runtime.tokenizer, prompt_sets,
                           max_new_tokens=max_tokens, block_size=block_size, warmup=warmup, per_set=limit,
                           adaptive=adaptive, on_progress=on_progress, enable_thinking=think, context=context)
    report.meta.update({"dflash_cli": version, "model": str(runtime.target_dir),
                        "drafter": str(runtime.drafter_dir), "device": runtime.device, "dtype": runtime.dtype,
                        "quant": runtime.quant or "none"})
    if not quiet:
        for line in format_table(report):
            out.info(line, dim=False)
    if as_json:
        out.write_out(_json.dumps(report.to_dict(), ensure_ascii=False) + "\n")
    return 0
