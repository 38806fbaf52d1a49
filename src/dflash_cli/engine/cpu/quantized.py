"""What the 4/8-bit linear formats share (engine/cpu/weightonly.py: torch's kernels; engine/cpu/int8act.py: the
project's 8-bit-activation kernels): 4-bit codes with their scales, and the base of a quantized linear."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32  # GGUF Q4_1's block; Q4 needs in_features divisible by it
@dataclass
class Q4Codes:
    """A (out, in) weight in 4 bits: codes 0..15 (int32, (out, in)) and per-group scale and zero ((out, in/G),
    any float dtype) with w = (codes - 8) * scale + zero; `mins`, where known exactly (a GGUF's Q4_1 m, or
    quantize_q4_1's), is zero - 8 * scale unrounded, for the q4a8 kernels (engine/cpu/int8act.py)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int = GROUP
    mins: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, cols = self.codes.shape
        shape = (out, cols // self.group, self.group)
        w = (self.codes.reshape(shape).float() - 8) * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.reshape(out, cols).to(dtype)

    @classmethod
    def from_q4_1(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4Codes:
        """GGUF Q4_1 (w = d*q + m) as scale/zero codes: the same 4-bit codes, nothing requantized."""
        d32, m32 = d.float(), m.float()
        return cls(q.to(torch.int32), d32, m32 + 8 * d32, mins=m32)


def sizes_and_bias(linears: list[nn.Linear]) -> tuple[list[int], torch.Tensor | None]:
    with_bias = [m.bias is not None for m in linears]
    bias = torch.cat([m.bias.detach().float() for m in linears]) if all(with_bias) else None
    return [m.out_features for m in linears], bias


class WeightOnlyLinear(nn.Module):
    """Base of Q4Linear/Q8Linear: one or more linears sharing an input, fused into one quantized weight.
    Returns a tensor, or a tuple (one per linear) when several were fused; `source` keeps a single linear's
    dense weight when asked (the LM head's rows for a draft vocabulary)."""

    def __init__(self, sizes: list[int], bias: torch.Tensor | None):
        super().__init__()
        self.sizes = sizes
        self.out_features = sum(sizes)
        self.bias = bias
        self.source: torch.Tensor | None = None

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The fused output (..., out_features), not split per linear."""
        # bf16 in, bf16 out is the common case: no cast calls then (each costs a dispatch on a 1-token decode)
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.bfloat16:
            rows = rows.to(torch.bfloat16)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = self.matmul(rows)
        if x.dtype != torch.bfloat16:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor):
        y = self.whole(x)
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else y
