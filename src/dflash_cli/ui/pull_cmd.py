"""`dflash-cli pull`: download a pair (or one repo) into the Hugging Face cache, with a dry run and progress.

huggingface_hub and rich are imported inside the functions (`dflash-cli --help` stays fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from dflash_cli.engine.errors import CheckpointError
from dflash_cli.ui.common import echo, registry, run_plain, table
from dflash_cli.ui.download_progress import make_tqdm_class, progress_enabled, rich_progress
from dflash_cli.ui.errors import EXIT_OK
from dflash_cli.ui.options import common_options, endpoint_option


@dataclass(frozen=True)
class Wanted:
    repo_id: str
    revision: str | None
    role: str  # "target" or "drafter"


def pull_targets(spec: str, revision: str | None, no_draft: bool,
                 dry_run: bool = False) -> tuple[list[Wanted], str | None]:
    """The repos `pull MODEL` fetches, and the pair alias (if any). A pair that runs only on a multi-GPU
    server is planned (--dry-run) but not downloaded here."""
    from dflash_cli.models.resolve import engine_only_error, resolve_spec

    ms = resolve_spec(spec, registry(), store=True)
    if not dry_run and ms.entry is not None and ms.entry.engine_only:
        raise engine_only_error(ms.entry)
    if ms.kind == "folder":
        raise CheckpointError(f"{spec} is a local folder: there is nothing to pull",
                              hint="use it directly: dflash-cli chat -m " + spec)
    if ms.kind == "builtin":
        raise CheckpointError(f"{spec} is built in (converted locally on first use): there is nothing to pull",
                              hint=f"run it directly: dflash-cli chat -m {spec}")
    out = [Wanted(ms.target, revision or ms.target_revision, "target")]
    if ms.drafter and not no_draft:
        out.append(Wanted(ms.drafter, ms.drafter_revision, "drafter"))
    return out, ms.entry.alias if ms.entry else None


def run_pull(out: Any, spec: str, revision: str | None, dry_run: bool, no_draft: bool,
             endpoint: str | None) -> int:
    from dflash_cli.models import hub
    from dflash_cli.models.cache import NotDownloadedError
    from dflash_cli.models.folders import default_cache_dir, is_offline
    from dflash_cli.units import fmt_bytes

    wanted, alias = pull_targets(spec, revision, no_draft, dry_run)
    cache = default_cache_dir()
    if dry_run:
        if is_offline():
            raise NotDownloadedError("--dry-run asks the Hub for file sizes, but HF_HUB_OFFLINE is set",
                                     hint="unset HF_HUB_OFFLINE to plan a download")
        grand_total = grand_download = 0
        for w in wanted:
            plan = hub.plan_download(w.repo_id, w.revision, endpoint=endpoint)
            grand_total += plan.total_bytes
            grand_download += plan.download_bytes
            echo(f"{w.role} {plan.repo_id} (revision {plan.revision}, commit {plan.commit[:12]}): "
                   f"{len(plan.files)} files, {fmt_bytes(plan.download_bytes)} to download"
                   + (f", {fmt_bytes(plan.cached_bytes)} already cached" if plan.cached_bytes else ""))
            rows = [[f.path, fmt_bytes(f.size), "cached" if f.cached else "download"] for f in plan.files]
            echo(["  " + line for line in table(["FILE", "SIZE", "STATUS"], rows)])
            if plan.skipped:
                echo(f"  skipped (code, pickles, other files): {', '.join(plan.skipped)}")
        echo(f"total: {fmt_bytes(grand_download)} to download"
               + (f" ({fmt_bytes(grand_total - grand_download)} already cached)" if grand_total > grand_download
                  else ""))
        out.info(f"dry run: nothing downloaded; files would go to {cache}")
        return EXIT_OK

    offline = is_offline()
    plans = {}
    if not offline:  # ask about every repo first, so a missing drafter fails before the target downloads
        for w in wanted:
            plans[w.repo_id] = hub.plan_download(w.repo_id, w.revision, endpoint=endpoint)
    bars = progress_enabled(out.err)
    folders: list[tuple[Wanted, Path]] = []
    for w in wanted:
        known = plans.get(w.repo_id)
        if known is not None:
            left = fmt_bytes(known.download_bytes)
            out.info(f"pulling {w.role} {w.repo_id}: {left} to download"
                     + (f" ({fmt_bytes(known.cached_bytes)} already cached)" if known.cached_bytes else ""))
        if bars and known is not None and known.download_bytes:
            with rich_progress(out.err) as progress:
                folder = hub.pull(w.repo_id, w.revision, endpoint=endpoint,
                                  tqdm_class=make_tqdm_class(progress, w.repo_id))
        else:
            folder = hub.pull(w.repo_id, w.revision, endpoint=endpoint, tqdm_class=make_tqdm_class(None, ""))
        folders.append((w, folder))
    width = max(len(w.role) for w, _ in folders)
    for w, folder in folders:
        out.info(f"{w.role:<{width}}  {w.repo_id} -> {folder}", dim=False)
    name = alias or spec
    out.info(f"ready: dflash-cli chat -m {name}" if len(folders) > 1 or alias else
             f"ready: dflash-cli chat -m {name} (no drafter pulled: plain decoding unless --draft)")
    return EXIT_OK


@click.command()
@click.argument("model")
@click.option("--revision", default=None, help="Branch, tag or commit of the target (default: main, "
              "or the registry's pinned commit).")
@click.option("--dry-run", is_flag=True, help="Print the files and sizes a pull would fetch; download nothing.")
@click.option("--no-draft", is_flag=True, help="Pull the target only, not its drafter.")
@endpoint_option
@common_options
def pull(model, revision, dry_run, no_draft, endpoint, color, debug):
    """Download MODEL (a known name or a Hub repo id) and its drafter into the Hugging Face cache.

    Only configs, tokenizer files and safetensors weights are fetched (never code or pickles); files
    already cached are not fetched again, and a transfer cut off mid-file is resumed from where it
    stopped (within the same run). The cache is HF_HUB_CACHE (or HF_HOME/hub); HF_TOKEN is used for
    gated repos.

    \b
    Examples:
      dflash-cli pull qwen3-8b
      dflash-cli pull Qwen/Qwen3-8B --dry-run
      dflash-cli pull qwen3-4b --no-draft
    """
    run_plain(color, debug, lambda out: run_pull(out, model, revision, dry_run, no_draft, endpoint))
