"""`list`/`ls` and `rm`, and the helpers shared with `pull` (ui/pull_cmd.py) and `show` (ui/show_cmd.py).

No tensor code here, and nothing heavy at import time (`dflash-cli --help` stays fast): huggingface_hub,
rich and torch are imported inside the functions that need them. Tables and JSON go to stdout; progress,
status lines, prompts and errors go to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from dflash_cli import settings as S
from dflash_cli.engine.errors import CheckpointError, DFlashError
from dflash_cli.ui.errors import EXIT_OK, EXIT_USAGE


# ----------------------------------------------------------------------------------------------- helpers
def _registry() -> dict[str, Any]:
    from dflash_cli.models.registry import load_registry

    try:
        config = S.load_config()
    except S.ConfigError as error:
        raise DFlashError(str(error), error.hint) from None
    return load_registry(config.pairs, user_source=str(config.path))


def _config_values() -> dict[str, Any]:
    try:
        return dict(S.load_config().values)
    except S.ConfigError:
        return {}


def _known_names(registry: dict[str, Any]) -> str:
    from dflash_cli.models.registry import BUILTIN_MODELS

    return ", ".join(sorted(registry)) + ", " + ", ".join(BUILTIN_MODELS)


def _unknown(spec: str, registry: dict[str, Any]) -> CheckpointError:
    return CheckpointError(f"model {spec!r} is not a known name or a Hub repo id (org/name)",
                           hint=f"known names: {_known_names(registry)} (dflash-cli list --known)")


def _roles(registry: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """lower-case repo id -> (alias, "target" | "drafter"); the first alias naming a repo wins."""
    out: dict[str, tuple[str, str]] = {}
    for alias, entry in registry.items():
        out.setdefault(entry.target.lower(), (alias, "target"))
        if entry.drafter:
            out.setdefault(entry.drafter.lower(), (alias, "drafter"))
    return out


def _ago(ts: float, now: float | None = None) -> str:
    s = max((now or time.time()) - ts, 0)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= size:
            n = int(s // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return "just now"


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns separated by three spaces (ollama's look); no trailing blanks."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    return ["   ".join(f"{str(c):<{w}}" for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def _print(lines: list[str] | str) -> None:
    click.echo("\n".join(lines) if isinstance(lines, list) else lines)


def common_options(f: Callable) -> Callable:
    f = click.option("--debug", is_flag=True, envvar=S.DEBUG_ENV, help="Show tracebacks of unexpected errors.")(f)
    f = click.option("--color", type=click.Choice(["auto", "always", "never"]), default=S.DEFAULT_COLOR,
                     envvar=S.ENV["color"], show_envvar=True, show_default=True, help="Colours on terminals.")(f)
    return f


def endpoint_option(f: Callable) -> Callable:
    return click.option("--endpoint", envvar="HF_ENDPOINT", hidden=True, default=None,
                        help="Hub endpoint (tests, mirrors).")(f)


def _run(color: str, debug: bool, body: Callable) -> None:
    from dflash_cli.ui.cli import guarded
    from dflash_cli.ui.render import Output

    guarded(lambda: Output(color, provenance=False), body, debug)


# ----------------------------------------------------------------------------------------------- list
def local_rows(registry: dict[str, Any]) -> list[dict[str, Any]]:
    from dflash_cli.models import hub

    roles = _roles(registry)
    rows = []
    for repo in hub.list_local():
        alias, role = roles.get(repo.repo_id.lower(), (None, None))
        rows.append({"repo_id": repo.repo_id, "pair": alias, "role": role, "size_bytes": repo.size_on_disk,
                     "revisions": list(repo.revisions), "refs": list(repo.refs),
                     "last_modified": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(repo.last_modified)),
                     "last_modified_ts": repo.last_modified, "path": str(repo.path)})
    return rows


def known_rows(registry: dict[str, Any]) -> list[dict[str, Any]]:
    from dflash_cli.models.registry import BUILTIN_MODELS

    rows = [{"alias": alias, "target": e.target, "drafter": e.drafter, "block_size": e.block_size,
             "thinking": e.thinking, "unsupported": e.unsupported, "notes": e.notes, "source": e.source}
            for alias, e in sorted(registry.items())]
    rows += [{"alias": name, "target": "(built in)", "drafter": None, "block_size": None, "thinking": None,
              "unsupported": None, "notes": text, "source": "built-in"} for name, text in BUILTIN_MODELS.items()]
    return rows


def _opt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def run_list(out: Any, quiet: bool, as_json: bool, known: bool) -> int:
    from dflash_cli.ui.render import fmt_bytes

    registry = _registry()
    if known:
        rows = known_rows(registry)
        if as_json:
            _print(json.dumps(rows, indent=2))
        elif quiet:
            _print([r["alias"] for r in rows])
        else:
            _print(table(["NAME", "TARGET", "DRAFTER", "BLOCK", "THINKING", "STATUS"],
                         [[r["alias"], r["target"], _opt(r["drafter"]), _opt(r["block_size"]), _opt(r["thinking"]),
                           f"unsupported: {r['unsupported']}" if r["unsupported"] else "ok"] for r in rows]))
        return EXIT_OK
    rows = local_rows(registry)
    if as_json:
        for r in rows:
            r.pop("last_modified_ts")
        _print(json.dumps(rows, indent=2))
        return EXIT_OK
    if quiet:
        if rows:
            _print([r["repo_id"] for r in rows])
        return EXIT_OK
    if not rows:
        from dflash_cli.models import hub

        out.info(f"no models in {hub.default_cache_dir()}; try: dflash-cli pull qwen3-8b "
                 "(dflash-cli list --known shows the known pairs)")
        return EXIT_OK
    now = time.time()
    _print(table(["REPO", "PAIR", "ROLE", "SIZE", "REFS", "REVISION", "MODIFIED"],
                 [[r["repo_id"], _opt(r["pair"]), _opt(r["role"]), fmt_bytes(r["size_bytes"]),
                   ",".join(r["refs"]) or "-",
                   (r["revisions"][0][:12] if r["revisions"] else "-")
                   + (f" (+{len(r['revisions']) - 1})" if len(r["revisions"]) > 1 else ""),
                   _ago(r["last_modified_ts"], now)] for r in rows]))
    return EXIT_OK


def _list_command(name: str, hidden: bool) -> click.Command:
    @click.command(name=name, hidden=hidden)
    @click.option("-q", "--quiet", is_flag=True, help="Print only repo ids (with --known: names).")
    @click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
    @click.option("--known", is_flag=True, help="List the known pairs (the registry) instead of local models.")
    @common_options
    def command(quiet, as_json, known, color, debug):
        """List the models in the local Hugging Face cache (ls is an alias).

        \b
        Examples:
          dflash-cli list
          dflash-cli ls -q
          dflash-cli list --known
        """
        _run(color, debug, lambda out: run_list(out, quiet, as_json, known))

    return command


list_cmd = _list_command("list", hidden=False)
ls_cmd = _list_command("ls", hidden=True)


# ----------------------------------------------------------------------------------------------- rm
def rm_targets(spec: str) -> tuple[list[Any], list[str]]:
    """(cached LocalRepos to remove, repo ids of the pair that are not cached)."""
    from dflash_cli.models import hub
    from dflash_cli.models.registry import looks_like_repo_id

    registry = _registry()
    if spec.lower() in registry:
        entry = registry[spec.lower()]
        ids = [entry.target] + ([entry.drafter] if entry.drafter else [])
    elif looks_like_repo_id(spec):
        ids = [spec]
    else:
        raise _unknown(spec, registry)
    local = {r.repo_id.lower(): r for r in hub.list_local()}
    found = [local[i.lower()] for i in ids if i.lower() in local]
    missing = [i for i in ids if i.lower() not in local]
    if not found:
        raise hub.NotDownloadedError(f"{spec} is not in the local cache ({', '.join(ids)})",
                                     hint="`dflash-cli ls` shows what is downloaded")
    return found, missing


def run_rm(out: Any, spec: str, yes: bool) -> int:
    from dflash_cli.models import hub
    from dflash_cli.ui.render import _isatty, fmt_bytes

    found, missing = rm_targets(spec)
    total = sum(r.size_on_disk for r in found)
    for r in found:
        out.info(f"  {r.repo_id}  {fmt_bytes(r.size_on_disk)}  ({len(r.revisions)} revision"
                 f"{'s' if len(r.revisions) != 1 else ''})", dim=False)
    for m in missing:
        out.info(f"  {m}  (not downloaded)")
    what = f"{len(found)} repo{'s' if len(found) != 1 else ''} ({fmt_bytes(total)})"
    if not yes:
        if not _isatty(sys.stdin):
            out.error(f"not removing {what} without confirmation: stdin is not a terminal",
                      hint=f"pass -y to remove without asking: dflash-cli rm {spec} -y")
            return EXIT_USAGE
        if not click.confirm(f"Remove {what} from {hub.default_cache_dir()}?", default=False, err=True):
            out.info("nothing removed")
            return EXIT_OK
    freed = hub.remove([r.repo_id for r in found])
    out.info(f"removed {', '.join(r.repo_id for r in found)}: freed {fmt_bytes(freed)}", dim=False)
    return EXIT_OK


@click.command()
@click.argument("model")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@common_options
def rm(model, yes, color, debug):
    """Remove MODEL from the Hugging Face cache: a known name removes its target and drafter, a repo id
    only that repository.

    \b
    Examples:
      dflash-cli rm qwen3-8b
      dflash-cli rm z-lab/Qwen3-8B-DFlash-b16 -y
    """
    _run(color, debug, lambda out: run_rm(out, model, yes))
