"""Which lossless 4-bit format `--quant auto` runs on this CPU, measured where more than one can run.

q4a8 (this project's C kernels, 8-bit activations) and q4 (torch's int4 kernel, bf16 activations) both run
on a CPU that computes bf16 natively; which is faster depends on the CPU, and a rule by flags picked the
slower one by 3x on an AMX Xeon (benchmarks/README.md). So on such a CPU both run a small stack of a
decoder's linears once, a 1-row decode and an 8-row verify each, and the faster pair of calls wins. The
result is kept in the cache folder under a key of the CPU, torch's version and the kernels' source, so the
measurement (about a second) happens once per machine; `doctor` prints it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

CANDIDATES = ("q4a8", "q4")
# one Llama-style layer's linears at a small model's width (SmolLM2-135M: q|k|v, o, gate|up, down)
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 4
ROWS = (1, 8)


def call_ms(layer: nn.Module, x: torch.Tensor, repeats: int, warmup: int = 1) -> float:
    """Median ms of `layer(x)` over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        layer(x)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def measure_formats(repeats: int = 5) -> dict[str, float]:
    """ms of a decode plus an 8-row verify through LAYERS layers of SHAPES, per candidate format."""
    from dflash_cli.engine.cpu.weightonly import quantize_linears

    generator = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for kind in CANDIDATES:
        dtype = torch.float32 if kind == "q4a8" else torch.bfloat16
        total = 0.0
        for n, k in SHAPES:
            linear = nn.Linear(k, n, bias=False)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(n, k, generator=generator) * 0.02)
            layer = quantize_linears([linear], kind)
            if layer is None:
                break
            total += sum(call_ms(layer, torch.randn(rows, k, generator=generator).to(dtype), repeats)
                         for rows in ROWS)
        else:
            out[kind] = total * LAYERS
    return out


def _key() -> str:
    from dflash_cli.engine.cpu import native

    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(platform.processor().encode())
    digest.update(" ".join(sorted(native.cpu_flags())).encode())
    for path in native.source_files():
        digest.update(path.name.encode() + path.read_bytes())
    try:
        digest.update(native.chosen_variant()[0].name.encode())  # DFLASH_KERNELS changes the timings
    except ValueError:
        pass
    return digest.hexdigest()[:16]


def measurement_file() -> Path:
    from dflash_cli.engine.cpu import native

    return native.cache_folder() / f"formats-{_key()}.json"


def measured_formats(measure: Callable[[], dict[str, float]] | None = None) -> dict[str, float]:
    """The candidates' timings on this CPU: read from the cache folder, or measured now and kept there (a
    cache that cannot be written only means measuring again next time)."""
    path = measurement_file()
    try:
        kept = json.loads(path.read_text())
        if isinstance(kept, dict) and kept and all(isinstance(v, (int, float)) for v in kept.values()):
            return {str(k): float(v) for k, v in kept.items()}
    except (OSError, ValueError):
        pass
    timings = (measure or measure_formats)()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(timings))
        partial.replace(path)
    except OSError:
        pass
    return timings


def fastest(timings: dict[str, float]) -> str | None:
    return min(timings, key=lambda k: timings[k]) if timings else None


def describe(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(timings.items(), key=lambda kv: kv[1]))
