"""Gated DeltaNet layers (Qwen3.5's and Qwen3-Next's "linear_attention") on the fast path, with exact rollback.

A linear-attention layer keeps no per-token K/V: it carries a recurrent state S (heads, dk, dv) and the
last K-1 inputs of its causal convolution. A verify forward runs a whole block of drafts through it, and
after the target accepts a prefix, S must be the state after exactly the committed tokens. transformers'
cache rolls back the convolution but not S, so its own speculative path is not lossless on these models.

Here a block of n tokens is solved in closed form (the gated delta rule over one chunk), which yields the
per-token updates delta_i as a by-product:

    S_i = exp(g_i) S_{i-1} + k_i delta_i^T,   delta_i = beta_i (v_i - (exp(g_i) S_{i-1})^T k_i)
    =>  S_m = exp(G_m) S_0 + sum_{j<=m} exp(G_m - G_j) k_j delta_j^T    (G = cumulative sum of g)

so the state after any m of the block's tokens is one small matmul (`state_after`). The forward never
writes the state: it returns a `BlockRecord`, and the cache settles the state at the committed length
before the next forward. Rolling back is free, and a forward cut short by Ctrl-C leaves the state intact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_cli.engine.hf_module import HFModule

CHUNK = 64  # tokens solved at once; longer inputs (prompts) run chunk by chunk


@dataclass
class BlockRecord:
    """What a forward over positions base..base+n-1 leaves for settling one layer's state at base+m."""

    s0: torch.Tensor  # (h, dk, dv) fp32 state at `base` (the last chunk's start for long inputs)
    k: torch.Tensor  # (h, n, dk) normalised keys of the last chunk
    cum_g: torch.Tensor  # (h, n) cumulative log decay within the last chunk
    delta: torch.Tensor  # (h, n, dv) per-token updates
    conv_tail: torch.Tensor  # (1, C, K-1+n) convolution inputs: state before the chunk, then its tokens

    @property
    def tokens(self) -> int:
        return self.k.shape[1]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # as transformers and FLA compute it


def delta_rule_chunk(q, k, v, g, beta, s0):
    """The gated delta rule over one chunk of n tokens, all heads at once (fp32).

    q, k (h, n, dk) normalised (q also scaled by dk**-0.5); v (h, n, dv); g, beta (h, n); s0 (h, dk, dv).
    Returns the outputs o_i = S_i^T q_i (h, n, dv), the cumulative log decay (h, n) and delta (h, n, dv).
    """
    n = q.shape[1]
    cum_g = g.cumsum(dim=-1)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, else 0 (masked before exp: above the diagonal it would overflow)
    decay = (cum_g[:, :, None] - cum_g[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    scale = cum_g.exp()[..., None]  # (h, n, 1): exp(G_i), the decay of s0 up to token i
    # (I + A) delta = beta (v - exp(G) k s0),  A_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i
    a = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).tril(-1)
    rhs = beta[..., None] * (v - scale * (k @ s0))
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    delta = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    out = scale * (q @ s0) + (decay * (q @ k.transpose(-1, -2))) @ delta
    return out, cum_g, delta


def state_after(record: BlockRecord, m: int) -> torch.Tensor:
    """The recurrent state after the first m tokens of the record's chunk (0 <= m <= n)."""
    if m == 0:
        return record.s0
    weights = (record.cum_g[:, m - 1 : m] - record.cum_g[:, :m]).exp()  # (h, m)
    decayed = record.cum_g[:, m - 1].exp()[:, None, None] * record.s0
    return decayed + (record.k[:, :m] * weights[..., None]).transpose(-1, -2) @ record.delta[:, :m]


def conv_after(record: BlockRecord, m: int, kernel: int) -> torch.Tensor:
    """The convolution state (the last K-1 inputs) after the first m tokens of the record's chunk."""
    return record.conv_tail[:, :, m : m + kernel - 1]


def is_linear_attention(layer: nn.Module) -> bool:
    return hasattr(layer, "linear_attn")


def input_linears(net: HFModule) -> tuple[nn.Module, ...]:
    """A layer's input projections: Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, or Qwen3-Next's
    in_proj_qkvz, in_proj_ba (the same rows, grouped per key head: see `split_inputs`)."""
    if hasattr(net, "in_proj_qkvz"):
        return (net.in_proj_qkvz, net.in_proj_ba)
    return (net.in_proj_qkv, net.in_proj_z, net.in_proj_b, net.in_proj_a)


def linear_projections(layer: HFModule, pack: Callable[..., nn.Module | None]) -> nn.ModuleDict:
    """The input projections as one map (split outputs) and out_proj; `pack(*linears)` fuses them or None."""
    net = layer.linear_attn
    ins = input_linears(net)
    from dflash_cli.engine.cpu.packed import Parallel

    return nn.ModuleDict(dict(inputs=pack(*ins) or Parallel(*ins), out=pack(net.out_proj) or net.out_proj))


def split_inputs(net: HFModule, outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The input projections' outputs as Qwen3.5 lays them out: (q|k|v, z, b, a), each (1, n, width).

    Qwen3-Next's in_proj_qkvz groups its output per key head, [q_g, k_g, v_g, z_g] for g in 0..nk-1 (v_g
    and z_g the r = nv/nk value heads that share key head g), and in_proj_ba likewise [b_g, a_g]; this is
    transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering, so the channels reach the
    convolution, the norm and the decay in the same order as there."""
    if len(outs) == 4:
        return outs
    qkvz, ba = outs
    lead, nk, dk = qkvz.shape[:-1], net.num_k_heads, net.head_k_dim
    r = net.num_v_heads // nk
    q, k, v, z = qkvz.reshape(*lead, nk, -1).split([dk, dk, r * net.head_v_dim, r * net.head_v_dim], dim=-1)
    b, a = ba.reshape(*lead, nk, 2 * r).split([r, r], dim=-1)
    q, k, v, z, b, a = (t.reshape(*lead, -1) for t in (q, k, v, z, b, a))
    return torch.cat([q, k, v], dim=-1), z, b, a


def gated_delta_net(net: HFModule, proj: nn.ModuleDict, x: torch.Tensor, conv_state: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, BlockRecord]:
    """One Gated DeltaNet layer (transformers' Qwen3_5GatedDeltaNet or Qwen3NextGatedDeltaNet weights) over
    x (1, n, H).

    Reads the convolution state (1, C, K-1) and recurrent state (h, dk, dv) without writing them; returns
    the layer output (1, n, H) and the record that settles the state at any point of the last chunk.
    """
    n = x.shape[1]
    mixed, z, b, a = split_inputs(net, proj["inputs"](x))
    conv_in = torch.cat([conv_state.to(mixed.dtype), mixed.transpose(1, 2)], dim=-1)  # (1, C, K-1+n)
    weight = net.conv1d.weight  # (C, 1, K)
    mixed = F.conv1d(conv_in.to(weight.dtype), weight, net.conv1d.bias, groups=weight.shape[0])  # (1, C, n)
    mixed = F.silu(mixed).to(x.dtype).transpose(1, 2)[0]  # (n, C)
    q, k, v = torch.split(mixed, [net.key_dim, net.key_dim, net.value_dim], dim=-1)
    heads, repeat = net.num_v_heads, net.num_v_heads // net.num_k_heads
    q = q.reshape(n, net.num_k_heads, net.head_k_dim).float().repeat_interleave(repeat, dim=1).transpose(0, 1)
    k = k.reshape(n, net.num_k_heads, net.head_k_dim).float().repeat_interleave(repeat, dim=1).transpose(0, 1)
    v = v.reshape(n, heads, net.head_v_dim).float().transpose(0, 1)  # (h, n, dv)
    q, k = l2norm(q) * net.head_k_dim**-0.5, l2norm(k)
    beta = b[0].sigmoid().float().transpose(0, 1)  # (h, n), rounded as transformers does in bf16
    g = (-net.A_log.float().exp() * F.softplus(a[0].float() + net.dt_bias)).transpose(0, 1)
    outs: list[torch.Tensor] = []
    record: BlockRecord | None = None
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        # the state at this chunk's start: the layer's, or the end of the chunk before
        s0 = state if record is None else state_after(record, CHUNK)
        out, cum_g, delta = delta_rule_chunk(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], s0)
        record = BlockRecord(s0, k[:, lo:hi], cum_g, delta, conv_in[:, :, lo:])
        outs.append(out)
    assert record is not None  # n >= 1: at least one chunk ran
    core = torch.cat(outs, dim=1).transpose(0, 1).to(x.dtype)  # (n, h, dv)
    core = net.norm(core.reshape(-1, net.head_v_dim), z.reshape(-1, net.head_v_dim))
    return proj["out"](core.reshape(1, n, -1)), record
