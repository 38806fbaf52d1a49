"""What actually runs on a device, in words for --verbose, /show info and doctor: the attention kernel torch
selects for a call shaped like the fast path's, and whether CUDA graphs were recorded or skipped (inductor
skips a graph with only a log line, and the run is then slow without an error)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

ROW_EXACT = "row-exact matmuls for decodes and verifies (q4/q8 on a CPU), torch's fused kernel for prompts"
NATIVE_ATTENTION = ("row-exact fp32 attention in C for decodes and verifies (q4a8/q8a8; "
                    "engine/cpu/native/attention.c), torch's fused kernel for long prompts of layers not run in C")


def attention_kernel(device: torch.device, dtype: torch.dtype, *, heads: int, kv_heads: int, head_dim: int,
                     row_exact: bool = False) -> str:
    """The kernel torch's scaled_dot_product_attention picks for the fast path's masked call: a block of 16
    queries, each key/value head's group of query heads folded into its rows, over a 256-key window."""
    if row_exact:
        return ROW_EXACT
    if device.type != "cuda":
        return f"torch's fused {device.type} kernel"
    try:
        from torch.backends import cuda as backends

        group, rows, keys = heads // kv_heads, 16, 256
        q = torch.zeros(1, kv_heads, group * rows, head_dim, device=device, dtype=dtype)
        k = torch.zeros(1, kv_heads, keys, head_dim, device=device, dtype=dtype)
        mask = torch.ones(1, 1, group * rows, keys, device=device, dtype=torch.bool)
        params = backends.SDPAParams(q, k, k, mask, 0.0, False, False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, enabled, accepts in _fused_backends():
                check = getattr(backends, accepts, None)
                if enabled() and check is not None and check(params, False):
                    return f"{name} (fused)"
    except Exception as error:  # a report, not a reason to fail
        return f"unknown ({type(error).__name__}: {error})"[:120]
    return "math (no fused kernel accepts the call: scores in fp32; TORCH_LOGS or debug=True says why)"


def _fused_backends() -> list[tuple[str, Any, str]]:
    """(name, is it enabled, torch's acceptance check) per fused backend, in torch's priority order."""
    from torch.backends import cuda as backends

    known = {1: ("flash", backends.flash_sdp_enabled, "can_use_flash_attention"),
             2: ("memory-efficient", backends.mem_efficient_sdp_enabled, "can_use_efficient_attention"),
             3: ("cuDNN", getattr(backends, "cudnn_sdp_enabled", lambda: False), "can_use_cudnn_attention")}
    try:  # SDPBackend values: 0 math, 1 flash, 2 efficient, 3 cuDNN
        order = [int(b) for b in torch._C._get_sdp_priority_order()]
    except Exception:  # torch's default before it exposed the order
        order = [1, 2, 0, 3]
    return [known[b] for b in order if b in known]


def cuda_graphs(device: torch.device) -> str | None:
    """How many CUDA graphs inductor recorded on `device` and how many compiled graphs it ran without one
    (None off CUDA). A skip means every launch goes through the host again: decoding crawls."""
    if device.type != "cuda":
        return None
    from torch._dynamo.utils import counters

    skipped = int(counters["inductor"]["cudagraph_skips"])
    recorded: int | str
    try:
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(device.index or 0, create_if_none_exists=False)
        nodes = [n for roots in (manager.roots.values() if manager is not None else ()) for n in roots]
        recorded = 0
        while nodes:
            node = nodes.pop()
            recorded += 1
            nodes.extend(child for children in node.children.values() for child in children)
    except Exception:  # inductor's internals differ between releases
        recorded = "unknown"
    text = f"{recorded} recorded, {skipped} skipped"
    return text + (" (TORCH_LOGS=cudagraphs says why)" if skipped else "")
