"""--model/--draft values -> local folders: registry lookup, pairing preflight from configs, then download.

No printing: progress and notes go through `on_status`. The pair is checked from the two config.json
files before any weights are downloaded, so a mismatched pair costs a few kilobytes, not gigabytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cli.engine.errors import CheckpointError
from dflash_cli.models.registry import ModelSpec, looks_like_repo_id, resolve_spec


@dataclass(frozen=True)
class ResolvedPair:
    target_dir: Path
    drafter_dir: Path | None
    spec: ModelSpec
    drafter_note: str  # why speculation is on or off, for the user


def _registry():
    from dflash_cli import settings
    from dflash_cli.models.registry import load_registry

    config = settings.load_config()
    return load_registry(config.pairs, user_source=str(config.path))


def _config_of(kind: str, where: str, revision: str | None, endpoint: str | None) -> dict[str, Any]:
    from dflash_cli.models import hub

    folder = Path(where) if kind == "folder" else None
    if kind == "repo":
        try:
            folder = hub.local_snapshot(where, revision, validate=False)
        except hub.NotDownloadedError:
            folder = hub.fetch_configs(where, revision, endpoint=endpoint)
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read config.json of {where}: {e}") from None


def _fetch(repo: str, revision: str | None, endpoint: str | None, on_status: Callable[[str], None],
           tqdm_class: Any) -> Path:
    from dflash_cli.models import hub
    from dflash_cli.ui.render import fmt_bytes  # formatting only

    try:
        return hub.local_snapshot(repo, revision)
    except hub.NotDownloadedError:
        if hub.is_offline():
            raise
    plan = hub.plan_download(repo, revision, endpoint=endpoint)
    on_status(f"Downloading {repo}: {len(plan.files)} files, {fmt_bytes(plan.download_bytes)} "
              f"(once; into {hub.default_cache_dir()})")
    return hub.pull(repo, revision, endpoint=endpoint, tqdm_class=tqdm_class)


def resolve_pair(model: str, draft: str | None = None, *, no_draft: bool = False, endpoint: str | None = None,
                 on_status: Callable[[str], None] = lambda _: None, tqdm_class: Any = None) -> ResolvedPair:
    """Finds (and downloads if needed) the target and its drafter for a --model/--draft pair of values."""
    from dflash_cli.engine.drafter import DrafterConfig
    from dflash_cli.engine.pairing import check_pair, check_target_config

    spec = resolve_spec(model, _registry())
    if spec.kind == "builtin":
        from dflash_cli.models.smollm2 import ensure_smollm2

        target_where, target_kind = str(ensure_smollm2(on_status=on_status)), "folder"
    else:
        target_where, target_kind = spec.target, spec.kind

    drafter_kind, drafter_where, drafter_rev = None, None, None
    if no_draft:
        note = "speculation off: --no-draft"
    elif draft:
        drafter_where = str(Path(draft).expanduser())
        drafter_kind = "folder" if Path(drafter_where).is_dir() else "repo" if looks_like_repo_id(draft) else None
        if drafter_kind is None:
            raise CheckpointError(f"drafter {draft!r} is neither a folder nor a Hub repo id (org/name)")
        note = f"speculation on: drafter {draft}"
    elif spec.drafter:
        drafter_kind, drafter_where, drafter_rev = "repo", spec.drafter, spec.drafter_revision
        note = f"speculation on: drafter {spec.drafter} (paired with {spec.entry.alias} in the registry)"
    else:
        note = "speculation off: no drafter known for this model (--draft FOLDER or REPO)"

    # Preflight from config files only: a bad pair fails here, before any weights download.
    target_cfg = _config_of(target_kind, target_where, spec.target_revision, endpoint)
    check_target_config(target_cfg, target_where)
    if drafter_kind is not None:
        raw = _config_of(drafter_kind, drafter_where, drafter_rev, endpoint)
        check_pair(target_cfg, DrafterConfig.from_dict(raw, source=f"{drafter_where}/config.json"),
                   target_name=target_where, drafter_name=drafter_where)

    target_dir = Path(target_where) if target_kind == "folder" else _fetch(
        target_where, spec.target_revision, endpoint, on_status, tqdm_class)
    drafter_dir = None
    if drafter_kind == "folder":
        drafter_dir = Path(drafter_where)
    elif drafter_kind == "repo":
        drafter_dir = _fetch(drafter_where, drafter_rev, endpoint, on_status, tqdm_class)
    return ResolvedPair(target_dir, drafter_dir, spec, note)
