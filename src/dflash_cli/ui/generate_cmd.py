"""`dflash-cli generate`: one reply to a prompt, streamed to stdout (the work is in ui/generate.py)."""

from __future__ import annotations

import sys

import click

from dflash_cli.ui.common import guarded
from dflash_cli.ui.options import (
    command_options,
    engine_option,
    format_options,
    model_options,
    output_options,
    sampling_options,
)


@click.command()
@click.argument("prompt", nargs=-1)
@click.option("-f", "--file", type=click.Path(dir_okay=False), help="Read the prompt (a document) from FILE.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and statistics.")
@click.option("--compare", is_flag=True, help="Also run plain decoding; report the speedup and whether outputs match.")
@model_options
@engine_option
@sampling_options
@format_options
@output_options
def generate(prompt, file, as_json, compare, **values):
    """Generate a reply to PROMPT and stream it to stdout.

    The prompt comes from the arguments, from stdin when it is piped, or both (stdin first, then the
    instruction), or from -f FILE. Only generated text goes to stdout; statistics go to stderr.

    \b
    Examples:
      dflash-cli generate -m ./Qwen3-8B --draft ./Qwen3-8B-DFlash-b16 "Explain KV caches"
      git diff | dflash-cli generate -m ./model --draft ./drafter "write a commit message"
      dflash-cli generate -m ./model --draft ./drafter --compare -v "Solve 12*17 step by step"
    """
    from dflash_cli.ui.generate import run_generate
    from dflash_cli.ui.prompt_input import read_prompt
    from dflash_cli.ui.render import Output

    command = command_options(values)
    guarded(lambda: Output(command.output.color, provenance=command.output.provenance),
            lambda out: run_generate(out, command, read_prompt(prompt, file, sys.stdin, warn=out.warn),
                                     compare=compare, as_json=as_json), command.output.debug)
