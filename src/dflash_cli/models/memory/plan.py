"""Memory planner: does a target (+ drafter) fit, at which quantization and context, and what else would.

Pure arithmetic on `config.json` dicts (no torch, no transformers), so it runs before any weights are
downloaded. The sizes it adds up, and how they are counted, are in `models/memory/sizes.py` (bytes) and
`models/memory/params.py` (parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from dflash_cli.engine.hf_config import drafter_block_size
from dflash_cli.models.memory.params import prequantized
from dflash_cli.models.memory.sizes import (
    AUTO_ORDER,
    GIB,
    WeightEstimate,
    activation_bytes,
    drafter_kv_cache_bytes,
    drafter_weight_bytes,
    gib,
    head_shortlist_bytes,
    kv_cache_bytes,
    normalize_quant,
    target_weight_bytes,
)

__all__ = ["GIB", "Alternative", "MemoryPlan", "ServerEstimate", "choose_quant", "format_plan", "format_server",
           "max_context_that_fits", "plan_memory", "server_estimate"]


@dataclass(frozen=True)
class Alternative:
    """One re-planned alternative: the knob, its value, and the resulting plan's total."""

    knob: str
    value: Any
    total: int
    fits: bool
    text: str


@dataclass(frozen=True)
class MemoryPlan:
    quant: str
    drafter_quant: str | None
    context_tokens: int
    block_size: int
    available_bytes: int
    target_weights: int
    drafter_weights: int
    target_kv: int
    drafter_kv: int
    activations: int
    activation_parts: dict[str, int]
    target_estimate: WeightEstimate
    drafter_estimate: WeightEstimate | None
    alternatives: tuple[Alternative, ...] = ()
    notes: tuple[str, ...] = ()
    mxfp4_packed: bool = False  # the target's MXFP4 experts stay packed (transformers' kernels), else dequantized

    @property
    def total(self) -> int:
        return self.target_weights + self.drafter_weights + self.target_kv + self.drafter_kv + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.available_bytes

    @property
    def headroom(self) -> int:
        return self.available_bytes - self.total

    @property
    def suggestions(self) -> list[str]:
        return [a.text for a in self.alternatives]

    @property
    def components(self) -> dict[str, int]:
        return {"target weights": self.target_weights, "drafter weights": self.drafter_weights,
                "target KV cache": self.target_kv, "drafter KV cache": self.drafter_kv,
                "activations + margin": self.activations}


def _plan(target_config, drafter_config, quant, drafter_quant, context_tokens, block_size, available_bytes,
          kv_dtype_bytes, mxfp4_packed: bool = False) -> MemoryPlan:
    quant = normalize_quant(quant)
    dq = normalize_quant(drafter_quant) if drafter_config is not None else None
    t = target_weight_bytes(target_config, quant, mxfp4_packed=mxfp4_packed)
    d: WeightEstimate | None = None
    if drafter_config is not None and dq is not None:
        d = drafter_weight_bytes(drafter_config, dq)
        if quant in ("q4a8", "q8a8"):  # greedy drafts read a 4-bit copy of the head first
            copy = head_shortlist_bytes(target_config)
            d = replace(d, components={**d.components, "head_shortlist": copy},
                        notes=(*d.notes, f"greedy drafts keep a 4-bit copy of the LM head ({copy / 2**20:.0f} MiB, "
                                         "less for a draft vocabulary)"))
    rows = context_tokens + block_size  # a verified block sits in the cache until it is cropped
    t_kv = kv_cache_bytes(target_config, rows, kv_dtype_bytes)
    d_kv = drafter_kv_cache_bytes(drafter_config, rows, kv_dtype_bytes) if drafter_config is not None else 0
    weights = t.total + (d.total if d else 0)
    parts = activation_bytes(target_config, drafter_config, context_tokens=context_tokens,
                             block_size=block_size, weight_bytes=weights)
    notes = list(t.notes) + (list(d.notes) if d else [])
    notes.append("activations = logits (2 x block x vocab x fp32) + prefill working set + 10% of weights "
                 "+ 0.5 GiB CUDA context (a rule of thumb)")
    return MemoryPlan(quant=quant, drafter_quant=dq, context_tokens=context_tokens, block_size=block_size,
                      available_bytes=int(available_bytes), target_weights=t.total,
                      drafter_weights=d.total if d else 0, target_kv=t_kv, drafter_kv=d_kv,
                      activations=sum(parts.values()), activation_parts=parts, target_estimate=t,
                      drafter_estimate=d, notes=tuple(notes), mxfp4_packed=mxfp4_packed)


def max_context_that_fits(target_config, drafter_config, *, quant, block_size, available_bytes,
                          drafter_quant=None, kv_dtype_bytes: int = 2, upper: int = 1 << 22,
                          mxfp4_packed: bool = False) -> int | None:
    """The longest context (tokens) whose plan fits, by bisection; None if not even 1 token fits."""
    def fits(n: int) -> bool:
        return _plan(target_config, drafter_config, quant, drafter_quant, n, block_size, available_bytes,
                     kv_dtype_bytes, mxfp4_packed).fits

    if not fits(1):
        return None
    lo, hi = 1, upper
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _alternatives(plan: MemoryPlan, target_config, drafter_config, kv_dtype_bytes) -> list[Alternative]:
    args = dict(drafter_quant=plan.drafter_quant, context_tokens=plan.context_tokens,
                block_size=plan.block_size)
    out: list[Alternative] = []

    packed = plan.mxfp4_packed

    def add(knob: str, value: Any, label: str, **changes) -> None:
        kw: dict[str, Any] = dict(args, quant=plan.quant, mxfp4_packed=packed)
        kw.update(changes)
        alt = _plan(target_config, drafter_config if kw.pop("drafter", True) else None, kw["quant"],
                    kw["drafter_quant"], kw["context_tokens"], kw["block_size"], plan.available_bytes,
                    kv_dtype_bytes, kw["mxfp4_packed"])
        verdict = "fits" if alt.fits else f"still {gib(-alt.headroom)} over"
        out.append(Alternative(knob, value, alt.total, alt.fits,
                               f"{label}: {gib(alt.total)} total ({verdict})"))

    bnb = prequantized(target_config) is None  # bitsandbytes cannot requantize a quantized checkpoint
    if plan.target_estimate.mxfp4 == "dequantized":
        add("mxfp4", True, "MXFP4 experts kept packed (a CUDA GPU of compute capability 7.5+ with triton>=3.4 "
            "and kernels installed)", mxfp4_packed=True)
    smaller = {"bf16": ("int8", "nf4"), "fp16": ("int8", "nf4"), "fp32": ("int8", "nf4"), "int8": ("nf4",)}
    for q in smaller.get(plan.quant, ()) if bnb else ():
        add("quant", q, f"target in {'4' if q == 'nf4' else '8'}-bit (--quant {q})", quant=q)
    n = max_context_that_fits(target_config, drafter_config, quant=plan.quant, block_size=plan.block_size,
                              available_bytes=plan.available_bytes, drafter_quant=plan.drafter_quant,
                              kv_dtype_bytes=kv_dtype_bytes, upper=max(plan.context_tokens - 1, 1),
                              mxfp4_packed=packed)
    if n is not None and n < plan.context_tokens:
        add("context_tokens", n, f"a context of at most {n:,} tokens", context_tokens=n)
    elif bnb and plan.quant != "nf4" and not any(a.knob == "quant" and a.value == "nf4" and a.fits for a in out):
        n = max_context_that_fits(target_config, drafter_config, quant="nf4", block_size=plan.block_size,
                                  available_bytes=plan.available_bytes, drafter_quant=plan.drafter_quant,
                                  kv_dtype_bytes=kv_dtype_bytes, upper=max(plan.context_tokens - 1, 1))
        if n is not None and n < plan.context_tokens:
            add("context_tokens", n, f"--quant nf4 with a context of at most {n:,} tokens",
                quant="nf4", context_tokens=n)
    if plan.block_size > 8:
        add("block_size", 8, "a smaller block (--block-size 8)", block_size=8)
    elif plan.block_size > 2:
        b = plan.block_size // 2
        add("block_size", b, f"a smaller block (--block-size {b})", block_size=b)
    if drafter_config is not None:
        if plan.drafter_quant not in ("int8", "nf4"):
            add("drafter_quant", "int8", "drafter layers in int8 (drafter quant int8)", drafter_quant="int8")
        add("draft", False, "no drafter (--no-draft)", drafter=False)
    if not any(a.fits for a in out):
        q = "nf4" if bnb else plan.quant  # a checkpoint published quantized stays as it is
        small = dict(quant=q, block_size=min(plan.block_size, 8), context_tokens=min(plan.context_tokens, 1024),
                     mxfp4_packed=True if plan.target_estimate.mxfp4 else packed)
        label = ("everything smallest (" + ("--quant nf4, " if bnb else "")
                 + ("MXFP4 kept packed, " if plan.target_estimate.mxfp4 else "")
                 + f"--block-size {small['block_size']}, context {small['context_tokens']:,} tokens")
        if drafter_config is not None:
            small["drafter_quant"] = "nf4"
            label += ", drafter quant nf4"
        add("smallest", small, label + ")", **small)
    return out


def plan_memory(target_config: dict[str, Any], drafter_config: dict[str, Any] | None = None, *,
                quant: str = "bf16", context_tokens: int, block_size: int | None = None,
                available_bytes: int, drafter_quant: str | None = None, kv_dtype_bytes: int = 2,
                mxfp4_packed: bool = False) -> MemoryPlan:
    """Plans GPU memory for a target (+ drafter) and, when it does not fit, re-plans alternatives.

    `quant` may be "auto" (the best of bf16, int8, nf4 that fits; nf4 if none does; a checkpoint published
    quantized, MXFP4 or fp8, only bf16: transformers refuses bitsandbytes on top of it).
    `block_size` defaults to the drafter's (1 without a drafter). `drafter_quant` defaults to bf16.
    `mxfp4_packed`: an MXFP4 target keeps its experts packed (see models/memory/preflight.mxfp4_kept).
    """
    if block_size is None:
        block_size = drafter_block_size(drafter_config) if drafter_config is not None else 1
    if str(quant).lower() == "auto":
        fallback = "nf4" if prequantized(target_config) is None else "bf16"
        quant = choose_quant(target_config, drafter_config, context_tokens=context_tokens, block_size=block_size,
                             available_bytes=available_bytes, drafter_quant=drafter_quant,
                             kv_dtype_bytes=kv_dtype_bytes, mxfp4_packed=mxfp4_packed) or fallback
    plan = _plan(target_config, drafter_config, quant, drafter_quant, context_tokens, block_size,
                 available_bytes, kv_dtype_bytes, mxfp4_packed)
    if not plan.fits:
        plan = replace(plan, alternatives=tuple(_alternatives(plan, target_config, drafter_config, kv_dtype_bytes)))
    return plan


def choose_quant(target_config: dict[str, Any], drafter_config: dict[str, Any] | None = None, *,
                 context_tokens: int, block_size: int | None = None, available_bytes: int,
                 drafter_quant: str | None = None, kv_dtype_bytes: int = 2, mxfp4_packed: bool = False) -> str | None:
    """`--quant auto`: the best quality that fits (bf16, then int8, then nf4; only bf16 for a checkpoint
    published quantized); None if nothing fits."""
    if block_size is None:
        block_size = drafter_block_size(drafter_config) if drafter_config is not None else 1
    order = AUTO_ORDER if prequantized(target_config) is None else AUTO_ORDER[:1]
    for q in order:
        if _plan(target_config, drafter_config, q, drafter_quant, context_tokens, block_size, available_bytes,
                 kv_dtype_bytes, mxfp4_packed).fits:
            return q
    return None


# ---------------------------------------------------------------------------------------------------
# pairs that only a multi-GPU server runs (registry `runs = "engine"`)

#: the GPU sizes a server estimate is given for (80 GiB: A100/H100; 141 GiB: H200)
SERVER_GPUS = (80 * GIB, 141 * GIB)
#: the share of a GPU an engine gives to weights and KV cache (vLLM's default --gpu-memory-utilization)
SERVER_UTILIZATION = 0.9


@dataclass(frozen=True)
class ServerEstimate:
    """What serving a pair takes: its weights as published (an engine keeps the checkpoint's format: int4,
    fp8, MXFP4), the target's KV cache at the context, and the fewest GPUs of each size that hold them."""

    target_bytes: int
    target_format: str
    drafter_bytes: int | None  # None: the drafter's config was not read
    kv_bytes: int
    context_tokens: int
    gpus: tuple[tuple[int, int], ...]  # (GPU bytes, GPUs needed), for SERVER_GPUS

    @property
    def total(self) -> int:
        return self.target_bytes + (self.drafter_bytes or 0) + self.kv_bytes


def server_estimate(target_config: dict[str, Any], drafter_config: dict[str, Any] | None = None, *,
                    context_tokens: int, kv_dtype_bytes: int = 2) -> ServerEstimate:
    t = target_weight_bytes(target_config)
    d = drafter_weight_bytes(drafter_config).disk_bytes if drafter_config is not None else None
    kv = kv_cache_bytes(target_config, context_tokens, kv_dtype_bytes)
    total = t.disk_bytes + (d or 0) + kv
    gpus = tuple((size, max(1, math.ceil(total / (size * SERVER_UTILIZATION)))) for size in SERVER_GPUS)
    return ServerEstimate(t.disk_bytes, t.disk_format, d, kv, context_tokens, gpus)


def format_server(est: ServerEstimate | None, name: str, serve_tp: int | None = None) -> list[str]:
    """Why the pair needs a multi-GPU server (the numbers when its config was read), what serves it, and
    how to use it from here."""
    tp = f" --tp {serve_tp}" if serve_tp else ""
    if est is None:
        first = "needs a multi-GPU server (its config.json gives the numbers)"
    else:
        need = " or ".join(f"{n} x {size // GIB} GiB" for size, n in est.gpus)
        drafter = f" + drafter {gib(est.drafter_bytes)}" if est.drafter_bytes is not None else ""
        first = (f"needs a multi-GPU server: weights {gib(est.target_bytes)} as published ({est.target_format})"
                 f"{drafter} + KV cache {gib(est.kv_bytes)} at {est.context_tokens:,} tokens = {gib(est.total)}: "
                 f"at least {need} GPUs")
    return [first,
            f"serve it there: dflash-cli serve-cmd {name} --engine vllm{tp} (or --engine sglang)",
            f"use it from here: dflash-cli chat --engine http://SERVER:8000 -m {name} (generate and bench too)"]


def format_plan(plan: MemoryPlan) -> list[str]:
    """Aligned human-readable lines (GiB, one decimal). Pure strings: the caller prints them."""
    dq = plan.drafter_quant or "-"
    rows = [
        (f"target weights ({plan.quant})", plan.target_weights),
        (f"drafter weights ({dq})" if plan.drafter_estimate else "drafter weights (none)", plan.drafter_weights),
        (f"target KV cache ({plan.context_tokens:,} tokens)", plan.target_kv),
        ("drafter KV cache", plan.drafter_kv),
        (f"activations + margin (block {plan.block_size})", plan.activations),
    ]
    width = max(len(label) for label, _ in rows + [("total", 0)])
    vals = [gib(v) for _, v in rows] + [gib(plan.total), gib(plan.available_bytes)]
    vw = max(len(v) for v in vals)
    lines = [f"{label:<{width}}  {gib(v):>{vw}}" for label, v in rows]
    lines.append(f"{'total':<{width}}  {gib(plan.total):>{vw}}")
    verdict = "fits" if plan.fits else "does not fit"
    lines.append(f"{'available':<{width}}  {gib(plan.available_bytes):>{vw}}  ({verdict})")
    if plan.target_estimate.approximate:
        lines.append("(approximate: " + "; ".join(plan.target_estimate.notes) + ")")
    if not plan.fits and plan.alternatives:
        lines.append("alternatives:")
        lines.extend(f"  - {s}" for s in plan.suggestions)
    return lines
