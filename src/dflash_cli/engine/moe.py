"""Mixtures of experts under `--quant q4` / `q8`: 4/8-bit experts whose every token's output is independent of
the other tokens of its call.

transformers 5 keeps a MoE layer's routed experts as two fused 3-D parameters, gate_up_proj (E, 2I, H) and
down_proj (E, H, I), not as nn.Linear modules, so the fast path's linear-by-linear quantization
(fast_layers.layer_projections) passed them by: under q4 they stayed 16-bit, most of an MoE's weights. And
transformers runs each expert on the rows routed to it, a count that differs between a 1-token decode and a
block verify, through 16-bit matmuls whose rounding may depend on the row count (at Qwen3-30B-A3B's expert
shapes, 2048 x 768, 4 of 16 tokens of a call got other bf16 bits than alone, on an AVX-512 machine), so
greedy speculative output could drift from greedy plain output of the same target.

`quantize_experts` replaces each such module in place by `WeightOnlyExperts` (the same call: hidden states
(T, H), top-k expert indices and weights (T, K) -> (T, H)), one q4/q8 layer per expert projection
(weightonly.quantize_weight), and drops the 16-bit tensors. Per expert the routed rows are gathered and run
through PyTorch's weight-only kernels, which compute each row on its own; each token's k-th expert output
times its routing weight lands in slot (token, k) in fp32, and the slots are added up per token in the order
of its top-k list (transformers adds them in bf16, in expert order). A token's output is then the same
bits whatever else is in the call, which the q4/q8 fast path promises (docs/engine.md, "Exact rows").

The router stays 16-bit and runs as transformers computes it (llama.cpp's quantizations also keep the
router, `ffn_gate_inp`, unquantized: it is small and routing is sensitive to it). It is a 16-bit matmul,
though, and those may round a row differently by row count (a 2048 x 512 bf16 one did, in 2 of 29 rows, on
that machine), so calls of up to 64 tokens run it one row at a time (`route`), as they run attention
through fast_layers.row_exact_attention; so does a shared expert's gate, a (1, H) linear (Qwen3.5-MoE,
Qwen3-Next). The shared expert itself is a gated MLP of nn.Linears, quantized as the dense MLPs are.
Prompts (longer calls) route all their rows at once: their rows feed both decodings alike.

Measured on one core (32 experts of Qwen3-30B-A3B's shapes, top 8): the 4-bit experts hold 31% of the bf16
bytes (q8: 50%) and ran a 1-token call in 2.2 ms against 7.1 ms for transformers' bf16 experts, a 16-token
call in 15 ms against 28 ms. WeightOnlyExperts' per-expert loop reads host-side counts, so a compiled fast
path (`--compile on`) does not trace it and runs eagerly (fast.FastPath's one-line fallback).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_cli.engine.cpu.weightonly import WeightOnlyLinear, quantize_weight


def fused_experts(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gate_up (E, 2I, H), down (E, H, I)) of a transformers experts module in the layout Qwen3-MoE,
    Qwen3.5-MoE, Qwen3-Next and Gemma 4 share (gate rows above up rows, (out, in) matrices, no biases);
    None for anything else (gpt-oss's transposed, interleaved experts with biases)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return None
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        return None
    if getattr(module, "has_bias", False) or not getattr(module, "has_gate", True):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or not callable(getattr(module, "act_fn", None)):
        return None
    experts, rows, hidden = gate_up.shape
    if rows % 2 or tuple(down.shape) != (experts, hidden, rows // 2):
        return None
    return gate_up, down


class WeightOnlyExperts(nn.Module):
    """A mixture's routed experts as q4/q8 layers, one gate|up and one down per expert, called as
    transformers' experts modules are: (hidden (T, H), top_k_index (T, K), top_k_weights (T, K)) -> (T, H)."""

    def __init__(self, gate_up: list[WeightOnlyLinear], down: list[WeightOnlyLinear],
                 act_fn: Callable[[torch.Tensor], torch.Tensor], kind: str):
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.act_fn = act_fn
        self.kind = kind
        self.num_experts = len(gate_up)

    @classmethod
    def quantize(cls, module: nn.Module, kind: str) -> WeightOnlyExperts | None:
        """`module`'s experts in `kind`; None when it is not a fused experts module or q4 cannot take its
        shapes (hidden and intermediate sizes multiples of 32)."""
        weights = fused_experts(module)
        if weights is None or any(w.device.type != "cpu" for w in weights):
            return None
        gate_up, down = weights
        inter = int(gate_up.shape[1]) // 2
        first = [quantize_weight(gate_up[e].detach(), kind, [inter, inter]) for e in range(gate_up.shape[0])]
        second = [quantize_weight(down[e].detach(), kind) for e in range(down.shape[0])]
        if any(layer is None for layer in first + second):
            return None
        return cls(first, second, module.act_fn, kind)  # type: ignore[arg-type]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        slots = top_k_index.reshape(-1)  # slot t * k + j: token t's j-th expert
        order = torch.argsort(slots, stable=True)  # the slots grouped by expert
        counts = torch.bincount(slots, minlength=self.num_experts).tolist()
        weights = top_k_weights.reshape(-1, 1).float()
        out = torch.zeros(tokens * k, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        at = 0
        for expert, count in enumerate(counts[:self.num_experts]):
            if not count:
                continue
            chosen = order[at:at + count]
            at += count
            gate, up = self.gate_up[expert](hidden.index_select(0, chosen // k))
            y = self.down[expert](self.act_fn(gate) * up)
            out.index_copy_(0, chosen, y.float() * weights.index_select(0, chosen))
        per_token = out.view(tokens, k, -1)
        total = per_token[:, 0]
        for j in range(1, k):  # in the order of each token's top-k list, whatever the call's other tokens
            total = total + per_token[:, j]
        return total.to(hidden.dtype)


def quantize_experts(model: nn.Module, kind: str) -> int:
    """Replaces every fused experts module of `model` (an `experts` attribute: Qwen's sparse MoE blocks,
    Gemma 4's layers) by its WeightOnlyExperts in `kind`, in place, freeing the 16-bit tensors; returns how
    many modules are quantized (those done before included). Under q4, modules whose sizes q4 cannot take
    (not multiples of 32) become q8, which takes any width: a 16-bit module would not keep rows exact."""
    owners = [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]
    done = 0
    for owner in owners:
        experts = owner.experts
        if isinstance(experts, WeightOnlyExperts):
            done += 1
            continue
        quantized = WeightOnlyExperts.quantize(experts, kind)  # type: ignore[arg-type]
        if quantized is None and kind == "q4":
            quantized = WeightOnlyExperts.quantize(experts, "q8")  # type: ignore[arg-type]
        if quantized is not None:
            owner.experts = quantized
            done += 1
    return done


def each_row(fn: Callable[[torch.Tensor], Any], rows: torch.Tensor) -> Any:
    """fn over (T, H) rows one at a time, the results (a tensor or a tuple of them) concatenated: every row
    gets the bits a 1-row call gives it."""
    if rows.shape[0] == 1:
        return fn(rows)
    outs = [fn(rows[i:i + 1]) for i in range(rows.shape[0])]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def route(router: Callable[[torch.Tensor], Any], rows: torch.Tensor, exact: bool) -> Any:
    """The router's (scores, top-k weights, top-k indices) for (T, H) rows; `exact`: one row at a time."""
    return each_row(router, rows) if exact else router(rows)


def sparse_moe(block: Any, x: torch.Tensor, proj: Any, exact: bool) -> torch.Tensor:
    """A Qwen sparse MoE block (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next) as transformers computes it, with the
    router (and a shared expert's gate) run row by row when `exact`, and the shared expert through the
    layer's quantized projections (`proj`: shared_gate_up, shared_down) when it has them."""
    b, n, hidden = x.shape
    flat = x.reshape(-1, hidden)
    _, weights, chosen = route(block.gate, flat, exact)
    out = block.experts(flat, chosen, weights)
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        if "shared_gate_up" in proj:
            gate, up = proj["shared_gate_up"](flat)
            shared_out = proj["shared_down"](shared.act_fn(gate) * up)
        else:
            shared_out = shared(flat)
        out = out + F.sigmoid(route(block.shared_expert_gate, flat, exact)) * shared_out
    return out.reshape(b, n, hidden)
