"""`dflash-cli train`: distil a drafter (the training itself is in dflash_cli.train). Imports torch only when run."""

from __future__ import annotations

import sys

import click

from dflash_cli.ui.common import FiniteFloatRange, debug_option, guarded


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
                   "40/30/30% math/code/chat) [default: 48 built-in prompts].")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Drafter layers [default: 2].")
@click.option("--block-size", type=click.IntRange(min=2), default=None,
              help="Block length B, anchor included.")
@click.option("--taps", callback=_parse_taps, default=None, metavar="IDS",
              help="Target layers to tap, e.g. 1,7,14,20,27 [default: evenly spread, reference rule].")
@click.option("--init", "init", type=click.Path(exists=True, file_okay=False), default=None, metavar="DIR",
              help="Fine-tune this drafter folder instead of starting from random weights (keeps its layers, "
                   "block size, taps and mask token).")
@click.option("--lr", type=float, default=6e-4, show_default=True, help="Peak learning rate (AdamW, cosine decay).")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Total optimizer steps [default: 1000].")
@click.option("--time-budget", type=FiniteFloatRange(min=0, min_open=True), default=None, metavar="MIN",
              help="Train for this many minutes instead of a step count (all runs of the folder together).")
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True, help="Sequences per step.")
@click.option("--anchors", type=click.IntRange(min=1), default=16, show_default=True,
              help="Random anchors (blocks) per sequence per step.")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=200, show_default=True,
              help="Longest generated response per prompt.")
@click.option("--gen-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Prompts per batched generation.")
@click.option("--gen-budget", type=FiniteFloatRange(min=0), default=None, metavar="MIN",
              help="Generate data for at most this many minutes in this run, then train on what is stored "
                   "(a later run with the same folder answers the rest); 0 = train on what is stored.")
@click.option("--sub-vocab/--full-vocab", default=True, show_default=True,
              help="Loss over the tokens seen in the responses only (faster), or the whole vocabulary.")
@click.option("--distill", type=FiniteFloatRange(0, 1), default=0.0, show_default=True,
              help="Weight of the KL term against the target's top-k distribution (0 = its greedy token only).")
@click.option("--distill-topk", type=click.IntRange(min=0), default=0, show_default=True, metavar="K",
              help="Store the target's K most likely tokens per response position (needed by --distill).")
@click.option("--draft-vocab/--no-draft-vocab", default=False, show_default=True,
              help="Ship the training vocabulary with the drafter: drafts come from those ids only, and the "
                   "LM head runs on those rows (cheaper drafts on a CPU; output unchanged).")
@click.option("--format", "drafter_format", type=click.Choice(["dflash", "transformers"]), default="dflash",
              show_default=True, help="Drafter folder format: z-lab's DFlash checkpoints, or transformers' own "
                                      "(muse_glimmer_assistant). --draft reads both.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 [default: cuda when available].")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="Compute dtype.")
@debug_option
def train(target, out_dir, prompts, layers, block_size, taps, init, lr, steps, time_budget, batch, anchors,
          max_new_tokens, gen_batch, gen_budget, sub_vocab, distill, distill_topk, draft_vocab, drafter_format,
          device, dtype, debug):
    """Distil a DFlash drafter for a local target from the target's own answers to prompts.

    \b
    Examples:
      dflash-cli train -m ./SmolLM2-135M-Instruct -o ./smollm2-dflash --time-budget 60
      dflash-cli train -m ./target -o ./drafter --prompts prompts.jsonl --steps 2000 --taps 1,7,14,20,27
      dflash-cli train -m smollm2-135m -o ./demo-drafter --prompts demo --gen-budget 50 --time-budget 60
    """
    from dflash_cli.ui.render import Output

    if steps is not None and time_budget is not None:
        raise click.UsageError("give --steps or --time-budget, not both")
    if distill > 0 and distill_topk == 0:
        raise click.UsageError("--distill needs the target's top-k distributions: add --distill-topk 32")
    if draft_vocab and not sub_vocab:
        raise click.UsageError("--draft-vocab needs the training vocabulary: drop --full-vocab")
    if prompts is not None:
        from dflash_cli.engine.errors import DFlashError
        from dflash_cli.train.prompt_sets import resolve_prompts

        try:  # before the target is resolved (which may download or convert it)
            resolve_prompts(prompts)
        except DFlashError as e:
            raise click.BadParameter(f"{e}; {e.hint}" if e.hint else str(e), param_hint="--prompts") from None
    kwargs = dict(prompts=prompts, layers=layers, block_size=block_size, taps=taps, init=init, lr=lr, steps=steps,
                  time_budget=time_budget * 60 if time_budget else None, batch=batch, anchors=anchors,
                  max_new_tokens=max_new_tokens, gen_batch=gen_batch,
                  gen_time_budget=gen_budget * 60 if gen_budget is not None else None, sub_vocab=sub_vocab,
                  distill=distill, distill_topk=distill_topk, draft_vocab=draft_vocab,
                  drafter_format=drafter_format, device=device,
                  dtype=None if dtype == "auto" else dtype)
    guarded(lambda: Output("auto", provenance=False), lambda out: run_train(out, target, out_dir, kwargs), debug)


def run_train(out, target: str, out_dir: str, kwargs: dict) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from dflash_cli.models.resolve import resolve_pair
    from dflash_cli.train.api import train_drafter

    target = str(resolve_pair(target, no_draft=True, on_status=out.info).target_dir)

    console = Console(file=sys.stderr)
    total = kwargs["steps"] or (None if kwargs["time_budget"] else 1000)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    # a live bar on a terminal; a log (file, pipe) gets a plain line per generated batch and per evaluation
    log_lines = not console.is_terminal
    with Progress(*columns, console=console, transient=False, disable=log_lines) as bar:
        tasks: dict[str, int] = {}
        gen_tokens = [0, 0.0]
        last_tau: list[float | None] = [None]

        def on_progress(kind, info):
            if kind == "note":
                bar.console.print(info)
            elif kind == "data":
                gen_tokens[0] += info["tokens"]
                gen_tokens[1] += info["seconds"]
                if log_lines:
                    console.print(f"generated {info['done']}/{info['total']} replies, {gen_tokens[0]} tokens, "
                                  f"{gen_tokens[0] / max(gen_tokens[1], 1e-9):.0f} tok/s", highlight=False)
                if "data" not in tasks:
                    tasks["data"] = bar.add_task("generating", total=info["total"], info="")
                bar.update(tasks["data"], completed=info["done"],
                           info=f"{gen_tokens[0]} tokens, {gen_tokens[0] / max(gen_tokens[1], 1e-9):.0f} tok/s")
            else:
                if "train" not in tasks:
                    budget = kwargs["time_budget"]
                    tasks["train"] = bar.add_task("training", total=total if total else budget, info="")
                tau = f" tau~{info.tau:.2f}" if info.tau is not None else ""
                done = info.step if total else min(info.seconds, kwargs["time_budget"])
                bar.update(tasks["train"], completed=done,
                           info=f"step {info.step} loss {info.loss:.3f}{tau} {info.tokens_per_s:.0f} tok/s")
                if log_lines and (info.tau != last_tau[0] or info.step % 100 == 0):
                    last_tau[0] = info.tau
                    console.print(f"step {info.step} loss {info.loss:.3f}{tau} {info.tokens_per_s:.0f} tok/s, "
                                  f"{info.seconds / 60:.1f} min", highlight=False)

        folder = train_drafter(target, out_dir, on_progress=on_progress, **kwargs)
    import json

    training = json.loads((folder / "config.json").read_text()).get("training", {})
    if training.get("heldout_tau") is not None:
        by_set = "".join(f", {name} {tau:.2f}" for name, tau in (training.get("heldout_tau_by_set") or {}).items())
        out.info(f"held-out acceptance estimate tau {training['heldout_tau']:.2f}{by_set} "
                 f"(greedy, full blocks; weights of step {training['saved_step']} of {training['step']})")
    out.info(f"drafter written to {folder} (load it with --draft {folder})", dim=False)
    return 0
