"""oneDNN-packed linear layers for CPU decoding, where torch's default matmul is slow at few rows.

torch's CPU matmul goes through MKL, which is slow at the row counts a decode loop runs (1-16 rows). A
weight that oneDNN re-lays out once for this machine runs them much faster: measured on a 2-core AVX2
machine, a 16-row 576x49152 LM head 2.6x and a 1-row one 2x (benchmarks/README.md). Fusing linears that
share an input (q|k|v, gate|up) into one call also saves the per-call cost that dominates small layers.
Packing makes a second copy of the weights, so it is done only on a CPU and when memory allows; bf16 weights
pack only where oneDNN computes bf16 natively (AVX512-BF16 or AMX; elsewhere the reorder refuses them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# how close a packed layer must come to F.linear on a probe (bf16: oneDNN accumulates in fp32, F.linear too,
# but the two round their blocks differently)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class PackedLinear(nn.Module):
    """One or more CPU Linears sharing an input, run as one oneDNN-packed weight.

    Returns a tensor, or a tuple of tensors (one per linear) when several were fused.
    """

    def __init__(self, linears: list[nn.Linear], packed: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.packed, self.bias = packed, bias
        self.sizes = [m.out_features for m in linears]
        self.source: torch.Tensor | None = None  # see pack(keep_source=)
        self.out_features = sum(self.sizes)

    @classmethod
    def pack(cls, *linears: nn.Module, keep_source: bool = False) -> nn.Module | None:
        """The linears packed into one, when oneDNN computes them exactly enough on this CPU; else None.

        keep_source: keep a reference (not a copy) to a single linear's dense weight, for `dense_weight`;
        only for weights that stay alive anyway (the target's LM head), or it would keep a second copy."""
        if any(type(m) is not nn.Linear for m in linears):
            return None
        plain = [m for m in linears if isinstance(m, nn.Linear)]  # all of them, typed as Linears
        weights = [m.weight for m in plain]
        dtype = weights[0].dtype
        if any(w.device.type != "cpu" or w.dtype != dtype for w in weights) or dtype not in TOLERANCE:
            return None
        with_bias = [m.bias is not None for m in plain]
        if any(with_bias) and not all(with_bias):
            return None
        try:
            with torch.no_grad():
                weight = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
                bias = torch.cat([m.bias.detach() for m in plain]) if all(with_bias) else None
                packed = cls(plain, torch.ops.mkldnn._reorder_linear_weight(weight, None), bias)
                probe = torch.randn(3, plain[0].in_features).to(dtype)
                got = packed(probe)
                got = got if isinstance(got, tuple) else (got,)
                tol = TOLERANCE[dtype]
                ok = all(torch.allclose(g.float(), m(probe).float(), rtol=tol, atol=tol) for g, m in zip(got, plain))
        except (RuntimeError, AttributeError, NotImplementedError):
            return None
        if ok and keep_source and len(plain) == 1:
            packed.source = plain[0].weight.detach()  # a tensor, not a Parameter: not registered
        return packed if ok else None

    def forward(self, x: torch.Tensor):
        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        y = y.view(*x.shape[:-1], self.out_features)
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else y


def dense_weight(linear: nn.Module) -> torch.Tensor | None:
    """The (out, in) weight of a plain or a packed single linear; None for a quantized one that kept none."""
    weight = getattr(linear, "weight", None)
    if weight is None:  # a packed or weight-only quantized single linear that kept its dense weight
        weight = getattr(linear, "source", None)
    if weight is None and callable(getattr(linear, "dequantize_rows", None)):
        return None
    if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point:
        raise TypeError(f"{type(linear).__name__} has no dense weight to take rows from")
    return weight


def dense_rows(linear: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of a linear's (out, in) weight: its dense weight's, or its codes' dequantized."""
    weight = dense_weight(linear)
    if weight is None:
        return getattr(linear, "dequantize_rows")(rows)
    return weight[rows.to(weight.device)]


def embedding_rows(table: torch.Tensor | nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table: a dense (vocab, hidden) tensor, or a module that looks its rows up
    (int8act.CodesEmbedding, a tied head's codes)."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table(ids)


class Parallel(nn.Module):
    """Linears sharing an input, run one by one: what PackedLinear does in one call, where it cannot."""

    def __init__(self, *linears: nn.Module):
        super().__init__()
        self.parts = nn.ModuleList(linears)

    def forward(self, x: torch.Tensor):
        return tuple(m(x) for m in self.parts)


def room_to_pack(model: nn.Module) -> bool:
    """True when `model` is an fp32/bf16 CPU model and a second copy of its weights fits in half the free memory."""
    from dflash_cli.engine.device import free_memory

    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or params[0].dtype not in TOLERANCE:
        return False
    size = sum(p.numel() * p.element_size() for p in params)
    free = free_memory(params[0].device)
    return free is not None and size < free // 2


def pack_linears(module: nn.Module) -> int:
    """Replaces every plain fp32 CPU nn.Linear inside `module` by its packed form; returns how many."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            packed = PackedLinear.pack(child) if type(child) is nn.Linear else None
            if packed is not None:
                setattr(parent, name, packed)
                count += 1
    return count
