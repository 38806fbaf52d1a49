"""`dflash-cli serve-cmd`: the vLLM or SGLang command that serves a registry pair with its DFlash drafter.

Prints one shell-quoted line; `--exec` runs it in place of this process. The argv comes from runtime/launch.py.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from typing import Any

import click

from dflash_cli.engine.errors import DFlashError, InvalidSettingError
from dflash_cli.runtime.launch import ENGINES
from dflash_cli.ui.common import echo, registry, run_plain
from dflash_cli.ui.errors import EXIT_OK
from dflash_cli.ui.options import common_options


def serve_pair(value: str, block_size: int | None) -> tuple[Any, Any]:
    """(ServePair, its registry entry) for the pair MODEL names, with a drafter and a block size; anything
    else is a usage error."""
    from dflash_cli.models.resolve import resolve_spec
    from dflash_cli.runtime.launch import ServePair

    pairs = registry()
    try:
        spec = resolve_spec(value, pairs, allow_unsupported=True, store=True)
    except DFlashError as error:
        raise InvalidSettingError(str(error), error.hint) from None
    hint = "serve-cmd needs a known pair with a drafter: dflash-cli list --known"
    if spec.kind == "folder":
        raise InvalidSettingError(f"{value} is a local folder, not a registry pair", hint)
    if spec.kind == "builtin":
        raise InvalidSettingError(f"{value} is built in (runs here only), not a registry pair", hint)
    entry = spec.entry
    if entry is None:
        raise InvalidSettingError(f"{value} is not a registry pair", hint)
    if not entry.drafter:
        raise InvalidSettingError(f"{entry.alias} has no DFlash drafter: there is nothing to serve speculatively",
                                  hint)
    size = block_size if block_size is not None else entry.block_size  # 0 is a value, not "unset"
    if size is None:
        raise InvalidSettingError(f"the registry does not give {entry.alias}'s block size",
                                  f"pass --block-size (block_size in {entry.drafter}'s config.json)")
    if size < 2:
        raise InvalidSettingError(f"--block-size {size}: a DFlash block holds at least 2 tokens",
                                  "use the drafter's trained block size")
    if entry.block_size and size > entry.block_size:
        raise InvalidSettingError(f"--block-size {size}: {entry.drafter} drafts blocks of {entry.block_size}",
                                  f"use {entry.block_size} or less (it proposes block - 1 tokens per step)")
    return ServePair(entry.alias, entry.target, entry.drafter, int(size), entry.trust_remote_code), entry


def run_serve_cmd(out: Any, model: str, engine: str, tp: int | None, port: int | None, block_size: int | None,
                  do_exec: bool) -> int:
    from dflash_cli.runtime.launch import EXECUTABLES, INSTALL, server_argv

    if tp is not None and tp < 1:
        raise InvalidSettingError(f"--tp {tp}: the tensor-parallel size is at least 1",
                                  "use the number of GPUs to split the target over, for example --tp 2")
    if port is not None and not 1 <= port <= 65535:
        raise InvalidSettingError(f"--port {port}: not a TCP port (1..65535)")
    pair, entry = serve_pair(model, block_size)
    if tp is None:  # the registry's size for a pair too big for fewer GPUs, else 1
        tp = entry.serve_tp or 1
    argv = server_argv(pair, engine, tp, port)
    line = shlex.join(argv)
    if not do_exec:
        echo(line)
        return EXIT_OK
    if shutil.which(EXECUTABLES[engine]) is None:
        raise DFlashError(f"{EXECUTABLES[engine]} is not on PATH: install {engine} to run this command",
                          INSTALL[engine])
    if engine == "sglang" and not _python_has(EXECUTABLES[engine], "sglang"):
        raise DFlashError(f"{EXECUTABLES[engine]} on PATH has no sglang module: install sglang to run this command",
                          INSTALL[engine])
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return EXIT_OK  # not reached


def _python_has(python: str, module: str) -> bool:
    """Whether `python` (as found on PATH) can import `module`: sglang runs as `python3 -m`, whose own
    error would be a Python traceback line instead of the install line."""
    import subprocess

    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@click.command("serve-cmd")
@click.argument("model")
@click.option("--engine", "engine", required=True, type=click.Choice(ENGINES, case_sensitive=False),
              help="The serving engine to print the command for.")
@click.option("--tp", type=int, default=None,
              help="Tensor-parallel size (GPUs to split over) [default: the registry's for the pairs that need a "
                   "multi-GPU server, else 1].")
@click.option("--port", type=int, default=None, help="Port to listen on [default: the engine's own].")
@click.option("--block-size", type=int, default=None,
              help="The drafter's trained block size [default: the registry's].")
@click.option("--exec", "do_exec", is_flag=True,
              help="Run the command in place of dflash-cli (printed on stderr first).")
@common_options
def serve_cmd(model, engine, tp, port, block_size, do_exec, color, debug):
    """Print the vLLM or SGLang command that serves a known pair with its DFlash drafter.

    The command names the target, the drafter, the number of speculative tokens (from the drafter's
    block size), the tensor-parallel size and the flags the engine needs for the model family. Point
    generate, chat and bench at the server with --engine URL: that is how the pairs too big for one
    machine (RUNS "engine" in `list --known`: kimi-k2.5, glm-5.1) are used.

    \b
    Examples:
      dflash-cli serve-cmd qwen3-8b --engine vllm --tp 2
      dflash-cli serve-cmd qwen3.6-27b --engine sglang --tp 4 --exec
      dflash-cli serve-cmd kimi-k2.5 --engine vllm
    """
    run_plain(color, debug, lambda out: run_serve_cmd(out, model, engine.lower(), tp, port, block_size, do_exec))
