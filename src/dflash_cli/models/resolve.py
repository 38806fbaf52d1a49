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

from dflash_cli.engine.errors import CheckpointError, DFlashError
from dflash_cli.models.registry import (ModelSpec, PairEntry, folder_repo_names, looks_like_repo_id,
                                        resolve_spec)


class MemoryPlanError(DFlashError):
    """The pair cannot fit in the memory available, at any setting tried."""


@dataclass(frozen=True)
class ResolvedPair:
    target_dir: Path
    drafter_dir: Path | None
    spec: ModelSpec
    drafter_note: str  # why speculation is on or off, for the user
    quant: str  # the quantization to load with: the one asked for, or what --quant auto chose
    drafter_entry: PairEntry | None = None  # the registry pair whose drafter this is (its training facts)
    block_size: int | None = None  # the drafter's trained block size (None: no drafter)


@dataclass(frozen=True)
class MemoryBudget:
    """What the preflight plans against: bytes free, tokens to hold, dtype when not quantized."""

    available_bytes: int
    context_tokens: int
    dtype: str  # bf16, fp16 or fp32
    where: str  # "cuda" or "system memory", for messages


def preflight_memory(target_cfg: dict, drafter_cfg: dict | None, quant: str, budget: MemoryBudget,
                     name: str) -> str:
    """Returns the quantization to use; raises MemoryPlanError naming components and alternatives."""
    from dflash_cli.models.plan import GIB, choose_quant, plan_memory

    planned = budget.dtype if quant == "none" else quant
    if quant == "auto":
        chosen = choose_quant(target_cfg, drafter_cfg, context_tokens=budget.context_tokens,
                              available_bytes=budget.available_bytes)
        if chosen is not None:
            return "none" if chosen in ("bf16", "fp16", "fp32") else chosen
        planned = "nf4"
    plan = plan_memory(target_cfg, drafter_cfg, quant=planned, context_tokens=budget.context_tokens,
                       available_bytes=budget.available_bytes)
    if plan.fits:
        return quant
    parts = (f"target {plan.target_weights / GIB:.1f} + drafter {plan.drafter_weights / GIB:.1f} + "
             f"KV caches {(plan.target_kv + plan.drafter_kv) / GIB:.1f} + working {plan.activations / GIB:.1f}")
    raise MemoryPlanError(
        f"{name} needs about {plan.total / GIB:.1f} GiB in {planned} at {budget.context_tokens:,} tokens "
        f"({parts}), but {budget.available_bytes / GIB:.1f} GiB of {budget.where} are free",
        hint="; ".join(plan.suggestions[:3]) or "use a smaller model")


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
                 on_status: Callable[[str], None] = lambda _: None, tqdm_class: Any = None,
                 quant: str = "none", budget: MemoryBudget | None = None) -> ResolvedPair:
    """Finds (and downloads if needed) the target and its drafter for a --model/--draft pair of values."""
    from dflash_cli.engine.drafter import DrafterConfig
    from dflash_cli.engine.pairing import check_pair, check_target_config

    spec = resolve_spec(model, _registry())
    if spec.kind == "builtin":
        from dflash_cli.models.smollm2 import ensure_smollm2

        target_where, target_kind = str(ensure_smollm2(on_status=on_status)), "folder"
    else:
        target_where, target_kind = spec.target, spec.kind

    drafter_kind, drafter_where, drafter_rev, drafter_entry = None, None, None, None
    if no_draft:
        note = "speculation off: --no-draft"
    elif draft:
        drafter_where = str(Path(draft).expanduser())
        drafter_kind = "folder" if Path(drafter_where).is_dir() else "repo" if looks_like_repo_id(draft) else None
        if drafter_kind is None:
            raise CheckpointError(f"drafter {draft!r} is neither a folder nor a Hub repo id (org/name)")
        note = f"speculation on: drafter {draft}"
        if spec.entry is not None and _names_drafter(draft, spec.entry):
            drafter_entry = spec.entry
    elif spec.drafter:
        drafter_kind = "folder" if Path(spec.drafter).is_dir() else "repo"
        drafter_where, drafter_rev = spec.drafter, spec.drafter_revision
        paired = f"paired with {spec.entry.alias} in the registry" if spec.entry else "built in"
        note = f"speculation on: drafter {spec.drafter} ({paired})"
        drafter_entry = spec.entry
    else:
        note = "speculation off: no drafter known for this model (--draft FOLDER or REPO)"

    # Preflight from config files only: a bad pair fails here, before any weights download.
    target_cfg = _config_of(target_kind, target_where, spec.target_revision, endpoint)
    check_target_config(target_cfg, target_where)
    drafter_cfg = None
    if drafter_kind is not None:
        drafter_cfg = _config_of(drafter_kind, drafter_where, drafter_rev, endpoint)
        check_pair(target_cfg, DrafterConfig.from_dict(drafter_cfg, source=f"{drafter_where}/config.json"),
                   target_name=target_where, drafter_name=drafter_where)
    if budget is not None:
        quant = preflight_memory(target_cfg, drafter_cfg, quant, budget, model)
        if quant == "auto":
            quant = "none"

    target_dir = Path(target_where) if target_kind == "folder" else _fetch(
        target_where, spec.target_revision, endpoint, on_status, tqdm_class)
    drafter_dir = None
    if drafter_kind == "folder":
        drafter_dir = Path(drafter_where)
    elif drafter_kind == "repo":
        drafter_dir = _fetch(drafter_where, drafter_rev, endpoint, on_status, tqdm_class)
    block = DrafterConfig.from_dict(drafter_cfg).block_size if drafter_cfg is not None else None
    return ResolvedPair(target_dir, drafter_dir, spec, note, quant, drafter_entry, block)


def _names_drafter(draft: str, entry: PairEntry) -> bool:
    """--draft names the registry pair's drafter: its repo id, or a folder of that repo."""
    if not entry.drafter:
        return False
    if draft.lower() == entry.drafter.lower():
        return True
    folder = Path(draft).expanduser()
    return folder.is_dir() and entry.drafter.rsplit("/", 1)[-1].lower() in folder_repo_names(folder)
