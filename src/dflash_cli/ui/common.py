"""What the command bodies share: `guarded` (errors -> one line + hint and the exit code), plain tables,
the registry and the config file's values. The options they take are in ui/options.py.

Every command lives in its own ui/*_cmd.py; ui/cli.py assembles the group. Nothing heavy at import time
(`dflash-cli --help` stays fast): torch, huggingface_hub and rich load inside the functions that need them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from dflash_cli import settings as S
from dflash_cli.tables import columns

# -- running a command body ----------------------------------------------------------------------------

def guarded(out_factory: Callable, body: Callable[[Any], int], debug: bool) -> None:
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
    except Exception as error:  # the one place that turns errors into messages
        out.close_status()
        if debug or S.debug_enabled():
            raise
        message, hint, code = describe(error)
        out.error(setting_message(error, message), hint)
        sys.exit(code)
    sys.exit(signals.exit_code() if code == EXIT_INTERRUPTED else code)


def setting_message(error: BaseException, message: str) -> str:
    """`message`, or for a bad --device/--device-map/--max-memory value found after parsing (a SettingError)
    the message naming where each value was set: the flag, the DFLASH_* variable, or the config file's path
    and line with the value as written there."""
    from dflash_cli.engine.errors import SettingError

    ctx = click.get_current_context(silent=True)
    if ctx is None or not isinstance(error, SettingError):
        return message
    sources = {key: setting_source(ctx, key) for key in error.settings}
    if all(kind == "flag" for kind, _ in sources.values()):
        return message

    def label(key: str, first: bool) -> str:
        kind, name = sources[key]
        if kind != "config":
            return name
        config = S.load_config()
        return f"{config.where(key)}: {key} = {config.values[key]!r}" if first else f"{key} ({config.where(key)})"

    return error.render(label)


def setting_source(ctx: click.Context, key: str) -> tuple[str, str]:
    """Where the command's option `key` got its value: ("flag", "--max-memory") (also for a default, or an option
    the command lacks), ("env", "DFLASH_MAX_MEMORY") or ("config", "max_memory")."""
    from click.core import ParameterSource

    param = next((p for p in ctx.command.params if p.name == key), None)
    flag = max((o for o in param.opts if o.startswith("--")), key=len) if param else "--" + key.replace("_", "-")
    source = ctx.get_parameter_source(key)
    if source == ParameterSource.ENVIRONMENT and param is not None and param.envvar:
        return "env", str(param.envvar)
    # the file's values reach generate, chat and bench as click's default_map, and `show` merges them into its
    # unset options itself (a DEFAULT there)
    if source in (ParameterSource.DEFAULT_MAP, ParameterSource.DEFAULT):
        try:
            if key in S.load_config().values:
                return "config", key
        except S.ConfigError:
            pass
    return "flag", flag


def run_plain(color: str, debug: bool, body: Callable[[Any], int]) -> None:
    """`guarded` with an Output that never colours provenance (the commands that generate nothing)."""
    from dflash_cli.ui.render import Output

    guarded(lambda: Output(color, provenance=False), body, debug)


# -- printing ------------------------------------------------------------------------------------------

def echo(lines: list[str] | str) -> None:
    """Tables and JSON to stdout."""
    click.echo("\n".join(lines) if isinstance(lines, list) else lines)


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns separated by three spaces (ollama's look); no trailing blanks."""
    return columns([[str(c) for c in row] for row in [headers, *rows]], gap=3, numeric=False)


def cell(value: Any) -> str:
    """A table cell: - for nothing, on/off for booleans."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


# -- the registry and the config file ------------------------------------------------------------------

def registry() -> dict[str, Any]:
    """The known pairs; a broken config file is one error line (exit 1), as for every model command."""
    from dflash_cli.engine.errors import DFlashError
    from dflash_cli.models.resolve import known_pairs

    try:
        return known_pairs()
    except S.ConfigError as error:
        raise DFlashError(str(error), error.hint) from None


def config_values() -> dict[str, Any]:
    """The config file's values ({} when it cannot be read: the error is reported elsewhere)."""
    try:
        return dict(S.load_config().values)
    except S.ConfigError:
        return {}
