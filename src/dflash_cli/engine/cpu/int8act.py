"""4-bit and 8-bit weights times 8-bit activations (`--quant q4a8` / `q8a8`), on the project's own AVX2
kernels (engine/cpu/native/int8_matmul.c): what llama.cpp computes on a CPU (Q4_1 or Q8_0 weights, activations
quantized per row in blocks of 32 as Q8_1, integer dot products, fp32 sums).

torch's int4 kernel (`--quant q4`) reads bf16 activations, which a CPU without native bf16 converts in
software, and the small ops around it then run in bf16 too; here activations and everything around the
linears stay fp32, and each linear quantizes its input rows itself. Each output row depends on its own
input row only, so a 1-token decode and a block verify give bit-identical rows (the lossless rule), as with
q4/q8. q4a8 keeps GGUF Q4_1's codes, d and m exactly (w = d * code + m, d and m fp16); q8a8 has one fp16 scale per
block of 32 (GGUF's Q8_0), also for q4a8's LM head.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from dflash_cli.engine.cpu import native
from dflash_cli.engine.cpu.layout import pack_q4, pack_q8, pack_scales, unpack_q4, unpack_scales
from dflash_cli.engine.cpu.quantized import GROUP, Q4Codes, WeightOnlyLinear

INT8_ACT_QUANTS = ("q4a8", "q8a8")


def q4_1_parts(codes: Q4Codes) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, m) of w = d * code + m for `codes` (its own m where it came from a GGUF's Q4_1), as fp16: the
    kernel's scales (a GGUF's own are fp16 already)."""
    d = codes.scale.float()
    m = codes.mins.float() if codes.mins is not None else codes.zero.float() - 8 * d
    return d.half(), m.half()


def quantize_q4_1(weight: torch.Tensor) -> Q4Codes:
    """Min/max 4-bit quantization per block of 32 in GGUF Q4_1's form, d and m rounded to fp16 first (as the
    kernel reads them) and the codes chosen against the rounded values."""
    out, cols = weight.shape
    w = weight.detach().float().reshape(out, cols // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    m = low.half().float()
    d = ((high - m) / 15).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round((w - m[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.int32)
    return Q4Codes(codes.reshape(out, cols), d, m + 8 * d, GROUP, mins=m)


def quantize_q8_0(weight: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes per block of 32 in GGUF Q8_0's form (d = absmax / 127, rounded to fp16 as the kernel reads
    it), `chunk` rows at a time: an LM head's fp32 temporaries would otherwise be three times its size."""
    out, cols = weight.shape
    codes = torch.empty(out, cols, dtype=torch.int8)
    d = torch.empty(out, cols // GROUP)
    for start in range(0, out, chunk):
        w = weight[start:start + chunk].detach().float().reshape(-1, cols // GROUP, GROUP)
        scale = (w.abs().amax(-1) / 127).half().float()
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        codes[start:start + chunk] = torch.round(w * inv[..., None]).clamp_(-127, 127).reshape(-1, cols)
        d[start:start + chunk] = scale
    return codes, d


def _need_library() -> native.Built:
    built = native.library()
    if built is None:
        raise RuntimeError(f"--quant q4a8/q8a8 need this project's AVX2 kernels: {native.unavailable()}")
    return built


def round_up8(n: int) -> int:
    return -(-n // 8) * 8


class Int8ActLinear(WeightOnlyLinear):
    """Base of Q4A8Linear/Q8A8Linear: fp32 in, fp32 out (other dtypes are cast at the call). The kernels take
    outputs in groups of 8: other widths (a draft vocabulary's head) carry zero rows up to the next multiple
    (`padded`), cut off after the call."""

    codes: torch.Tensor
    d: torch.Tensor
    in_features: int
    padded: int

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = self.matmul(rows)
        if y.shape[1] != self.out_features:  # a 2-D input keeps the padded rows' view (a draft vocabulary's
            # 7 x 21,902 logits: a 600 KB copy per draft otherwise)
            y = y[:, :self.out_features] if x.dim() == 2 else y[:, :self.out_features].contiguous()
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


class Q4A8Linear(Int8ActLinear):
    def __init__(self, codes: Q4Codes, sizes: list[int], bias: torch.Tensor | None):
        super().__init__(sizes, bias)
        self.lib = _need_library().lib
        self.in_features = int(codes.codes.shape[1])
        d, m = q4_1_parts(codes)
        self.padded = round_up8(self.out_features)
        extra = self.padded - self.out_features  # zero rows (code 0, d = m = 0) up to a group of 8
        self.codes = pack_q4(torch.cat([codes.codes, codes.codes.new_zeros(extra, self.in_features)]))
        self.d, self.m = (pack_scales(torch.cat([s, s.new_zeros(extra, s.shape[1])])) for s in (d, m))
        self.bias = None if bias is None else torch.cat([bias.float(), bias.new_zeros(extra).float()]).contiguous()

    @classmethod
    def packed(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, out_features: int,
               bias: torch.Tensor | None) -> Q4A8Linear:
        """One over codes, d and m already in the kernel's layout (groups of 8 rows, `bias` padded as they are)."""
        made = cls.__new__(cls)
        Int8ActLinear.__init__(made, [out_features], bias)
        made.lib = _need_library().lib
        made.in_features, made.padded = int(codes.shape[1]) * GROUP, int(codes.shape[0]) * 8
        made.codes, made.d, made.m = codes, d, m
        return made

    @classmethod
    def copy_of(cls, exact: Q8A8Linear) -> Q4A8Linear:
        """A 4-bit copy of an 8-bit weight and its bias: its codes dequantized and quantized again as
        quantize_q4_1 does, in C a block at a time (native/int8_matmul.c, dfq_q8_to_q4: a Qwen3-1.7B-shaped head
        took 5 s through torch, whose temporaries of a real-size head at once would take gigabytes)."""
        groups, blocks = int(exact.codes.shape[0]), int(exact.codes.shape[1])
        codes = torch.empty(groups, blocks, 128, dtype=torch.uint8)
        d, m = (torch.empty(groups, blocks, 8, dtype=torch.float16) for _ in range(2))
        exact.lib.dfq_q8_to_q4(exact.codes.data_ptr(), exact.d.data_ptr(), exact.in_features, groups * 8,
                               codes.data_ptr(), d.data_ptr(), m.data_ptr())
        return cls.packed(codes, d, m, exact.out_features, exact.bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], self.padded)
        self.lib.dfq_q4_matmul(rows.data_ptr(), rows.shape[0], self.in_features, self.codes.data_ptr(),
                               self.d.data_ptr(), self.m.data_ptr(), self.padded, native.ptr(self.bias),
                               out.data_ptr())
        return out

    def dequantize(self) -> torch.Tensor:
        codes = unpack_q4(self.codes)[:self.out_features].float()
        out, cols = codes.shape
        d, m = unpack_scales(self.d)[:out], unpack_scales(self.m)[:out]
        return (codes.reshape(out, cols // GROUP, GROUP) * d[..., None] + m[..., None]).reshape(out, cols)


class Q8A8Linear(Int8ActLinear):
    def __init__(self, weight: torch.Tensor, sizes: list[int], bias: torch.Tensor | None):
        super().__init__(sizes, bias)
        self.lib = _need_library().lib
        out, cols = weight.shape
        self.in_features = int(cols)
        codes, d = quantize_q8_0(weight)
        self.padded = round_up8(out)
        extra = self.padded - out
        if extra:
            codes = torch.cat([codes, codes.new_zeros(extra, cols)])
            d = torch.cat([d, d.new_zeros(extra, d.shape[1])])
        self.codes, self.d = pack_q8(codes), pack_scales(d)
        self.bias = None if bias is None else torch.cat([bias.float(), bias.new_zeros(extra).float()]).contiguous()

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], self.padded)
        self.lib.dfq_q8_matmul(rows.data_ptr(), rows.shape[0], self.in_features, self.codes.data_ptr(),
                               self.d.data_ptr(), self.padded, native.ptr(self.bias), out.data_ptr())
        return out

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_rows(torch.arange(self.out_features))

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` of the weight as the kernel multiplies them (fp32), without the others in fp32."""
        ids = rows.reshape(-1).to(torch.long).contiguous()
        out = torch.empty(ids.numel(), self.in_features)
        if self.lib.dfq_q8_rows(self.codes.data_ptr(), self.d.data_ptr(), self.in_features, self.out_features,
                                ids.data_ptr(), ids.numel(), out.data_ptr()):  # (the kernel checks the range)
            raise IndexError(f"rows out of range for a weight of {self.out_features} rows")
        return out


SHORTLIST_TOP = 16  # rows of a shortlist head's cheap pass that its 8-bit codes score again


class ShortlistHead(nn.Module):
    """An LM head of 8-bit codes (`exact`, a Q8A8Linear: a draft vocabulary's rows, or the target's whole head a
    drafter without one drafts from) for greedy drafts, that scores every row with a 4-bit copy of them first
    (`quick`: half the bytes, and AVX2 sums 4-bit codes faster), then each row's SHORTLIST_TOP best again with
    the 8-bit codes, by the same operations as the 8-bit kernel (native/int8_matmul.c, dfq_shortlist_rows). The
    other logits are the 4-bit copy's. Its greedy draft is the 8-bit head's wherever that one's best is in the
    copy's shortlist: for the demo drafter's draft vocabulary 100% of 2,149 drafted rows with 16 (the copy's best
    alone: 75%). Drafts need not be exact (the target verifies them), so a miss costs acceptance at most."""

    def __init__(self, exact: Q8A8Linear, top: int = SHORTLIST_TOP):
        super().__init__()
        self.exact, self.top = exact, top
        self.out_features = exact.out_features
        self.quick = Q4A8Linear.copy_of(exact)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()
        logits = self.quick.matmul(rows)  # (rows, padded)
        exact = self.exact
        exact.lib.dfq_shortlist_rows(rows.data_ptr(), rows.shape[0], exact.in_features, exact.codes.data_ptr(),
                                     exact.d.data_ptr(), native.ptr(exact.bias), self.out_features,
                                     logits.data_ptr(), logits.shape[1], self.top)
        y = logits[:, :self.out_features]
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def shortlist_head(head: nn.Module) -> ShortlistHead | None:
    """A ShortlistHead over `head` where it is a Q8A8Linear and the kernels have the second pass (a baseline
    build of benchmarks/kernels_ab.py may not), else None."""
    if isinstance(head, Q8A8Linear) and all(hasattr(head.lib, f) for f in ("dfq_shortlist_rows", "dfq_q8_to_q4")):
        return ShortlistHead(head)
    return None


class CodesEmbedding(nn.Module):
    """A tied LM head's 8-bit codes as the input embeddings: each id's row dequantized as it is looked up, so
    the dense (vocab, hidden) table can go (1.5 GB of a 4B target's in fp32). The rows differ from the dense
    ones by at most half a code step, as llama.cpp's quantized token embeddings do; decodes and verifies look
    up the same rows, so speculation stays lossless."""

    def __init__(self, head: Q8A8Linear):
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.dequantize_rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)


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


def a8_fits(rows: int, cols: int, kind: str = "q4a8") -> bool:
    """Whether q4a8/q8a8 take an (out=rows, in=cols) weight: whole blocks of 32 inputs (both pad their rows to
    groups of 8)."""
    return cols % GROUP == 0 and rows > 0


DRAFT_QUANT_ENV = "DFLASH_DRAFT_QUANT"


def draft_quant() -> tuple[str, str]:
    """The drafter's format beside a q4a8/q8a8 target, and why: $DFLASH_DRAFT_QUANT (q4a8 or q8a8) when set, else
    q8a8. 4-bit drafter weights sum faster on AVX2's maddubs (eight products in 16 bits before one widening:
    the demo's draft 7.8 -> 5.1 ms on Zen 1) but draft worse (full-block tau 2.78 -> 2.63 on math); on Zen 1
    the adaptive controller pauses either way, and on Zen 4, which keeps drafting (a draft 2.0 -> 1.5 ms), two
    interleaved runs split by set with no clear winner (benchmarks/README.md, "A 4-bit drafter" and
    "Prefetch, pairs from 5 rows")."""
    forced = os.environ.get(DRAFT_QUANT_ENV, "").strip().lower()
    if forced in INT8_ACT_QUANTS:
        return forced, f"set by {DRAFT_QUANT_ENV}"
    return "q8a8", "the default"


def quantize_drafter(drafter: Any, kind: str = "q8a8") -> int:
    """A drafter's linears (and its draft-vocabulary head, when it has one) as `kind` (q8a8 or q4a8), in place,
    for a q4a8/q8a8 target: its forwards run at the same few rows as the target's, where fp32 matmuls cost
    most of a draft. Drafts need not be exact (the target verifies them); quantized weights with per-block
    scales keep them close to fp32 ones. Returns how many linears were replaced."""
    count = 0
    for parent in list(drafter.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and a8_fits(
                    child.out_features, child.in_features, "q8a8"):
                bias = child.bias.detach() if child.bias is not None else None
                weight = child.weight.detach()
                made: Int8ActLinear = (Q4A8Linear(quantize_q4_1(weight), [child.out_features], bias)
                                       if kind == "q4a8" else Q8A8Linear(weight, [child.out_features], bias))
                setattr(parent, name, made)
                count += 1
    if hasattr(drafter, "head_quant"):
        setattr(drafter, "head_quant", kind)
    return count
