"""Every flag an error hint tells the user to type exists: a hint that names a removed or misspelt option
sends the user nowhere (a hint once said --no-sub-vocab, which never existed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click

from dflash_cli.ui.cli import cli

SRC = Path(__file__).resolve().parent.parent / "src" / "dflash_cli"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# flags of other programs that hints quote (pip, vLLM, SGLang)
OTHER_PROGRAMS = {"--no-deps", "--speculative-config", "--tensor-parallel-size", "--speculative-algorithm",
                  "--speculative-draft-model-path", "--speculative-num-draft-tokens", "--tp-size", "--model-path",
                  "--upgrade", "--index-url", "--extra-index-url", "--pre", "--per-request-spec-decode-metrics"}


def our_flags() -> set[str]:
    found: set[str] = set()

    def visit(command: click.Command) -> None:
        for param in command.params:
            found.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                visit(sub)

    visit(cli)
    return found


def hint_texts() -> list[tuple[str, str]]:
    """(file:line, text) of every literal given as a `hint=` argument (f-strings' literal parts included)."""
    out = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            for keyword in node.keywords:
                if keyword.arg != "hint":
                    continue
                for part in ast.walk(keyword.value):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        out.append((f"{path.relative_to(SRC)}:{part.lineno}", part.value))
    return out


def test_every_flag_a_hint_names_exists():
    known = our_flags() | OTHER_PROGRAMS
    texts = hint_texts()
    assert len(texts) > 50  # the scan sees the hints
    unknown = sorted({(where, flag) for where, text in texts for flag in FLAG.findall(text) if flag not in known})
    assert unknown == []
