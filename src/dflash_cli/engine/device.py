"""Device and dtype choice, timing that respects asynchronous GPUs, and peak memory."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash_cli.engine.dtypes import dtype_name
from dflash_cli.sysinfo import system_memory


def pick_device(name: str | None = None) -> torch.device:
    """`name` if given ("cuda", "cuda:1", "cpu", "mps"), else cuda when available, else cpu.

    A device this machine does not have is an InvalidSettingError that lists the ones it has."""
    if not name or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from dflash_cli.engine.errors import InvalidSettingError

    hint = f"devices here: {', '.join(available_devices())} (or auto)"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidSettingError(f"unknown device {name!r}", hint=hint) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if not torch.version.cuda else "no CUDA GPU is visible"
            raise InvalidSettingError(f"device {name!r} is not available: {why}", hint=hint)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InvalidSettingError(f"device {name!r} is not available: there are "
                                      f"{torch.cuda.device_count()} CUDA device(s)", hint=hint)
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise InvalidSettingError(f"device {name!r} is not available on this machine", hint=hint)
    elif device.type != "cpu":
        raise InvalidSettingError(f"device {name!r} is not supported: dflash-cli runs on cuda, mps or cpu",
                                  hint=hint)
    return device


def available_devices() -> list[str]:
    """The --device values this machine can use."""
    found = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if torch.backends.mps.is_available():
        found.append("mps")
    return ["cuda", *found, "cpu"] if found and found[0].startswith("cuda") else [*found, "cpu"]


def cpu_has_fast_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX), where bf16 beats fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_capability() -> str:
    """The vector instruction set torch's CPU kernels dispatch to here: "AVX512", "AVX2", "DEFAULT", ..."""
    return str(torch.backends.cpu.get_cpu_capability())


def cpu_auto_quant(capability: str | None = None, fast_bf16: bool | None = None,
                   native_missing: str | None | bool = False,
                   measure: Callable[[], dict[str, float]] | None = None) -> tuple[str | None, str]:
    """`--quant auto` on a CPU: the fastest lossless target format on this CPU, and why.

    Without native bf16 (most laptops and desktops: AVX2 only), q4a8 on the project's own kernels
    (engine/cpu/int8act.py: 8-bit activations, fp32 around them, whole layers in one C call), 2.5-6x packed fp32
    and torch's q4 on such CPUs (benchmarks/README.md, "CPU formats"). With native bf16 (AVX512-BF16, AMX)
    torch's int4 kernel (q4) is a candidate too, and the faster of the two is measured once on this CPU
    (engine/cpu/choice.py; `measure` stands in for it in tests). Where the kernels cannot be built (no C
    compiler), q4 with native bf16, else packed fp32. `native_missing`: why the kernels cannot be had
    (None: they can; default: asked of engine/cpu/native.py, without compiling)."""
    capability = capability or cpu_capability()
    fast_bf16 = cpu_has_fast_bf16() if fast_bf16 is None else fast_bf16
    if capability not in ("AVX2", "AVX512"):
        return None, f"{capability} CPU: no vectorised 4-bit kernel here, so 16/32-bit packed weights"
    if native_missing is False:
        from dflash_cli.engine.cpu.native import available_without_building

        native_missing = available_without_building()
    if fast_bf16 and native_missing is None:
        from dflash_cli.engine.cpu.choice import describe, fastest, measured_formats

        timings = measured_formats(measure)
        chosen = fastest(timings) or "q4a8"
        return chosen, (f"{capability} CPU with native bf16: {chosen} measured fastest here (a decode and an "
                        f"8-row verify of 4 layers' linears: {describe(timings)})")
    if fast_bf16:
        return "q4", (f"{capability} CPU with native bf16: 4-bit weight-only linears (the q4a8 kernels are not "
                      f"available: {native_missing})")
    if native_missing is None:
        return "q4a8", (f"{capability} CPU without native bf16: 4-bit weights times 8-bit activations on "
                        "this project's kernels decode fastest")
    return None, (f"{capability} CPU without native bf16: packed fp32 (the q4a8 kernels are not available: "
                  f"{native_missing})")


def pick_dtype(name: str | None, device: torch.device, quant: str | None = None) -> torch.dtype:
    """`name` if given, else on a GPU `cuda_dtype(device)` (bf16 from Ampere on, fp16 before), on a CPU bf16
    where it computes bf16 natively and fp32 elsewhere; with a weight-only `quant` (q4/q8) bf16 on every CPU:
    their kernels read bf16 activations, and only bf16 activations keep speculative decoding of such a
    target exact (fp32 ones are rounded to bf16 at every linear, where a decode's and a verify's ~1e-7
    differences become different values); with q4a8/q8a8 (8-bit activations, engine/cpu/int8act.py) fp32, what
    their kernels read."""
    if name and name != "auto":
        known = dtype_name(name)
        if known is None:
            from dflash_cli.engine.errors import InvalidSettingError

            raise InvalidSettingError(f"unknown dtype {name!r}", hint="use float32, bfloat16 or float16")
        return getattr(torch, known)
    if device.type == "cuda":
        return cuda_dtype(device)
    if quant in ("q4", "q8"):
        return torch.bfloat16
    if quant in ("q4a8", "q8a8"):
        return torch.float32
    if device.type == "cpu" and cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def cuda_dtype(device: torch.device) -> torch.dtype:
    """The default compute dtype of a CUDA device: bf16 from compute capability 8.0 (Ampere) on, fp16 before.

    Before Ampere bf16 has no tensor-core matmuls (torch emulates them) and inductor spends minutes on a
    bf16 compile that then falls back. (fp16's smaller range can overflow in models trained in bf16;
    --dtype float32 is the way out there.) Without a usable CUDA runtime, bf16 as before."""
    if not torch.cuda.is_available():
        return torch.bfloat16
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Times a span of GPU work without forcing a sync: CUDA events on GPUs, perf_counter elsewhere.

    The events are recorded on the current stream of `device` itself (with --device cuda:1 the current
    device may be another GPU, whose stream sees none of the work). `seconds` may be read only after
    something else synchronised (the step's one `.tolist()`).
    """

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._device = device
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> Stopwatch:
        if self._cuda:
            self._start.record(torch.cuda.current_stream(self._device))
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self) -> None:
        if self._cuda:
            self._end.record(torch.cuda.current_stream(self._device))
        else:
            self._t1 = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1000.0
        return self._t1 - self._t0


@dataclass(frozen=True)
class MemoryReading:
    peak_bytes: int | None
    kind: str  # "cuda allocated" or "process RSS"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> MemoryReading:
    """Peak GPU memory allocated by torch on CUDA; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return MemoryReading(torch.cuda.max_memory_allocated(device), "cuda allocated")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return MemoryReading(rss if sys.platform == "darwin" else rss * 1024, "process RSS")


def free_memory(device: torch.device) -> int | None:
    """Bytes free for a model on `device`: free GPU memory, or the system's available memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return system_memory()[1]
