"""`dflash-cli chat`: a conversation in the terminal (the work is in ui/chat.py)."""

from __future__ import annotations

import click

from dflash_cli import settings as S
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
@click.option("--no-history", is_flag=True, envvar=S.ENV["no_history"], show_envvar=True,
              help="Do not read or write the chat input history file.")
@model_options
@engine_option
@sampling_options
@format_options
@output_options
def chat(no_history, **values):
    """Chat with a model in the terminal (ollama's /commands: type /? for the list).

    Replies stream to stdout, each followed by a one-line summary (-v: detailed statistics). Later
    turns reuse the caches of earlier ones. Needs a terminal; for pipes use `dflash-cli generate`.

    \b
    Examples:
      dflash-cli chat -m ./Qwen3-8B --draft ./Qwen3-8B-DFlash-b16
      dflash-cli chat -m ./model --draft ./drafter -s "Answer briefly." --temperature 0.7
    """
    from dflash_cli.ui.chat import run_chat
    from dflash_cli.ui.render import Output

    command = command_options(values)
    guarded(lambda: Output(command.output.color, provenance=command.output.provenance),
            lambda out: run_chat(out, command, history=not no_history), command.output.debug)
