"""`dflash-cli rm`: remove a pair (or one repo) from the Hugging Face cache, after a confirmation."""

from __future__ import annotations

import sys
from typing import Any

import click

from dflash_cli.ui.common import common_options, registry, run_plain
from dflash_cli.ui.errors import EXIT_OK, EXIT_USAGE


def rm_targets(value: str) -> tuple[list[Any], list[str]]:
    """(cached LocalRepos to remove, repo ids of the pair that are not cached). A known name removes its
    target and drafter; a repo id only that repository."""
    from dflash_cli.engine.errors import CheckpointError
    from dflash_cli.models import hub
    from dflash_cli.models.resolve import resolve_spec

    spec = resolve_spec(value, registry(), allow_unsupported=True, store=True)
    if spec.kind != "repo":
        raise CheckpointError(f"{value} is {'a local folder' if spec.kind == 'folder' else 'built in'}, "
                              "not a repository of the Hugging Face cache",
                              hint="`dflash-cli ls` shows what is downloaded")
    ids = [spec.target]
    if spec.alias is not None and spec.drafter:
        ids.append(spec.drafter)
    local = {r.repo_id.lower(): r for r in hub.list_local()}
    found = [local[i.lower()] for i in ids if i.lower() in local]
    missing = [i for i in ids if i.lower() not in local]
    if not found:
        raise hub.NotDownloadedError(f"{value} is not in the local cache ({', '.join(ids)})",
                                     hint="`dflash-cli ls` shows what is downloaded")
    return found, missing


def run_rm(out: Any, spec: str, yes: bool) -> int:
    from dflash_cli.models import hub
    from dflash_cli.ui.render import isatty
    from dflash_cli.units import fmt_bytes

    found, missing = rm_targets(spec)
    total = sum(r.size_on_disk for r in found)
    for r in found:
        out.info(f"  {r.repo_id}  {fmt_bytes(r.size_on_disk)}  ({len(r.revisions)} revision"
                 f"{'s' if len(r.revisions) != 1 else ''})", dim=False)
    for m in missing:
        out.info(f"  {m}  (not downloaded)")
    what = f"{len(found)} repo{'s' if len(found) != 1 else ''} ({fmt_bytes(total)})"
    if not yes:
        if not isatty(sys.stdin):
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
    run_plain(color, debug, lambda out: run_rm(out, model, yes))
