"""`dflash-cli generate`: one reply to a prompt, streamed to stdout (the work is in ui/run.py)."""

from __future__ import annotations

import sys

import click

from dflash_cli.ui.common import engine_option, guarded, model_options, output_options, sampling_options


@click.command()
@click.argument("prompt", nargs=-1)
@click.option("-f", "--file", type=click.Path(dir_okay=False), help="Read the prompt (a document) from FILE.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and statistics.")
@click.option("--compare", is_flag=True, help="Also run plain decoding; report the speedup and whether outputs match.")
@model_options
@engine_option
@sampling_options
@output_options
def generate(prompt, file, as_json, compare, **opts):
    """Generate a reply to PROMPT and stream it to stdout.

    The prompt comes from the arguments, from stdin when it is piped, or both (stdin first, then the
    instruction), or from -f FILE. Only generated text goes to stdout; statistics go to stderr.

    \b
    Examples:
      dflash-cli generate -m ./Qwen3-8B --draft ./Qwen3-8B-DFlash-b16 "Explain KV caches"
      git diff | dflash-cli generate -m ./model --draft ./drafter "write a commit message"
      dflash-cli generate -m ./model --draft ./drafter --compare -v "Solve 12*17 step by step"
    """
    from dflash_cli.ui.render import Output
    from dflash_cli.ui.run import read_prompt, run_generate

    guarded(lambda: Output(opts["color"], provenance=opts["provenance"]),
            lambda out: run_generate(out, opts, read_prompt(prompt, file, sys.stdin, warn=out.warn),
                                     compare=compare, as_json=as_json), opts["debug"])
