"""`dflash-cli train`: distil a drafter (the training itself is in dflash_cli.train). Imports torch only when run.

The options' defaults and ranges are TrainConfig's (train/config.py), which checks every value again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from dflash_cli.engine.dtypes import DTYPE_CHOICES
from dflash_cli.train.config import DEFAULT_BLOCK_SIZE, DEFAULT_LAYERS, DEFAULT_STEPS, FORMATS, TrainConfig, bound
from dflash_cli.ui.common import guarded
from dflash_cli.ui.options import FiniteFloatRange, debug_option


def _ints(name: str) -> click.IntRange:
    b = bound(name)
    return click.IntRange(min=int(b.low), max=None if b.high is None else int(b.high), min_open=b.low_open)


def _floats(name: str) -> FiniteFloatRange:
    b = bound(name)
    return FiniteFloatRange(min=b.low, max=b.high, min_open=b.low_open)


def _parse_taps(_ctx, _param, value):
    if value is None:
        return None
    try:
        return [int(t) for t in value.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter("give comma-separated layer ids, e.g. 1,7,14,20,27") from None


@click.command("train")
@click.option("-m", "--model", "target", required=True, metavar="MODEL",
              help="Target: a local folder, a known name (smollm2-135m, qwen3-8b, ...) or a Hub repo id.")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Output folder: the drafter (config.json + model.safetensors), data cache, checkpoint. "
                   "Re-running with the same folder resumes.")
@click.option("--prompts", default=None, metavar="FILE|SET",
              help="Prompts: a file (one per line, or JSONL with a \"prompt\" field) or a built-in set: "
                   "demo (6000 math, code and chat prompts), demo:N (N of them), mix / mix:N (12000 or N, a steady "
                   "40/30/30% math/code/chat), wide / wide:N (12000 or N, the same mix of longer, freer requests), "
                   "self / self:N (4000 or N requests the target writes itself from its chat template's user turn, "
                   "kept in the output folder; SmolLM2-135M on 2 AVX2 cores: about 8 minutes per 1000); join "
                   "several with +, adding new ones at the end (self:4000+wide:2000) [default: 48 built-in prompts].")
@click.option("--layers", type=_ints("layers"), default=None, help=f"Drafter layers [default: {DEFAULT_LAYERS}].")
@click.option("--block-size", type=_ints("block_size"), default=None,
              help=f"Block length B, anchor included [default: {DEFAULT_BLOCK_SIZE}].")
@click.option("--taps", callback=_parse_taps, default=None, metavar="IDS",
              help="Target layers to tap, e.g. 1,7,14,20,27 [default: evenly spread, reference rule].")
@click.option("--init", "init", type=click.Path(exists=True, file_okay=False), default=None, metavar="DIR",
              help="Fine-tune this drafter folder instead of starting from random weights (keeps its layers, "
                   "block size, taps and mask token).")
@click.option("--lr", type=_floats("lr"), default=TrainConfig.lr, show_default=True,
              help="Peak learning rate (AdamW, cosine decay).")
@click.option("--steps", type=_ints("steps"), default=None, help=f"Total optimizer steps [default: {DEFAULT_STEPS}].")
@click.option("--time-budget", type=_floats("time_budget"), default=None, metavar="MIN",
              help="Train for this many minutes instead of a step count (all runs of the folder together).")
@click.option("--batch", type=_ints("batch"), default=TrainConfig.batch, show_default=True,
              help="Sequences per step.")
@click.option("--anchors", type=_ints("anchors"), default=TrainConfig.anchors, show_default=True,
              help="Random anchors (blocks) per sequence per step.")
@click.option("--max-new-tokens", type=_ints("max_new_tokens"), default=TrainConfig.max_new_tokens,
              show_default=True, help="Longest generated response per prompt.")
@click.option("--gen-batch", type=_ints("gen_batch"), default=TrainConfig.gen_batch,
              help="Prompts answered at once [default: 128 on the fast path's batched generator (Llama-style "
                   "targets on a CPU), 16 through transformers' generate].")
@click.option("--reply-format", type=click.Choice(["auto", "fp32", "bf16", "q4", "q8", "q4a8", "q8a8"]),
              default=TrainConfig.reply_format,
              help="The format the target writes its training replies in (CPU batched generator): q4a8 writes "
                   "what the demo decodes with on CPUs without native bf16 (needs --dtype float32) [default: "
                   "auto: fp32 or bf16 as the target is loaded, q4 where it measured faster].")
@click.option("--gen-budget", "gen_time_budget", type=_floats("gen_time_budget"), default=None, metavar="MIN",
              help="Generate data for at most this many minutes in this run, then train on what is stored "
                   "(a later run with the same folder answers the rest); 0 = train on what is stored.")
@click.option("--sub-vocab/--full-vocab", default=TrainConfig.sub_vocab, show_default=True,
              help="Loss over the tokens seen in the responses only (faster), or the whole vocabulary.")
@click.option("--distill", type=_floats("distill"), default=TrainConfig.distill, show_default=True,
              help="Weight of the KL term against the target's top-k distribution (0 = its greedy token only).")
@click.option("--distill-topk", type=_ints("distill_topk"), default=TrainConfig.distill_topk, show_default=True,
              metavar="K", help="Store the target's K most likely tokens per response position (needed by --distill).")
@click.option("--draft-vocab/--no-draft-vocab", default=TrainConfig.draft_vocab, show_default=True,
              help="Ship the training vocabulary with the drafter: drafts come from those ids only, and the "
                   "LM head runs on those rows (cheaper drafts on a CPU; output unchanged). With --init, the ids "
                   "of its draft vocabulary are kept too.")
@click.option("--format", "drafter_format", type=click.Choice(FORMATS), default=TrainConfig.drafter_format,
              show_default=True, help="Drafter folder format: z-lab's DFlash checkpoints, or transformers' own "
                                      "(muse_glimmer_assistant). --draft reads both.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 [default: cuda when available].")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto",
              show_default=True, help="Compute dtype.")
@debug_option
def train(target, out_dir, prompts, init, device, dtype, debug, **options):
    """Distil a DFlash drafter for a local target from the target's own answers to prompts.

    \b
    Examples:
      dflash-cli train -m ./SmolLM2-135M-Instruct -o ./smollm2-dflash --time-budget 60
      dflash-cli train -m ./target -o ./drafter --prompts prompts.jsonl --steps 2000 --taps 1,7,14,20,27
      dflash-cli train -m smollm2-135m -o ./demo-drafter --prompts demo --gen-budget 50 --time-budget 60
      dflash-cli train -m ./Qwen3-0.6B -o ./qwen-drafter --prompts self:3000+wide:2000 --time-budget 90
    """
    from dflash_cli.ui.render import Output

    if prompts is not None:
        from dflash_cli.engine.errors import DFlashError
        from dflash_cli.train.prompts import check_prompt_spec

        try:  # before the target is resolved (which may download or convert it)
            check_prompt_spec(prompts)
        except DFlashError as e:
            raise click.BadParameter(f"{e}; {e.hint}" if e.hint else str(e), param_hint="--prompts") from None
    if options.get("reply_format") == "auto":
        options["reply_format"] = None
    for name in ("time_budget", "gen_time_budget"):  # minutes here, seconds in TrainConfig
        if options[name] is not None:
            options[name] *= 60
    run = dict(prompts=prompts, init=init, device=device, dtype=None if dtype == "auto" else dtype)
    guarded(lambda: Output("auto", provenance=False), lambda out: run_train(out, target, out_dir, options, run), debug)


def run_train(out, target: str, out_dir: str, options: dict[str, Any], run: dict[str, Any]) -> int:
    """Trains with TrainConfig(**options) and train_drafter's other arguments `run`; prints where it went."""
    from dflash_cli.models.resolve import resolve_pair
    from dflash_cli.train.api import train_drafter

    config = TrainConfig(**options)  # checked before the target is resolved (which may download or convert it)
    target = str(resolve_pair(target, no_draft=True, on_status=out.info).target_dir)
    with progress_reporter(config) as on_progress:
        result = train_drafter(target, out_dir, config, on_progress=on_progress, **run)
    if result.heldout_tau is not None:
        by_set = "".join(f", {name} {tau:.2f}" for name, tau in (result.heldout_tau_by_set or {}).items())
        out.info(f"held-out acceptance estimate tau {result.heldout_tau:.2f}{by_set} "
                 f"(greedy, full blocks; weights of step {result.saved_step} of {result.step})")
    out.info(f"drafter written to {result.folder} (load it with --draft {result.folder})", dim=False)
    return 0


@contextmanager
def progress_reporter(config: TrainConfig) -> Iterator[Callable[[str, Any], None]]:
    """train_drafter's on_progress: a live bar on a terminal; a log (file, pipe) gets a plain line per
    generated batch and per evaluation instead."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(file=sys.stderr)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as bar:
        yield _ProgressView(bar, None if console.is_terminal else console, config).on_progress


class _ProgressView:
    def __init__(self, bar, log, config: TrainConfig):
        self.bar, self.log = bar, log  # log: the console for plain lines, None on a terminal
        self.total, self.budget = config.total_steps, config.time_budget
        self.tasks: dict[str, Any] = {}
        self.gen_tokens, self.gen_seconds = 0, 0.0
        self.last_tau: float | None = None

    def on_progress(self, kind: str, info: Any) -> None:
        if kind == "note":
            self.bar.console.print(info)
        elif kind == "data":
            self._data(info)
        elif kind == "prompts":
            self._prompts(info)
        else:
            self._train(info)

    def _data(self, info: dict) -> None:
        self.gen_tokens += info["tokens"]
        self.gen_seconds += info["seconds"]
        rate = f"{self.gen_tokens / max(self.gen_seconds, 1e-9):.0f} tok/s"
        if self.log:
            self.log.print(f"generated {info['done']}/{info['total']} replies, {self.gen_tokens} tokens, {rate}",
                           highlight=False)
        if "data" not in self.tasks:
            self.tasks["data"] = self.bar.add_task("generating", total=info["total"], info="")
        self.bar.update(self.tasks["data"], completed=info["done"], info=f"{self.gen_tokens} tokens, {rate}")

    def _prompts(self, info: dict) -> None:
        rate = f"{info['tokens'] / max(info['seconds'], 1e-9):.0f} tok/s"
        if self.log:
            self.log.print(f"sampled {info['sampled']}/{info['upto']} candidate prompts for self:{info['wanted']}, "
                           f"{rate}", highlight=False)
        if "prompts" not in self.tasks:
            self.tasks["prompts"] = self.bar.add_task("writing prompts", total=info["upto"], info="")
        self.bar.update(self.tasks["prompts"], total=info["upto"], completed=info["sampled"], info=rate)

    def _train(self, info: Any) -> None:
        if "train" not in self.tasks:
            self.tasks["train"] = self.bar.add_task("training", total=self.total or self.budget, info="")
        tau = f" tau~{info.tau:.2f}" if info.tau is not None else ""
        line = f"step {info.step} loss {info.loss:.3f}{tau} {info.tokens_per_s:.0f} tok/s"
        self.bar.update(self.tasks["train"], info=line,
                        completed=info.step if self.total else min(info.seconds, self.budget))
        if self.log and (info.tau != self.last_tau or info.step % 100 == 0):
            self.last_tau = info.tau
            self.log.print(f"{line}, {info.seconds / 60:.1f} min", highlight=False)
