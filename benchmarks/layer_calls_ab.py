#!/usr/bin/env python
"""The target's C layers as one call for the whole stack (native/layer.c's dfq_stack_forward, since 2026-12-07)
against one call per layer (what ran before: a Python call, a ctypes call, a fork and join and the buffers'
mallocs per layer), alternating in one process on the demo (q4a8), so a noisy machine's drift falls on both.

    .venv/bin/python benchmarks/layer_calls_ab.py --rounds 20 --position 200

Per round and per mode (the order swaps every round): the mean of 6 calls of a 1-token decode and of an 8-token
verify; prints the medians and the median ratio stack / per layer. Both give the same bits (checked first).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

import dflash_cli
from dflash_cli.engine.cpu import c_layers, native

sys.path.insert(0, str(Path(__file__).parent))
from cpu_formats import cpu_line  # noqa: E402


def per_layer(stack: c_layers.LayerStack, h, positions, cos, signed_sin, keys, values, taps) -> None:
    """LayerStack.run as one C call per layer."""
    one = ctypes.c_void_p * 1
    for i in range(stack.count):
        tap = taps.get(i)
        stack.lib.dfq_stack_forward(ctypes.byref(stack.pointers, i * ctypes.sizeof(ctypes.c_void_p)), 1,
                                    h.data_ptr(), h.shape[1], positions.data_ptr(), cos.data_ptr(),
                                    signed_sin.data_ptr(), one(keys[i].data_ptr()), one(values[i].data_ptr()),
                                    keys[i].shape[2], one(tap.data_ptr()) if tap is not None else None,
                                    tap.stride(1) if tap is not None else 0, int(keys[i].dtype == torch.float16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--position", type=int, default=200, help="tokens cached before the timed calls")
    args = ap.parse_args()
    runtime = dflash_cli.load("demo", quant="q4a8", device="cpu")
    target, at = runtime.target, args.position
    ids = torch.randint(100, 2000, (1, at + 8), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache()
    target.forward(ids[:, :at], cache, 0, last_logit_only=True, taps=True)
    modes = {"per layer": per_layer, "stack": c_layers.LayerStack.run}

    def call(rows: int):
        started = time.perf_counter()
        out = target.forward(ids[:, at:at + rows], cache, at, taps=rows > 1)
        seconds = time.perf_counter() - started
        cache.crop(at)
        return seconds, out

    outputs = {}
    for name, run in modes.items():
        c_layers.LayerStack.run = run  # type: ignore[method-assign]
        outputs[name] = [call(rows)[1] for rows in (1, 8)]
    for (a_logits, a_taps), (b_logits, b_taps) in zip(*outputs.values()):
        assert torch.equal(a_logits, b_logits) and (a_taps is None or torch.equal(a_taps, b_taps))
    times: dict[tuple[str, int], list[float]] = {(name, rows): [] for name in modes for rows in (1, 8)}
    for r in range(args.rounds):
        for name in (list(modes) if r % 2 else list(modes)[::-1]):
            c_layers.LayerStack.run = modes[name]  # type: ignore[method-assign]
            for rows in (1, 8):
                times[name, rows].append(statistics.mean(call(rows)[0] for _ in range(6)))
    c_layers.LayerStack.run = modes["stack"]  # type: ignore[method-assign]
    built = native.loaded()
    print(f"CPU: {cpu_line()}; kernels {built.variant.name if built else '?'}")
    print(f"demo q4a8 at position {at}, {args.rounds} rounds, both modes the same bits")
    print("| call | per layer ms | stack ms | stack / per layer (median of rounds) |")
    print("|---|---:|---:|---:|")
    for rows, what in ((1, "decode"), (8, "verify 8")):
        a, b = times["per layer", rows], times["stack", rows]
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(f"| {what} | {statistics.median(a) * 1e3:.2f} | {statistics.median(b) * 1e3:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
