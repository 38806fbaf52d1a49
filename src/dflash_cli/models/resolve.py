"""--model/--draft values -> specs -> local folders: the one place that reads those values.

`resolve_spec` and `drafter_source` name what a value means from the registry and the disk alone (no
network, no download): `show`, `pull`, `rm` and `bench` stop there. `resolve_pair` goes on for the
commands that run a model: a pairing preflight from the two config.json files, a memory preflight, then
the download of what is missing, so a mismatched pair costs a few kilobytes, not gigabytes.

No printing: progress and notes go through `on_status`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cli.engine.errors import CheckpointError, DFlashError, UnsupportedModelError
from dflash_cli.models.registry import (
    BUILTIN_MODELS,
    PairEntry,
    demo_drafter_dir,
    find_pair,
    folder_repo_names,
    load_registry,
)

if TYPE_CHECKING:
    from dflash_cli.engine.placement import Placement


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


class MemoryPlanError(DFlashError):
    """The pair cannot fit in the memory available, at any setting tried."""


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


def mxfp4_kept(device: str) -> tuple[bool, str]:
    """(kept, why): whether transformers keeps an MXFP4 checkpoint's experts packed when the engine loads it
    on `device` (from_pretrained without use_kernels, as engine/load.py does); otherwise it dequantizes them
    to the model's dtype (bf16 on a GPU). transformers 5.24, quantizers/quantizer_mxfp4.py: on a CPU always
    dequantized (packed MXFP4 there needs use_kernels); on CUDA kept when the GPU's compute capability is 7.5
    or more, triton is 3.4 or later and the `kernels` package is installed in the version range transformers
    accepts."""
    import torch

    where = torch.device(device)
    if where.type != "cuda":
        return False, f"transformers dequantizes them on {where.type}"
    from transformers.utils.import_utils import (
        KERNELS_MAX_VERSION,
        KERNELS_MIN_VERSION,
        is_kernels_available,
        is_triton_available,
    )

    if torch.cuda.get_device_capability(where) < (7, 5):
        return False, "the GPU's compute capability is below 7.5"
    if not is_triton_available("3.4.0"):
        return False, "triton 3.4 or later is not installed"
    if not is_kernels_available():
        return False, f"the kernels package ({KERNELS_MIN_VERSION} <= version < {KERNELS_MAX_VERSION}) is not installed"
    return True, "a CUDA GPU of compute capability 7.5+ with triton and kernels installed"


def check_prequantized(target_cfg: dict, quant: str | None, name: str) -> None:
    """--quant int8/nf4 on a checkpoint published quantized (gpt-oss's MXFP4, fp8, ...): transformers refuses
    a bitsandbytes config on top of it, after the download; refused here, before it."""
    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.models.sizes import prequantized

    method = prequantized(target_cfg)
    if method is not None and quant in ("int8", "nf4"):
        raise InvalidSettingError(f"--quant {quant}: {name} is published quantized ({method}), and transformers "
                                  "does not quantize it again", hint="leave --quant out (or --quant auto)")


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


@dataclass(frozen=True)
class MemoryBudget:
    """What the preflight plans against: bytes free, tokens to hold, dtype when not quantized."""

    available_bytes: int
    context_tokens: int
    dtype: str  # bf16, fp16 or fp32
    where: str  # "GPU memory" or "system memory", for messages
    device: str = ""  # the device planned for: cuda:0, cpu, ... (the hot device of a split)
    strategy: str | None = None  # --device-map: the target is split over `devices`
    devices: tuple[tuple[str, int | None], ...] = ()  # (device, bytes or None: unbounded), hot first
    gpus: int = 0  # GPUs on this machine (a pair too big for one of several can be split over them)


def mxfp4_packed_on(target_cfg: dict, budget: MemoryBudget) -> bool:
    """An MXFP4 target's experts stay packed on the budget's device(s) (mxfp4_kept; all of a split on GPUs)."""
    from dflash_cli.models.sizes import prequantized

    if prequantized(target_cfg) != "mxfp4":
        return False
    devices = [d for d, _ in budget.devices] if budget.strategy is not None else [budget.device]
    return all(d.startswith("cuda") for d in devices) and mxfp4_kept(devices[0])[0]


def preflight_memory(target_cfg: dict, drafter_cfg: dict | None, quant: str, budget: MemoryBudget,
                     name: str) -> str:
    """Returns the quantization to use; raises MemoryPlanError naming components and alternatives."""
    from dflash_cli.models.plan import GIB, choose_quant, plan_memory
    from dflash_cli.models.sizes import prequantized

    planned = budget.dtype if quant == "none" else quant
    if budget.strategy is not None:
        return preflight_split(target_cfg, drafter_cfg, quant, budget, name)
    packed = mxfp4_packed_on(target_cfg, budget)
    if quant == "auto" and budget.device == "cpu":
        from dflash_cli.engine.device import cpu_auto_quant

        quant = cpu_auto_quant()[0] or "none"
        planned = budget.dtype if quant == "none" else quant
        q4_plan = plan_memory(target_cfg, drafter_cfg, quant=quant, available_bytes=budget.available_bytes,
                              context_tokens=budget.context_tokens) if quant != "none" else None
        if q4_plan is not None and not q4_plan.fits:
            quant, planned = "none", budget.dtype  # q4 keeps the 16-bit weights beside its codes: try without
    elif quant == "auto":
        chosen = choose_quant(target_cfg, drafter_cfg, context_tokens=budget.context_tokens,
                              available_bytes=budget.available_bytes, mxfp4_packed=packed)
        if chosen is not None:
            return "none" if chosen in ("bf16", "fp16", "fp32") else chosen
        # nothing fits: plan the smallest setting there is (a checkpoint published quantized: as it is)
        quant, planned = ("nf4", "nf4") if prequantized(target_cfg) is None else ("none", budget.dtype)
    plan = plan_memory(target_cfg, drafter_cfg, quant=planned, context_tokens=budget.context_tokens,
                       available_bytes=budget.available_bytes, mxfp4_packed=packed)
    if plan.fits:
        return quant
    parts = (f"target {plan.target_weights / GIB:.1f} + drafter {plan.drafter_weights / GIB:.1f} + "
             f"KV caches {(plan.target_kv + plan.drafter_kv) / GIB:.1f} + working {plan.activations / GIB:.1f}")
    split = [f"--device-map auto splits it over the {budget.gpus} GPUs"] if budget.gpus > 1 else []
    raise MemoryPlanError(
        f"{name} needs about {plan.total / GIB:.1f} GiB in {planned} at {budget.context_tokens:,} tokens "
        f"({parts}), but {budget.available_bytes / GIB:.1f} GiB of {budget.where} are free",
        hint="; ".join(split + plan.suggestions[:3]) or "use a smaller model")


def preflight_split(target_cfg: dict, drafter_cfg: dict | None, quant: str, budget: MemoryBudget,
                    name: str) -> str:
    """preflight_memory for a target split over devices: per-device plans; `--quant auto` splits before
    it quantizes harder, and offloads only when nothing fits on the GPUs."""
    from dflash_cli.models.split import choose_split_quant, plan_split

    assert budget.strategy is not None
    devices = list(budget.devices)
    packed = mxfp4_packed_on(target_cfg, budget)
    if quant == "auto":
        from dflash_cli.models.sizes import prequantized

        chosen = choose_split_quant(target_cfg, drafter_cfg, devices=devices, strategy=budget.strategy,
                                    context_tokens=budget.context_tokens, mxfp4_packed=packed)
        if chosen is not None:
            return "none" if chosen in ("bf16", "fp16", "fp32") else chosen
        quant = "nf4" if prequantized(target_cfg) is None else "none"
    planned = budget.dtype if quant == "none" else quant
    plan = plan_split(target_cfg, drafter_cfg, devices=devices, strategy=budget.strategy, quant=planned,
                      context_tokens=budget.context_tokens, mxfp4_packed=packed)
    if plan.fits:
        return quant
    from dflash_cli.engine.pairing import HYBRID_MODEL_TYPES
    from dflash_cli.models.split import split_hint

    raise MemoryPlanError(f"{name} does not fit split over {', '.join(d for d, _ in devices)} in {planned} at "
                          f"{budget.context_tokens:,} tokens: {plan.problem}",
                          hint=split_hint(target_cfg.get("model_type") in HYBRID_MODEL_TYPES))


def memory_budget(device: str | None, dtype: str | None, context_tokens: int, device_map: str | None = None,
                  max_memory: str | None = None) -> MemoryBudget | None:
    """What a pair must fit in on the device `generate --device` would pick: free GPU memory on CUDA,
    available system memory on CPU (None: unknown); with --device-map, every device of the split."""
    from dflash_cli.engine.placement import resolve_placement

    return placement_budget(resolve_placement(device, device_map, max_memory), dtype, context_tokens)


def placement_budget(placement: Placement, dtype: str | None, context_tokens: int) -> MemoryBudget | None:
    """`memory_budget` of settings already resolved (engine/placement.py)."""
    import torch

    from dflash_cli.engine.device import free_memory, pick_dtype
    from dflash_cli.engine.dtypes import plan_dtype

    dt = plan_dtype(pick_dtype(dtype, placement.device))
    if placement.split is not None:
        strategy, devices = placement.split
        total = sum(b for _, b in devices if b is not None)
        return MemoryBudget(total, context_tokens, dt, "memory over " + ", ".join(d for d, _ in devices),
                            str(placement.device), strategy, tuple(devices))
    free = free_memory(placement.device)
    if free is None:
        return None
    gpus = torch.cuda.device_count() if placement.device.type == "cuda" else 0
    return MemoryBudget(free, context_tokens, dt,
                        "GPU memory" if placement.device.type == "cuda" else "system memory",
                        str(placement.device), gpus=gpus)


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
    from dflash_cli.engine.config import DrafterConfig, check_block_size
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

    drafter_kind, drafter_where, drafter_rev, drafter_entry = None, None, None, None
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
    if drafter_kind is not None:
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
    if drafter_kind == "folder":
        drafter_dir = Path(drafter_where)
    elif drafter_kind == "repo":
        drafter_dir = _fetch(drafter_where, drafter_rev, endpoint, on_status, tqdm_class)
    return ResolvedPair(target_dir, drafter_dir, spec, note, quant, drafter_entry, block, quant_auto)


def _names_drafter(draft: str, entry: PairEntry) -> bool:
    """--draft names the registry pair's drafter: its repo id, or a folder of that repo."""
    if not entry.drafter:
        return False
    if draft.lower() == entry.drafter.lower():
        return True
    folder = Path(draft).expanduser()
    return folder.is_dir() and entry.drafter.rsplit("/", 1)[-1].lower() in folder_repo_names(folder)
