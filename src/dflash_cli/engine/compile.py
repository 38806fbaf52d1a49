"""How the fast path compiles its short forwards: torch.compile settings per device, and the on-disk cache.

CUDA: `mode="reduce-overhead"` captures each (block length, key-window) shape as a CUDA graph, which removes
the per-operation launch cost that dominates a batch-1 decode. CPU: inductor without freezing, so the FX and
inductor caches on disk make a second process start quickly (frozen weights are folded into the graph,
which defeats the cache). See docs/engine.md, "The fast path", for what each choice measured.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

COMPILE_CHOICES = ("auto", "on", "off")


def use_compile_cache(folder: Path) -> None:
    """Keeps inductor's and the FX graph caches under `folder` (unless the user already set them)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(folder / "triton"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")


def compiler_for(device: torch.device) -> Callable[[nn.Module], Callable[..., Any]]:
    """A function that compiles a StaticForward for `device` (lazily: the work happens on the first call)."""
    import torch._dynamo

    # One code object serves every (taps, padded length) variant; each is a recompile, not a failure.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.cache_size_limit = max(getattr(torch._dynamo.config, "cache_size_limit", 0), 64)
    if device.type == "cuda":
        def compile_cuda(module: nn.Module):
            return torch.compile(module, mode="reduce-overhead", fullgraph=True, dynamic=False)
        return compile_cuda

    def compile_cpu(module: nn.Module):
        return torch.compile(module, fullgraph=True, dynamic=False)
    return compile_cpu


def resolve_compile(choice: str, device: torch.device, *, quant: str | None = None) -> tuple[bool, str]:
    """Whether to compile the fast path's short forwards, and why (shown by --verbose and doctor).

    `auto` compiles on CUDA (CUDA graphs remove the launch overhead that dominates batch-1 decoding) and
    not on CPUs, where the eager fast path with packed weights measured faster than inductor's output,
    which also cost minutes of compilation (benchmarks/README.md). `quant` is the target's bitsandbytes
    format: nf4 layers are traced whole (bitsandbytes' 4-bit ops are registered with torch.compile) from
    torch 2.8; LLM.int8() (int8) checks its activations for outliers on the host in every linear, which
    a CUDA graph cannot capture, so it stays eager.
    """
    if choice not in COMPILE_CHOICES:
        from dflash_cli.engine.errors import InvalidSettingError

        raise InvalidSettingError(f"unknown compile setting {choice!r}", hint="use auto, on or off")
    if choice == "off":
        return False, "compile off"
    if choice == "on":
        return True, "compile on"
    if device.type != "cuda":
        return False, "auto: not compiled on CPU, where it measured slower"
    if quant == "int8":
        return False, "auto: int8 (LLM.int8()) syncs with the host in every linear; CUDA graphs cannot capture it"
    if quant == "nf4" and torch_version() < (2, 8):
        return False, f"auto: nf4 layers compile from torch 2.8 (this is {torch.__version__})"
    return True, "auto: CUDA graphs" + (" (nf4 layers included)" if quant == "nf4" else "")


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
