"""The checks before any weights load: does the pair fit in the memory free here, and at which quantization.

`preflight_memory` plans from the two config.json files alone (models/memory/plan.py on one device,
models/memory/split.py over several) against a `MemoryBudget` (`memory_budget`: free GPU memory, or
available system memory), and answers the quantization to load with, or a MemoryPlanError naming the
components and what would fit instead. `check_prequantized` refuses a bitsandbytes --quant on a checkpoint
published quantized; `mxfp4_kept` says whether transformers keeps an MXFP4 checkpoint packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_cli.engine.errors import DFlashError

if TYPE_CHECKING:
    from dflash_cli.engine.placement import Placement


class MemoryPlanError(DFlashError):
    """The pair cannot fit in the memory available, at any setting tried."""


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
    from dflash_cli.models.memory.params import prequantized

    method = prequantized(target_cfg)
    if method is not None and quant in ("int8", "nf4"):
        raise InvalidSettingError(f"--quant {quant}: {name} is published quantized ({method}), and transformers "
                                  "does not quantize it again", hint="leave --quant out (or --quant auto)")


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
    from dflash_cli.models.memory.params import prequantized

    if prequantized(target_cfg) != "mxfp4":
        return False
    devices = [d for d, _ in budget.devices] if budget.strategy is not None else [budget.device]
    return all(d.startswith("cuda") for d in devices) and mxfp4_kept(devices[0])[0]


def cache_bytes(planned: str, budget: MemoryBudget) -> int:
    """Bytes per cached key or value of a target planned in `planned` (a quantization, or the budget's dtype):
    4 where the engine runs fp32 activations (q4a8/q8a8, an fp32 model), which the planner counted as 2."""
    from dflash_cli.engine.dtypes import half_caches_asked
    from dflash_cli.models.memory.sizes import cache_value_bytes

    return cache_value_bytes(planned, budget.dtype, half_caches_asked() and budget.device == "cpu")


def preflight_memory(target_cfg: dict, drafter_cfg: dict | None, quant: str, budget: MemoryBudget,
                     name: str) -> str:
    """Returns the quantization to use; raises MemoryPlanError naming components and alternatives."""
    from dflash_cli.models.memory.params import prequantized
    from dflash_cli.models.memory.plan import GIB, choose_quant, plan_memory

    planned = budget.dtype if quant == "none" else quant
    if budget.strategy is not None:
        return preflight_split(target_cfg, drafter_cfg, quant, budget, name)
    packed = mxfp4_packed_on(target_cfg, budget)
    if quant == "auto" and budget.device == "cpu":
        from dflash_cli.engine.device import cpu_auto_quant

        quant = cpu_auto_quant()[0] or "none"
        planned = budget.dtype if quant == "none" else quant
        q4_plan = plan_memory(target_cfg, drafter_cfg, quant=quant, available_bytes=budget.available_bytes,
                              context_tokens=budget.context_tokens,
                              kv_dtype_bytes=cache_bytes(quant, budget)) if quant != "none" else None
        if q4_plan is not None and not q4_plan.fits:
            quant, planned = "none", budget.dtype  # q4 keeps the 16-bit weights beside its codes: try without
    elif quant == "auto":
        chosen = choose_quant(target_cfg, drafter_cfg, context_tokens=budget.context_tokens,
                              available_bytes=budget.available_bytes, mxfp4_packed=packed,
                              kv_dtype_bytes=cache_bytes("none", budget))
        if chosen is not None:
            return "none" if chosen in ("bf16", "fp16", "fp32") else chosen
        # nothing fits: plan the smallest setting there is (a checkpoint published quantized: as it is)
        quant, planned = ("nf4", "nf4") if prequantized(target_cfg) is None else ("none", budget.dtype)
    plan = plan_memory(target_cfg, drafter_cfg, quant=planned, context_tokens=budget.context_tokens,
                       available_bytes=budget.available_bytes, mxfp4_packed=packed,
                       kv_dtype_bytes=cache_bytes(planned, budget))
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
    from dflash_cli.models.memory.split import choose_split_quant, plan_split

    assert budget.strategy is not None
    devices = list(budget.devices)
    packed = mxfp4_packed_on(target_cfg, budget)
    if quant == "auto":
        from dflash_cli.models.memory.params import prequantized

        chosen = choose_split_quant(target_cfg, drafter_cfg, devices=devices, strategy=budget.strategy,
                                    context_tokens=budget.context_tokens, mxfp4_packed=packed,
                                    kv_dtype_bytes=cache_bytes("none", budget))
        if chosen is not None:
            return "none" if chosen in ("bf16", "fp16", "fp32") else chosen
        quant = "nf4" if prequantized(target_cfg) is None else "none"
    planned = budget.dtype if quant == "none" else quant
    plan = plan_split(target_cfg, drafter_cfg, devices=devices, strategy=budget.strategy, quant=planned,
                      context_tokens=budget.context_tokens, mxfp4_packed=packed,
                      kv_dtype_bytes=cache_bytes(planned, budget))
    if plan.fits:
        return quant
    from dflash_cli.engine.pairing import HYBRID_MODEL_TYPES
    from dflash_cli.models.memory.split import split_hint

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
