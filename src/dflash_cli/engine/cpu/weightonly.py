"""Weight-only 4-bit and 8-bit linears (`--quant q4` / `q8`), run by PyTorch's own kernels.

q4: groups of 32 input channels, each with a scale and a zero (asymmetric, the layout of GGUF's Q4_1: a
block of 32 weights w = d*q + m with 4-bit codes q), run by `aten._weight_int4pack_mm_for_cpu`, which
reconstructs w = (q - 8) * scale + zero, so scale = d and zero = m + 8*d. q8: one symmetric scale per
output channel, run by `aten._weight_int8pack_mm`. Both kernels read bf16 activations (fp32 activations run
20x slower), so activations are cast to bf16 at the call and the output back to the caller's dtype. Each
output row is computed on its own: a 1-row decode and a block verify give bit-identical rows, which keeps
greedy speculative decoding equal to greedy plain decoding of the same quantized target.

Quantizing is done once at load and takes about a second per billion weights; bitsandbytes (nf4/int8,
engine/quant.py) stays the GPU choice.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_cli.engine.cpu.int8act import Q4A8Linear, Q8A8Linear, a8_fits, quantize_q4_1
from dflash_cli.engine.cpu.quantized import GROUP, Q4Codes, WeightOnlyLinear, sizes_and_bias

WEIGHT_QUANTS = ("q4", "q8", "q4a8", "q8a8")  # q4a8/q8a8: 8-bit activations (engine/cpu/int8act.py)
# a target folder may carry its linears' 4-bit codes (the built-in model: the GGUF's own Q4_1 blocks), as
# "<module name>.codes" (uint8 (out, in/2), two codes per byte, the low nibble first), ".d" and ".m"
# (fp16 (out, in/32)) with w = d * code + m
Q4_CODES_FILE = "q4_1-codes.safetensors"


def quantize_q4(weight: torch.Tensor, group: int = GROUP) -> Q4Codes:
    """Min/max 4-bit quantization per group (as Q4_1), the codes chosen against the bf16-rounded scale and
    zero the kernel will use."""
    out, cols = weight.shape
    w = weight.detach().float().reshape(out, cols // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).to(torch.bfloat16).float()
    # a constant group: any scale reproduces it through zero; |low| / 8 keeps zero exact (0 or 2 * low)
    flat = (low.abs() / 8).clamp(min=2**-60).to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, flat)
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    codes = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.int32)
    return Q4Codes(codes.reshape(out, cols), scale, zero, group)


class Q4Linear(WeightOnlyLinear):
    def __init__(self, codes: Q4Codes, sizes: list[int], bias: torch.Tensor | None):
        super().__init__(sizes, bias)
        self.group = codes.group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.contiguous(), 1)
        # (in/G, out, 2): the kernel's layout of (scale, zero) per group
        self.scales_and_zeros = torch.stack([codes.scale, codes.zero], dim=-1).transpose(0, 1).to(
            torch.bfloat16).contiguous()

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)


class Q8Linear(WeightOnlyLinear):
    def __init__(self, weight: torch.Tensor, sizes: list[int], bias: torch.Tensor | None):
        super().__init__(sizes, bias)
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).to(torch.bfloat16).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.weight_int8 = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scale.to(torch.bfloat16)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)


def q4_fits(rows: int, cols: int) -> bool:
    """Whether q4 takes an (out=rows, in=cols) weight: whole groups of 32 inputs, and outputs in the kernel's
    packs of 16."""
    return cols % GROUP == 0 and rows % 16 == 0


def quantize_weight(weight: torch.Tensor, kind: str, sizes: list[int] | None = None,
                    bias: torch.Tensor | None = None, *,
                    codes: list[Q4Codes | None] | None = None) -> WeightOnlyLinear | None:
    """An (out, in) weight as one q4/q8 layer: the rows of `sizes` linears stacked (all of it as one linear
    by default; a mixture of experts' gate|up, engine/moe.py), None when q4 cannot take its shape. `codes`:
    ready 4-bit codes per part of `sizes` (a GGUF's own), used instead of quantizing those rows."""
    sizes = sizes or [int(weight.shape[0])]
    with torch.no_grad():
        if kind in ("q4a8", "q8a8"):
            return _quantize_a8(weight, kind, sizes, bias, codes)
        if kind == "q4":
            if not q4_fits(int(weight.shape[0]), int(weight.shape[1])):
                return None
            given = codes or [None] * len(sizes)
            parts = [c if c is not None else quantize_q4(w) for w, c in zip(weight.split(sizes), given)]
            fused = Q4Codes(torch.cat([p.codes for p in parts]), torch.cat([p.scale.float() for p in parts]),
                            torch.cat([p.zero.float() for p in parts]))
            return Q4Linear(fused, sizes, bias)
        if kind == "q8":
            return Q8Linear(weight, sizes, bias)
    raise ValueError(f"unknown weight-only quantization {kind!r}")


def _quantize_a8(weight: torch.Tensor, kind: str, sizes: list[int], bias: torch.Tensor | None,
                 codes: list[Q4Codes | None] | None) -> WeightOnlyLinear | None:

    if not a8_fits(int(weight.shape[0]), int(weight.shape[1]), kind):
        return None
    if kind == "q8a8":
        return Q8A8Linear(weight, sizes, bias)
    given = codes or [None] * len(sizes)
    parts = [c if c is not None else quantize_q4_1(w) for w, c in zip(weight.split(sizes), given)]
    mins = [p.mins.float() if p.mins is not None else p.zero.float() - 8 * p.scale.float() for p in parts]
    fused = Q4Codes(torch.cat([p.codes for p in parts]), torch.cat([p.scale.float() for p in parts]),
                    torch.cat([p.zero.float() for p in parts]), mins=torch.cat(mins))
    return Q4A8Linear(fused, sizes, bias)


def quantize_linears(linears: list[nn.Module], kind: str, *, codes: list[Q4Codes | None] | None = None,
                     keep_source: bool = False) -> WeightOnlyLinear | None:
    """`linears` (sharing an input) as one q4/q8 layer; None when they cannot be (not plain Linears, not on
    a CPU, or q4 with in_features not a multiple of 32 or out_features not of 16). `codes`: ready 4-bit
    codes per linear (a GGUF's own), used instead of quantizing that linear's weight."""
    if any(type(m) is not nn.Linear for m in linears):
        return None
    plain = [m for m in linears if isinstance(m, nn.Linear)]
    if any(m.weight.device.type != "cpu" for m in plain):
        return None
    with_bias = [m.bias is not None for m in plain]
    if any(with_bias) and not all(with_bias):
        return None
    sizes, bias = sizes_and_bias(plain)
    weight = torch.cat([m.weight.detach() for m in plain]) if len(plain) > 1 else plain[0].weight.detach()
    layer = quantize_weight(weight, kind, sizes, bias, codes=codes)
    if layer is not None and keep_source and len(plain) == 1:
        layer.source = plain[0].weight.detach()
    return layer


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(out, in) codes 0..15 as uint8 (out, in/2), the even column in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.int32)
    out[:, 0::2] = (packed & 0xF).to(torch.int32)
    out[:, 1::2] = (packed >> 4).to(torch.int32)
    return out


def write_q4_codes(path, codes: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Writes Q4_1 codes per module name: (codes int (out, in), d, m (out, in/32)) as Q4_CODES_FILE."""
    from dflash_cli.engine.files import save_tensors

    tensors: dict[str, torch.Tensor] = {}
    for name, (q, d, m) in codes.items():
        tensors[f"{name}.codes"] = pack_nibbles(q).contiguous()
        tensors[f"{name}.d"] = d.to(torch.float16).contiguous()
        tensors[f"{name}.m"] = m.to(torch.float16).contiguous()
    save_tensors(tensors, path, metadata={"format": "q4_1 codes: w = d * code + m, groups of 32"})


def read_q4_codes(path) -> dict[str, Q4Codes]:
    """Q4_CODES_FILE as Q4Codes per module name; a damaged file is a CheckpointError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dflash_cli.engine.errors import CheckpointError

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})",
                              hint="delete it to quantize the weights at load instead") from None
    out: dict[str, Q4Codes] = {}
    for key in tensors:
        if not key.endswith(".codes"):
            continue
        name = key.removesuffix(".codes")
        packed, d, m = tensors[key], tensors.get(f"{name}.d"), tensors.get(f"{name}.m")
        rows, cols = packed.shape[0], packed.shape[-1] * 2 if packed.dim() == 2 else -1
        groups = (rows, cols // GROUP)
        if (packed.dtype != torch.uint8 or packed.dim() != 2 or d is None or m is None
                or tuple(d.shape) != groups or tuple(m.shape) != groups or cols % GROUP):
            raise CheckpointError(f"{path}: the 4-bit codes of {name!r} are damaged (shapes or dtypes)",
                                  hint="delete the file to quantize the weights at load instead")
        out[name] = Q4Codes.from_q4_1(unpack_nibbles(packed), d, m)
    return out
