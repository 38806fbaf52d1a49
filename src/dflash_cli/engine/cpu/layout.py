"""The weight layout of the q4a8/q8a8 kernels (engine/cpu/native/int8_matmul.c): 8 output columns side by side
per group, codes and fp16 scales in the order the kernels read them, and back."""

from __future__ import annotations

import torch

from dflash_cli.engine.cpu.quantized import GROUP


def by_column_groups(x: torch.Tensor) -> torch.Tensor:
    """(n, blocks, ...) per-column data as (n/8, blocks, 8, ...): the 8 columns of a group side by side."""
    return x.reshape(x.shape[0] // 8, 8, *x.shape[1:]).transpose(1, 2)


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """(n, k) codes 0..15 in the kernel's layout (native/int8_matmul.c): per group of 8 columns and block of 32
    inputs, 128 bytes, byte 32t + 4c + i holding column c's code of input 4t + i (low nibble) and 16 + 4t + i
    (high nibble)."""
    n, k = codes.shape
    c = by_column_groups(codes.to(torch.uint8).reshape(n, k // GROUP, 2, 4, 4))  # (n/8, blocks, 8c, half, 4t, 4i)
    packed = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # (n/8, blocks, 8c, 4t, 4i)
    return packed.permute(0, 1, 3, 2, 4).reshape(n // 8, k // GROUP, 128).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    groups, blocks, _ = packed.shape
    p = packed.reshape(groups, blocks, 4, 8, 4).permute(0, 1, 3, 2, 4)  # (n/8, blocks, 8c, 4t, 4i)
    codes = torch.stack([p & 0xF, p >> 4], dim=3)  # (n/8, blocks, 8c, half, 4t, 4i)
    return codes.transpose(1, 2).reshape(groups * 8, blocks * GROUP)


def pack_q8(codes: torch.Tensor) -> torch.Tensor:
    """(n, k) int8 codes in the kernel's layout: per group of 8 columns and block of 32, 256 bytes, byte
    32t + 4c + i column c's code of input 4t + i."""
    n, k = codes.shape
    c = by_column_groups(codes.reshape(n, k // GROUP, 8, 4))  # (n/8, blocks, 8c, 8t, 4i)
    return c.permute(0, 1, 3, 2, 4).reshape(n // 8, k // GROUP, 256).contiguous()


def unpack_q8(packed: torch.Tensor) -> torch.Tensor:
    groups, blocks, _ = packed.shape
    p = packed.reshape(groups, blocks, 8, 8, 4).permute(0, 1, 3, 2, 4)  # (n/8, blocks, 8c, 8t, 4i)
    return p.transpose(1, 2).reshape(groups * 8, blocks * GROUP)


def pack_scales(x: torch.Tensor) -> torch.Tensor:
    """(n, blocks) scales as fp16 (n/8, blocks, 8)."""
    return by_column_groups(x.half()).contiguous()


def unpack_scales(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).reshape(-1, x.shape[1]).float()
