"""4-bit and 8-bit weights times 8-bit activations (`--quant q4a8` / `q8a8`), on the project's own AVX2
kernels (engine/native/int8_matmul.c): what llama.cpp computes on a CPU (Q4_1 or Q8_0 weights, activations
quantized per row in blocks of 32 as Q8_1, integer dot products, fp32 sums).

torch's int4 kernel (`--quant q4`) reads bf16 activations, which a CPU without native bf16 converts in
software, and the small ops around it then run in bf16 too; here activations and everything around the
linears stay fp32, and each linear quantizes its input rows itself. Each output row depends on its own
input row only, so a 1-token decode and a block verify give bit-identical rows (the lossless rule), as with
q4/q8. q4a8 keeps GGUF Q4_1's d and m exactly (w = d * code + m); q8a8 has one scale per block of 32
(GGUF's Q8_0), also for q4a8's LM head.
"""

from __future__ import annotations

import torch

from dflash_cli.engine import native
from dflash_cli.engine.weightonly import GROUP, Q4Codes, WeightOnlyLinear

INT8_ACT_QUANTS = ("q4a8", "q8a8")


def q4_1_parts(codes: Q4Codes) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, m) fp32 of w = d * code + m for `codes` (its own m where it came from a GGUF's Q4_1)."""
    d = codes.scale.float()
    m = codes.mins.float() if codes.mins is not None else codes.zero.float() - 8 * d
    return d.contiguous(), m.contiguous()


def pack_blocks(codes: torch.Tensor) -> torch.Tensor:
    """(out, in) codes 0..15 as the kernel's (out, in/2) bytes: per block of 32, byte j holds code j in its
    low nibble and code j + 16 in its high one (GGUF's Q4_1 order)."""
    out, cols = codes.shape
    c = codes.to(torch.uint8).reshape(out, cols // GROUP, GROUP)
    return (c[..., :16] | (c[..., 16:] << 4)).reshape(out, cols // 2).contiguous()


def quantize_q4_1(weight: torch.Tensor) -> Q4Codes:
    """Min/max 4-bit quantization per block of 32 in GGUF Q4_1's form (fp32 d and m, as its fp16 ones but
    unrounded)."""
    out, cols = weight.shape
    w = weight.detach().float().reshape(out, cols // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    d = (high - low) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round((w - low[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.int32)
    return Q4Codes(codes.reshape(out, cols), d, low + 8 * d, GROUP, mins=low)


def _need_library() -> native.Built:
    built = native.library()
    if built is None:
        raise RuntimeError(f"--quant q4a8/q8a8 need this project's AVX2 kernels: {native.unavailable()}")
    return built


class Int8ActLinear(WeightOnlyLinear):
    """Base of Q4A8Linear/Q8A8Linear: fp32 in, fp32 out (other dtypes are cast at the call)."""

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = self.matmul(rows)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


class Q4A8Linear(Int8ActLinear):
    def __init__(self, codes: Q4Codes, sizes: list[int], bias: torch.Tensor | None):
        super().__init__(sizes, bias)
        self.lib = _need_library().lib
        self.in_features = int(codes.codes.shape[1])
        self.codes = pack_blocks(codes.codes)
        self.d, self.m = q4_1_parts(codes)
        self.bias = bias.float().contiguous() if bias is not None else None

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], self.out_features)
        self.lib.dfq_q4_matmul(rows.data_ptr(), rows.shape[0], self.in_features, self.codes.data_ptr(),
                               self.d.data_ptr(), self.m.data_ptr(), self.out_features, native.ptr(self.bias),
                               out.data_ptr())
        return out

    def dequantize(self) -> torch.Tensor:
        out, half = self.codes.shape
        c = self.codes.reshape(out, half // 16, 16)
        codes = torch.cat([c & 0xF, c >> 4], dim=-1).float()  # (out, blocks, 32)
        return (codes * self.d[..., None] + self.m[..., None]).reshape(out, half * 2)


class Q8A8Linear(Int8ActLinear):
    def __init__(self, weight: torch.Tensor, sizes: list[int], bias: torch.Tensor | None):
        super().__init__(sizes, bias)
        self.lib = _need_library().lib
        out, cols = weight.shape
        self.in_features = int(cols)
        w = weight.detach().float().reshape(out, cols // GROUP, GROUP)
        d = w.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        self.codes = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8).reshape(out, cols).contiguous()
        self.d = d.contiguous()
        self.bias = bias.float().contiguous() if bias is not None else None

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], self.out_features)
        self.lib.dfq_q8_matmul(rows.data_ptr(), rows.shape[0], self.in_features, self.codes.data_ptr(),
                               self.d.data_ptr(), self.out_features, native.ptr(self.bias), out.data_ptr())
        return out

    def dequantize(self) -> torch.Tensor:
        out, cols = self.codes.shape
        return (self.codes.float().reshape(out, cols // GROUP, GROUP) * self.d[..., None]).reshape(out, cols)


def quantize_act_rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels' rounding of (rows, k) fp32 activations, dequantized: what the integer dot products
    multiply (for tests and references)."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    d = torch.empty(rows, k // GROUP)
    s = torch.empty(rows, k // GROUP)
    x = x.float().contiguous()
    _need_library().lib.dfq_quantize_rows(x.data_ptr(), rows, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return (q.float().reshape(rows, k // GROUP, GROUP) * d[..., None]).reshape(rows, k)


def a8_fits(rows: int, cols: int) -> bool:
    """Whether q4a8/q8a8 take an (out=rows, in=cols) weight: whole blocks of 32 inputs."""
    return cols % GROUP == 0 and rows > 0
