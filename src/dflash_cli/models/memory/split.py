"""Per-device memory plans: which decoder layers of a target go on which device (`--device-map`).

Pure arithmetic on `config.json` dicts, like models/memory/plan.py, so `show` and the preflight plan a split
before any weights load; the loader then places the layers exactly as planned (engine/load.py hands
the per-layer devices to transformers/accelerate as an explicit device map).

The hot device is the first one (the first GPU, else the CPU). It holds everything a decoding step
touches outside the decoder layers: the embeddings, the final norm, the LM head, the drafter and its
cache, the logits and the prefill working set (models/memory/sizes.py's activation rule). Every other device
holds a contiguous run of decoder layers, their KV cache, 10% of their weights as margin, and on a GPU
the 0.5 GiB CUDA context. Layers are averaged: per-layer weight and KV bytes are the model's totals
divided by its layer count (exact for uniform models, close for hybrids).

Offload, the last resort: layers placed on "cpu" while the hot device is a GPU, or on "disk", keep their
weights there and run on the hot device (accelerate copies them in for every forward: slow), so their KV
cache is on the hot device. Disk is unbounded.

Strategies (accelerate's names): `sequential` fills each device before the next; `balanced` (and `auto`)
spreads the layers over the compute devices (the GPUs, else the CPU) so that the fullest one is as
empty as possible; both spill to offload devices only when the compute devices are full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_cli.engine.hf_config import DEVICE_MAP_STRATEGIES, drafter_block_size, text_config
from dflash_cli.models.memory.params import prequantized
from dflash_cli.models.memory.sizes import (
    AUTO_ORDER,
    CUDA_CONTEXT_BYTES,
    WEIGHT_MARGIN,
    activation_bytes,
    drafter_kv_cache_bytes,
    drafter_weight_bytes,
    kv_cache_bytes,
    normalize_quant,
    target_weight_bytes,
)
from dflash_cli.units import fmt_bytes

STRATEGIES = DEVICE_MAP_STRATEGIES


def is_gpu(device: str) -> bool:
    """An accelerator (cuda:N, mps): where layers compute and offloaded layers are copied to."""
    return device not in ("cpu", "disk")


def _context(device: str) -> int:
    return CUDA_CONTEXT_BYTES if device.startswith("cuda") else 0


@dataclass(frozen=True)
class DeviceShare:
    """What one device holds under a split plan (bytes)."""

    device: str  # "cuda:0", "cpu", "disk", ...
    available: int | None  # None: unbounded (disk)
    first_layer: int
    layers: int
    weights: int  # this device's decoder-layer weights (+ the hot device's embeddings, head, drafter)
    kv: int  # KV caches held here (an offloaded layer's live on the hot device)
    working: int  # activations, margin, CUDA context
    offload: bool  # layers here run elsewhere (accelerate copies their weights in per forward)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.working

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available


@dataclass(frozen=True)
class SplitPlan:
    strategy: str
    quant: str
    context_tokens: int
    num_layers: int
    shares: tuple[DeviceShare, ...]

    @property
    def placed(self) -> int:
        return sum(s.layers for s in self.shares)

    @property
    def fits(self) -> bool:
        return self.placed == self.num_layers and all(s.fits for s in self.shares)

    @property
    def offloaded_layers(self) -> int:
        return sum(s.layers for s in self.shares if s.offload)

    def layer_devices(self) -> list[str]:
        """The device of every decoder layer, in order (what the loader places)."""
        out: list[str] = []
        for share in self.shares:
            out += [share.device] * share.layers
        return out

    @property
    def problem(self) -> str | None:
        """Why the plan does not fit, in words (None when it fits)."""
        over = next((s for s in self.shares if not s.fits), None)
        if over is not None and over.available is not None:
            return f"{over.device} would hold {fmt_bytes(over.total)} of {fmt_bytes(over.available)}"
        if self.placed < self.num_layers:
            return f"only {self.placed} of {self.num_layers} layers fit"
        return None

    @property
    def summary(self) -> str:
        """'cuda:0 18 layers, cuda:1 18 layers' (+ ', offloaded: slow' when some layers are)."""
        parts = [f"{s.device} {s.layers} layer{'s' if s.layers != 1 else ''}" for s in self.shares if s.layers]
        text = ", ".join(parts) or "no layers placed"
        return text + (" (offloaded layers: slow)" if self.offloaded_layers else "")


def _costs(target_config, drafter_config, quant, drafter_quant, context_tokens, block_size, kv_dtype_bytes,
           mxfp4_packed=False):
    """(per-layer weight bytes, per-layer KV bytes, the hot device's own (weights, KV, working) bytes,
    number of layers)."""
    t = target_weight_bytes(target_config, quant, mxfp4_packed=mxfp4_packed)
    n = int(text_config(target_config)["num_hidden_layers"])
    hidden = int(text_config(target_config)["hidden_size"])
    plain = 4 if quant == "fp32" else 2
    final_norm = hidden * plain
    layer_w = (t.layers_linear + t.experts + t.norms_other - final_norm) / n
    rows = context_tokens + block_size  # a verified block sits in the cache until it is cropped
    layer_kv = kv_cache_bytes(target_config, rows, kv_dtype_bytes) / n
    weights, kv = t.embeddings + t.lm_head + final_norm, 0
    if drafter_config is not None:
        weights += drafter_weight_bytes(drafter_config, drafter_quant).total
        kv = drafter_kv_cache_bytes(drafter_config, rows, kv_dtype_bytes)
    parts = activation_bytes(target_config, drafter_config, context_tokens=context_tokens, block_size=block_size,
                             weight_bytes=weights)
    working = parts["logits"] + parts["prefill"] + parts["margin"]  # the CUDA context is per GPU, added below
    return layer_w, layer_kv, (weights, kv, working), n


def plan_split(target_config: dict[str, Any], drafter_config: dict[str, Any] | None = None, *,
               devices: list[tuple[str, int | None]], strategy: str = "auto", quant: str = "bf16",
               context_tokens: int, block_size: int | None = None, drafter_quant: str | None = None,
               kv_dtype_bytes: int = 2, mxfp4_packed: bool = False) -> SplitPlan:
    """Places the target's decoder layers on `devices` [(name, available bytes or None)], hot device first.

    GPUs come first in `devices`, then "cpu", then "disk" (engine/placement.py orders them so).
    `mxfp4_packed`: an MXFP4 target's experts stay packed (models/memory/preflight.mxfp4_kept).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown device map strategy {strategy!r}: use {', '.join(STRATEGIES)}")
    if not devices:
        raise ValueError("no devices to plan for")
    quant = normalize_quant(quant)
    if block_size is None:
        block_size = drafter_block_size(drafter_config) if drafter_config is not None else 1
    layer_w, layer_kv, hot_own, n = _costs(target_config, drafter_config, quant, drafter_quant, context_tokens,
                                             block_size, kv_dtype_bytes, mxfp4_packed)
    hot = devices[0][0]
    gpu_hot = is_gpu(hot)
    compute = [i for i, (name, _) in enumerate(devices) if name == hot or (is_gpu(name) if gpu_hot else name == "cpu")]
    fixed = [(sum(hot_own) if i == 0 else 0) + _context(name)
             for i, (name, _) in enumerate(devices)]
    per_layer = layer_w * (1 + WEIGHT_MARGIN) + layer_kv  # on a compute device

    def room(i: int, limit: float | None = None) -> int:
        """Layers that fit on compute device i (under `limit` total bytes, if given)."""
        avail = devices[i][1]
        cap = float("inf") if avail is None else avail
        if limit is not None:
            cap = min(cap, limit)
        return max(0, int((cap - fixed[i]) // per_layer)) if per_layer else n

    def place() -> list[int]:
        counts = [0] * len(devices)
        left = n
        if strategy in ("auto", "balanced") and len(compute) > 1 and sum(room(i) for i in compute) >= n:
            # the smallest per-device load under which the compute devices still take every layer
            lo, hi = 0, max(fixed[i] + n * per_layer for i in compute)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if sum(room(i, mid) for i in compute) >= n else (mid, hi)
            limit: float | None = hi
        else:
            limit = None
        for i in compute:
            counts[i] = min(room(i, limit), left)
            left -= counts[i]
        for i in offload:  # the last resort, in order
            avail = devices[i][1]
            counts[i] = left if avail is None or not layer_w else min(left, int(avail // layer_w))
            left -= counts[i]
        return counts

    # offloaded layers run on the hot device: their KV caches and one layer's weights in transit live
    # there, which leaves less room for layers of its own, which may offload more: repeat until stable
    offload = [i for i in range(len(devices)) if i not in compute]
    hot_base = fixed[0]
    counts = place()
    for _ in range(n + 1):
        spilled = sum(counts[i] for i in offload)
        reserve = int(spilled * layer_kv + layer_w) if spilled else 0
        if fixed[0] == hot_base + reserve:
            break
        fixed[0] = hot_base + reserve
        counts = place()
    shares, first = [], 0
    spilled = sum(counts[i] for i in offload)
    for i, (name, avail) in enumerate(devices):
        off = i in offload
        own = hot_own if i == 0 else (0, 0, 0)
        weights = (0 if name == "disk" else counts[i] * layer_w) + own[0]
        kv = (0 if off else counts[i] * layer_kv) + own[1] + (spilled * layer_kv if i == 0 else 0)
        working = (0 if off else counts[i] * layer_w * WEIGHT_MARGIN) + own[2]
        working += _context(name) + (int(layer_w) if i == 0 and spilled else 0)
        shares.append(DeviceShare(name, avail, first, counts[i], int(weights), int(kv), int(working), off))
        first += counts[i]
    return SplitPlan("balanced" if strategy == "auto" else strategy, quant, context_tokens, n, tuple(shares))


def choose_split_quant(target_config: dict[str, Any], drafter_config: dict[str, Any] | None = None, *,
                       devices: list[tuple[str, int | None]], strategy: str = "auto", context_tokens: int,
                       block_size: int | None = None, drafter_quant: str | None = None,
                       kv_dtype_bytes: int = 2, mxfp4_packed: bool = False) -> str | None:
    """`--quant auto` with a device map: splitting comes before quantizing harder, offload comes last.

    The best of bf16, int8, nf4 whose split fits on the compute devices alone (the GPUs, else the CPU);
    else the best that fits with layers offloaded to cpu/disk; None if nothing fits. A checkpoint
    published quantized (MXFP4, fp8) is planned as it is: transformers refuses bitsandbytes on top of it.
    """
    order = AUTO_ORDER if prequantized(target_config) is None else AUTO_ORDER[:1]
    plans = [plan_split(target_config, drafter_config, devices=devices, strategy=strategy, quant=q,
                        context_tokens=context_tokens, block_size=block_size, drafter_quant=drafter_quant,
                        kv_dtype_bytes=kv_dtype_bytes, mxfp4_packed=mxfp4_packed) for q in order]
    for plan in plans:
        if plan.fits and not plan.offloaded_layers:
            return plan.quant
    return next((p.quant for p in plans if p.fits), None)


def format_split(plan: SplitPlan) -> list[str]:
    """One aligned line per device (layers, weights, KV, working, total / available). Pure strings."""
    rows = []
    for s in plan.shares:
        layers = f"layers {s.first_layer}-{s.first_layer + s.layers - 1}" if s.layers else "no layers"
        avail = "unbounded" if s.available is None else fmt_bytes(s.available)
        role = " (hot: embeddings, LM head, drafter)" if s is plan.shares[0] else ""
        role += " (offload: slow)" if s.offload and s.layers else ""
        verdict = "" if s.fits else "  over"
        rows.append(f"{s.device:<8}{layers:<15}weights {fmt_bytes(s.weights):>9}  KV {fmt_bytes(s.kv):>9}  "
                    f"working {fmt_bytes(s.working):>9}  total {fmt_bytes(s.total):>9} / {avail}{verdict}{role}")
    if plan.placed < plan.num_layers:
        rows.append(f"{plan.num_layers - plan.placed} of {plan.num_layers} layers fit nowhere")
    rows.append(f"{plan.strategy} split in {plan.quant}: " + ("fits" if plan.fits else "does not fit"))
    return rows


def split_hint(hybrid: bool) -> str:
    """What to try when a split does not fit; hybrid (linear-attention) targets cannot offload to disk."""
    if hybrid:
        return "raise --max-memory on the GPUs, lower --max-context, or use --quant nf4"
    return "raise --max-memory, add disk to it, lower --max-context, or use --quant nf4"
