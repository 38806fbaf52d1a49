"""The CPU linear formats side by side on one model's shapes: ms per call of its whole linear stack (every
decoder layer's q|k|v, o, gate|up and down, and the LM head) at 1..16 rows, each format in the same run.

Random weights of the real shapes (SmolLM2-135M's by default: 30 layers, hidden 576, 9/3 heads of 64,
intermediate 1536, vocabulary 49152); timings are medians over `--repeats` calls of each linear.

    .venv/bin/python benchmarks/cpu_kernels.py                 # about 1 minute on 2 cores
    .venv/bin/python benchmarks/cpu_kernels.py --rows 1 8 16 --formats fp32 q4 q4a8
    .venv/bin/python benchmarks/cpu_kernels.py --formats q4a8 q8a8 --variants   # each kernel build this CPU runs

--variants runs q4a8/q8a8 once per kernel variant this CPU has the instructions for (AVX2's maddubs,
AVX-VNNI, AVX-512 VNNI: engine/cpu/native.py), each built into a temporary folder, side by side; the last
column is a verify of 8 rows against a 1-row decode, the ratio speculation lives on.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

FORMATS = ("fp32", "bf16", "q4", "q8", "q4a8", "q8a8")


def make(fmt: str, weight: torch.Tensor, head: bool) -> nn.Module | None:
    from dflash_cli.engine.cpu.packed import PackedLinear
    from dflash_cli.engine.cpu.weightonly import quantize_linears

    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    if fmt in ("fp32", "bf16"):
        return PackedLinear.pack(lin.to(torch.float32 if fmt == "fp32" else torch.bfloat16))
    # as the fast path does: the LM head stays 8-bit under the 4-bit formats
    kind = {"q4": "q8", "q4a8": "q8a8"}.get(fmt, fmt) if head else fmt
    return quantize_linears([lin], kind)


def per_call(layer: nn.Module, x: torch.Tensor, repeats: int) -> float:
    from dflash_cli.engine.cpu.choice import call_ms

    return call_ms(layer, x, repeats, warmup=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--qkv", type=int, default=960, help="q|k|v outputs (heads + 2 kv heads) x head dim")
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--variants", action="store_true", help="q4a8/q8a8 on every kernel variant this CPU runs")
    args = ap.parse_args()
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from cpu_formats import cpu_line

    torch.manual_seed(0)
    h = args.hidden
    shapes = [(args.qkv, h), (h, h), (2 * args.intermediate, h), (h, args.intermediate)]
    print(f"CPU: {cpu_line()}", flush=True)
    print(f"{args.layers} layers of {shapes} + LM head ({args.vocab}, {h}); ms per call of the whole stack",
          flush=True)
    print()
    print("| format | " + " | ".join(f"{r} rows" for r in args.rows)
          + " | LM head, 1 row | LM head, 8 rows | 8 rows / 1 row |")
    print("|---|" + "---:|" * (len(args.rows) + 3))
    for fmt in args.formats:
        layers = [make(fmt, torch.randn(*s) * 0.02, False) for s in shapes]
        head = make(fmt, torch.randn(args.vocab, h) * 0.02, True)
        if any(m is None for m in layers) or head is None:
            print(f"| {fmt} | not available here |")
            continue
        for label, lib, tiles_from in kernel_builds(fmt, args.variants):
            for m in (*layers, head):
                if lib is not None:
                    m.lib = lib  # type: ignore[union-attr]
            if tiles_from is not None:
                lib.dfq_amx_set_min_rows(tiles_from)  # type: ignore[attr-defined]
            print(f"| {label} | {row(fmt, layers, head, shapes, args)} |", flush=True)


def kernel_builds(fmt: str, variants: bool) -> list[tuple[str, object, int | None]]:
    """(label, library or None for the one loaded, AMX tiles from this many rows or None) for each kernel build
    the format runs on; the AMX build twice: tiles from its default row count, and from 1 row (where tiles
    start to pay is what its default should be)."""
    if not variants or fmt not in ("q4a8", "q8a8"):
        return [(fmt, None, None)]
    import tempfile
    from pathlib import Path

    from dflash_cli.engine.cpu import native

    folder = Path(tempfile.mkdtemp(prefix="dflash-variants-"))
    out: list[tuple[str, object, int | None]] = []
    for variant in native.variants_for(native.cpu_flags()):
        lib = native.build_variant(variant, folder)
        if variant.name != "amx":
            out.append((f"{fmt} ({variant.name})", lib, None))
            continue
        default = lib.dfq_amx_min_rows()
        out += [(f"{fmt} (amx, tiles from {default} rows)", lib, default), (f"{fmt} (amx, tiles from 1 row)", lib, 1)]
    return out


def row(fmt: str, layers: list, head: nn.Module, shapes: list[tuple[int, int]], args: argparse.Namespace) -> str:
    dtype = torch.bfloat16 if fmt in ("bf16", "q4", "q8") else torch.float32
    cells = {}
    for rows in sorted({*args.rows, 1, 8}):
        stack = sum(per_call(m, torch.randn(rows, m_in).to(dtype), args.repeats)
                    for m, (_, m_in) in zip(layers, shapes)) * args.layers
        cells[rows] = stack + per_call(head, torch.randn(rows, args.hidden).to(dtype), args.repeats)
    heads = [per_call(head, torch.randn(r, args.hidden).to(dtype), args.repeats) for r in (1, 8)]
    return (" | ".join(f"{cells[r]:.1f}" for r in args.rows) + f" | {heads[0]:.2f} | {heads[1]:.2f} | "
            f"{cells[8] / cells[1]:.2f}x")

if __name__ == "__main__":
    main()
