"""The dflash-cli command group and its entry point: each command lives in its own ui/*_cmd.py.

Subcommands import the engine lazily: --help and --version stay fast.
"""

from __future__ import annotations

import os
import sys

import click

from dflash_cli import __version__
from dflash_cli import settings as S
from dflash_cli.ui.bench_cmd import bench
from dflash_cli.ui.chat_cmd import chat
from dflash_cli.ui.doctor_cmd import doctor
from dflash_cli.ui.generate_cmd import generate
from dflash_cli.ui.launch_cmd import serve_cmd
from dflash_cli.ui.list_cmd import list_cmd, ls_cmd
from dflash_cli.ui.pull_cmd import pull
from dflash_cli.ui.rm_cmd import rm
from dflash_cli.ui.serve_cmd import serve
from dflash_cli.ui.show_cmd import show
from dflash_cli.ui.train_cmd import train


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="dflash-cli")
def cli() -> None:
    """Lossless block-diffusion speculative decoding (DFlash) on your own machine.

    A small drafter proposes a block of tokens in one pass; the target verifies the block in one pass
    and keeps what it agrees with. The output is exactly the target's own.
    """


for command in (generate, chat, serve, doctor, pull, list_cmd, ls_cmd, show, rm, bench, train, serve_cmd):
    cli.add_command(command)


def reopen_closed_streams() -> list[str]:
    """Gives a closed stdin, stdout or stderr (`>&-`) /dev/null, so that no file opened later gets its
    number (and stray output), and the Python stream is usable. Returns the names of the closed ones."""
    closed = []
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))
            closed.append(name)
    return closed


def check_config_values(config: S.Config) -> None:
    """Checks the file's values with the options' own types (ranges, choices), so that a bad value is
    blamed on its line of the file, not on the environment variable click would name."""
    params = {p.name: p for p in generate.params}
    for key, value in config.values.items():
        param = params.get(key)
        if param is None or param.type is None:
            continue
        try:
            param.type.convert(value, param, None)
        except click.BadParameter as e:
            raise S.ConfigError(f"{config.where(key)}: {key} = {value!r}: {e.message}",
                                f"fix or remove it in {config.path} (dflash-cli never rewrites it)") from None


def main() -> None:
    """Entry point: config-file values become option defaults (environment variables and flags win)."""
    from dflash_cli.ui import signals

    signals.install()
    if "stdout" in reopen_closed_streams():
        from dflash_cli.ui.render import Output

        Output("never").error("cannot write the output: stdout is closed",
                              "redirect it instead, for example > /dev/null or > FILE")
        sys.exit(1)
    try:
        config = S.load_config()
        check_config_values(config)
    except S.ConfigError as error:
        from dflash_cli.ui.render import Output

        cheap = not sys.argv[1:] or any(a in ("-h", "--help", "-V", "--version") for a in sys.argv[1:])
        Output("auto").error(str(error), error.hint)
        if not cheap:
            sys.exit(error.exit_code)
        config = S.Config(S.config_path())
    try:
        cli(default_map=config.default_map())
    except SystemExit:
        if signals.received is not None:  # stopped by SIGTERM/SIGHUP anywhere, even outside a command body
            sys.exit(signals.exit_code())
        raise
    except Exception as error:  # work a command did outside its body's guard (ui/common.guarded): one line too
        if "--debug" in sys.argv[1:] or S.debug_enabled():
            raise
        from dflash_cli.ui.errors import describe
        from dflash_cli.ui.render import Output

        message, hint, code = describe(error)
        Output("auto").error(message, hint)
        sys.exit(code)
