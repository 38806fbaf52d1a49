"""`dflash-cli doctor`: the environment report (the checks are in ui/doctor.py)."""

from __future__ import annotations

import click

from dflash_cli.ui.common import run_plain
from dflash_cli.ui.options import color_option, debug_option


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: {\"checks\": [...], \"ok\": bool}.")
@color_option
@debug_option
def doctor(as_json, color, debug):
    """Report the environment for bug reports: versions, GPU and memory, bitsandbytes, Hub cache, token.

    Exits 1 when a check is fatal (the hint says how to fix it), else 0. The token itself is never shown.

    \b
    Examples:
      dflash-cli doctor
      dflash-cli doctor --json > doctor.json
    """
    from dflash_cli.ui.doctor import run_doctor
    from dflash_cli.ui.render import use_color

    run_plain(color, debug, lambda out: run_doctor(out, as_json=as_json, color=use_color(color, out.out)))
