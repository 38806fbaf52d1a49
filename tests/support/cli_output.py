"""Reading a CLI run: ok (exit code 0, else stderr) and styled (the dim text apart from the rest)."""

from __future__ import annotations

import re

from dflash_cli.ui.render import DIM


def ok(result):
    assert result.exit_code == 0, result.stderr
    return result


def styled(stdout: str) -> tuple[str, str]:
    """(the text printed dim, the rest), from stdout with ANSI codes."""
    dim, rest, style = [], [], ""
    for code, text in re.findall(r"(\x1b\[[0-9;]*m)|([^\x1b]+)", stdout):
        if code:
            style = "" if code == "\x1b[0m" else style + code
        else:
            (dim if DIM in style else rest).append(text)
    return "".join(dim), "".join(rest)
