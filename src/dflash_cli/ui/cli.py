"""The dflash-cli command group. Subcommands import the engine lazily: --help and --version stay fast."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import click

from dflash_cli import __version__
from dflash_cli import settings as S
from dflash_cli.ui.options import model_options, output_options, sampling_options


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="dflash-cli")
def cli() -> None:
    """Lossless block-diffusion speculative decoding (DFlash) on your own machine.

    A small drafter proposes a block of tokens in one pass; the target verifies the block in one pass
    and keeps what it agrees with. The output is exactly the target's own.
    """


def guarded(out_factory: Callable, body: Callable[[], int], debug: bool) -> None:
    """Runs a command body, turning known errors into one line + hint and the right exit code."""
    from dflash_cli.ui import signals
    from dflash_cli.ui.errors import EXIT_INTERRUPTED, describe

    out = out_factory()
    try:
        code = body(out)
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP (ui/signals.py)
        out.close_status()
        out.info("interrupted")
        sys.exit(signals.exit_code())
    except Exception as error:  # noqa: BLE001 - the one place that turns errors into messages
        out.close_status()
        if debug or S.debug_enabled():
            raise
        message, hint, code = describe(error)
        out.error(message, hint)
        sys.exit(code)
    sys.exit(signals.exit_code() if code == EXIT_INTERRUPTED else code)


@cli.command()
@click.argument("prompt", nargs=-1)
@click.option("-f", "--file", type=click.Path(dir_okay=False), help="Read the prompt (a document) from FILE.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and statistics.")
@click.option("--compare", is_flag=True, help="Also run plain decoding; report the speedup and whether outputs match.")
@model_options
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


@cli.command()
@click.option("--no-history", is_flag=True, envvar=S.ENV["no_history"], show_envvar=True,
              help="Do not read or write the chat input history file.")
@model_options
@sampling_options
@output_options
def chat(no_history, **opts):
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

    guarded(lambda: Output(opts["color"], provenance=opts["provenance"]),
            lambda out: run_chat(out, opts, history=not no_history), opts["debug"])


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: {\"checks\": [...], \"ok\": bool}.")
@click.option("--color", type=click.Choice(["auto", "always", "never"]), default=S.DEFAULT_COLOR,
              envvar=S.ENV["color"], show_envvar=True, show_default=True, help="Colours on terminals.")
@click.option("--debug", is_flag=True, envvar=S.DEBUG_ENV, help="Show tracebacks of unexpected errors.")
def doctor(as_json, color, debug):
    """Report the environment for bug reports: versions, GPU and memory, bitsandbytes, Hub cache, token.

    Exits 1 when a check is fatal (the hint says how to fix it), else 0. The token itself is never shown.

    \b
    Examples:
      dflash-cli doctor
      dflash-cli doctor --json > doctor.json
    """
    from dflash_cli.ui.doctor import run_doctor
    from dflash_cli.ui.render import Output, use_color

    guarded(lambda: Output(color, provenance=False),
            lambda out: run_doctor(out, as_json=as_json, color=use_color(color, out.out)), debug)


# pull, list/ls, show, rm: ui/pull_cmd.py, ui/models_cmd.py, ui/show_cmd.py (no heavy imports at module level).
from dflash_cli.ui.models_cmd import list_cmd, ls_cmd, rm  # noqa: E402
from dflash_cli.ui.pull_cmd import pull  # noqa: E402
from dflash_cli.ui.show_cmd import show  # noqa: E402

for _command in (pull, list_cmd, ls_cmd, show, rm):
    cli.add_command(_command)


# bench: defined in ui/bench_cmd.py.
from dflash_cli.ui.bench_cmd import bench as _bench_command  # noqa: E402

cli.add_command(_bench_command)


# train: defined in train/command.py (imports torch only when it runs).
from dflash_cli.train.command import train as _train_command  # noqa: E402

cli.add_command(_train_command)


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
