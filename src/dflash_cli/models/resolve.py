"""--model/--draft values -> specs -> local folders: the one place that reads those values.

`resolve_spec` and `drafter_source` name what a value means from the registry and the disk alone (no
network, no download): `show`, `pull`, `rm` and `bench` stop there. `resolve_pair` goes on for the
commands that run a model: a pairing preflight from the two config.json files, a memory preflight
(models/memory/preflight.py), then the download of what is missing, so a mismatched pair costs a few
kilobytes, not gigabytes.

No printing: progress and notes go through `on_status`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cli.engine.errors import CheckpointError, DFlashError, UnsupportedModelError
from dflash_cli.models.memory.preflight import MemoryBudget, check_prequantized, preflight_memory
from dflash_cli.models.registry import (
    BUILTIN_MODELS,
    PairEntry,
    demo_drafter_dir,
    find_pair,
    folder_repo_names,
    load_registry,
)


@dataclass(frozen=True)
class ModelSpec:
    """What a --model value names: a local folder, a built-in model, or a Hub repo (with its pair)."""

    kind: str  # "folder", "builtin" or "repo"
    target: str  # folder path, built-in model, or repo id
    target_revision: str | None = None
    drafter: str | None = None  # drafter repo id (or folder) the registry pairs with it
    drafter_revision: str | None = None
    entry: PairEntry | None = None
    alias: str | None = None  # the registry alias or built-in name the value was (not a folder or repo id)


def known_pairs() -> dict[str, PairEntry]:
    """The registry: the shipped pairs, then those of the config file."""
    from dflash_cli import settings

    config = settings.load_config()
    return load_registry(config.pairs, user_source=str(config.path))


def looks_like_repo_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "~", "/"))


def known_names(registry: dict[str, PairEntry]) -> str:
    return ", ".join(sorted(registry)) + ", " + ", ".join(BUILTIN_MODELS)


def resolve_spec(value: str, registry: dict[str, PairEntry] | None = None, *, allow_unsupported: bool = False,
                 store: bool = False) -> ModelSpec:
    """Turns a --model value into a ModelSpec, from the registry and the disk only (never the network).

    A folder wins over a name only when it holds a config.json. Pairs marked unsupported are refused
    unless `allow_unsupported` (show, rm). `store`: the value is meant for the model store (pull, show,
    rm), and an unknown one is reported against the known names."""
    registry = known_pairs() if registry is None else registry
    entry = find_pair(value, registry)
    if entry is not None and entry.unsupported and not allow_unsupported:
        raise UnsupportedModelError(f"{entry.alias} ({entry.target}) is not supported: {entry.unsupported}",
                                    hint="pick another model: dflash-cli list --known")
    drafter = dict(drafter=entry.drafter, drafter_revision=entry.drafter_revision) if entry else {}
    folder = Path(value).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file():  # a model folder wins over a name
        return ModelSpec("folder", str(folder), entry=entry, **drafter)
    if value.lower() == "demo":
        return ModelSpec("builtin", "smollm2-135m", drafter=str(demo_drafter_dir()), alias="demo")
    if value.lower() in BUILTIN_MODELS:
        return ModelSpec("builtin", value.lower(), alias=value.lower())
    if entry is not None:
        named = entry.alias if value.lower() in registry else None
        return ModelSpec("repo", entry.target, entry.target_revision, entry=entry, alias=named, **drafter)
    if looks_like_repo_id(value):
        return ModelSpec("repo", value)
    if folder.is_dir():
        raise CheckpointError(f"model folder {folder} has no config.json",
                              hint="a model folder holds config.json, *.safetensors and the tokenizer files; "
                                   "'dflash-cli pull' downloads one")
    if store:
        raise CheckpointError(f"model {value!r} is not a known name or a Hub repo id (org/name)",
                              hint=f"known names: {known_names(registry)} (dflash-cli list --known)")
    raise CheckpointError(f"model {value!r} is not a folder, a known name or a Hub repo id (org/name)",
                          hint=f"known names: {known_names(registry)}")


def drafter_source(draft: str) -> tuple[str, str]:
    """A --draft value -> ("folder", path) or ("repo", repo id)."""
    where = str(Path(draft).expanduser())
    if Path(where).is_dir():
        return "folder", where
    if looks_like_repo_id(draft):
        return "repo", where
    raise CheckpointError(f"drafter {draft!r} is neither a folder nor a Hub repo id (org/name)")


class EngineOnlyError(DFlashError):
    """The pair runs on a multi-GPU server only (registry `runs = "engine"`): nothing is downloaded here."""


def engine_only_error(entry: PairEntry) -> EngineOnlyError:
    """The refusal for running (or downloading) an engine-only pair here: where it runs instead."""
    tp = f" --tp {entry.serve_tp}" if entry.serve_tp else ""
    return EngineOnlyError(
        f"{entry.alias} ({entry.target}) is served by a multi-GPU server (vLLM or SGLang), not run here: "
        "nothing was downloaded",
        hint=f"on the server: dflash-cli serve-cmd {entry.alias} --engine vllm{tp} (or --engine sglang); from here: "
             f"dflash-cli generate --engine http://SERVER:8000 -m {entry.alias} ...; "
             f"dflash-cli show {entry.alias} plans its memory")


@dataclass(frozen=True)
class ResolvedPair:
    target_dir: Path
    drafter_dir: Path | None
    spec: ModelSpec
    drafter_note: str  # why speculation is on or off, for the user
    quant: str  # the quantization to load with: the one asked for, or what --quant auto chose
    drafter_entry: PairEntry | None = None  # the registry pair whose drafter this is (its training facts)
    block_size: int | None = None  # the drafter's trained block size (None: no drafter)
    quant_auto: bool = False  # `quant` is --quant auto's choice: a weight-only one may fall back to none


def find_config(kind: str, where: str, revision: str | None, endpoint: str | None) -> Path:
    """The config.json of a folder or a repo: from the cache, else fetched alone (never the weights)."""
    from dflash_cli.models import cache, hub

    if kind == "folder":
        return Path(where) / "config.json"
    try:
        folder = cache.local_snapshot(where, revision, validate=False)
    except cache.NotDownloadedError:
        folder = hub.fetch_configs(where, revision, endpoint=endpoint)
    return folder / "config.json"


def _fetch(repo: str, revision: str | None, endpoint: str | None, on_status: Callable[[str], None],
           tqdm_class: Any) -> Path:
    from dflash_cli.models import cache, hub
    from dflash_cli.models.folders import default_cache_dir, is_offline
    from dflash_cli.units import fmt_bytes

    try:
        return cache.local_snapshot(repo, revision)
    except cache.NotDownloadedError:
        if is_offline():
            raise
    plan = hub.plan_download(repo, revision, endpoint=endpoint)
    on_status(f"Downloading {repo}: {len(plan.files)} files, {fmt_bytes(plan.download_bytes)} "
              f"(once; into {default_cache_dir()})")
    return hub.pull(repo, revision, endpoint=endpoint, tqdm_class=tqdm_class)


def resolve_pair(model: str, draft: str | None = None, *, no_draft: bool = False, endpoint: str | None = None,
                 on_status: Callable[[str], None] = lambda _: None, tqdm_class: Any = None,
                 quant: str | None = "none", budget: MemoryBudget | None = None,
                 block_size: int | None = None) -> ResolvedPair:
    """Finds (and downloads if needed) the target and its drafter for a --model/--draft pair of values.

    quant None (not given): "auto" for the built-in models (their weights are 4-bit to begin with, and q4
    decodes fastest on the CPUs that run them), "none" for the rest. `block_size`, the one replies will ask
    for, is checked against the drafter's config before any download."""
    from dflash_cli.engine.hf_config import DrafterConfig, check_block_size
    from dflash_cli.engine.pairing import check_pair, check_target_config, read_config_file

    spec = resolve_spec(model)
    if spec.entry is not None and spec.entry.engine_only and spec.kind == "repo":
        raise engine_only_error(spec.entry)  # before any request: not even its config.json is fetched
    if quant is None:
        quant = "auto" if spec.kind == "builtin" else "none"
    if spec.kind == "builtin":
        from dflash_cli.models.smollm2 import ensure_smollm2

        target_where, target_kind = str(ensure_smollm2(on_status=on_status)), "folder"
    else:
        target_where, target_kind = spec.target, spec.kind

    drafter_kind: str | None = None  # "folder" or "repo" (set with drafter_where)
    drafter_where: str | None = None
    drafter_rev: str | None = None
    drafter_entry: PairEntry | None = None
    if no_draft:
        note = "speculation off: --no-draft"
    elif draft:
        drafter_kind, drafter_where = drafter_source(draft)
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
    target_cfg = read_config_file(find_config(target_kind, target_where, spec.target_revision, endpoint))
    check_target_config(target_cfg, target_where)
    check_prequantized(target_cfg, quant, model)
    drafter_cfg = None
    if drafter_kind is not None and drafter_where is not None:
        drafter_cfg = read_config_file(find_config(drafter_kind, drafter_where, drafter_rev, endpoint))
        check_pair(target_cfg, DrafterConfig.from_dict(drafter_cfg, source=f"{drafter_where}/config.json"),
                   target_name=target_where, drafter_name=drafter_where)
    quant_auto = quant == "auto"
    if budget is not None:
        quant = preflight_memory(target_cfg, drafter_cfg, quant, budget, model)
    if quant == "auto":  # no budget to plan with (free memory unknown): nothing quantized
        quant = "none"
    block = DrafterConfig.from_dict(drafter_cfg).block_size if drafter_cfg is not None else None
    check_block_size(block_size, block)

    target_dir = Path(target_where) if target_kind == "folder" else _fetch(
        target_where, spec.target_revision, endpoint, on_status, tqdm_class)
    drafter_dir = None
    if drafter_where is not None:
        drafter_dir = Path(drafter_where) if drafter_kind == "folder" else _fetch(
            drafter_where, drafter_rev, endpoint, on_status, tqdm_class)
    return ResolvedPair(target_dir, drafter_dir, spec, note, quant, drafter_entry, block, quant_auto)


def _names_drafter(draft: str, entry: PairEntry) -> bool:
    """--draft names the registry pair's drafter: its repo id, or a folder of that repo."""
    if not entry.drafter:
        return False
    if draft.lower() == entry.drafter.lower():
        return True
    folder = Path(draft).expanduser()
    return folder.is_dir() and entry.drafter.rsplit("/", 1)[-1].lower() in folder_repo_names(folder)
