"""bitsandbytes quantization: the only module that imports bitsandbytes."""

from __future__ import annotations

import logging

import torch
from torch import nn

from dflash_cli.engine.dtypes import QUANT_CHOICES
from dflash_cli.engine.errors import InvalidSettingError


def check_quant(name: str | None) -> str | None:
    if name in (None, "none"):
        return None
    if name not in QUANT_CHOICES:
        raise InvalidSettingError(f"unknown quantization {name!r}", hint="use q4, q8 (CPU), nf4, int8 (GPU) or none")
    return name


def _quiet_bitsandbytes() -> None:
    # It warns about an optional package at import, and int8 logs a cast warning on every matmul.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def bnb_config(name: str, compute_dtype: torch.dtype, *, offload: bool = False):
    """A transformers `BitsAndBytesConfig` for `nf4` (4-bit NormalFloat) or `int8` (LLM.int8()).

    offload: some layers go to cpu/disk under a device map; transformers refuses that with bitsandbytes
    unless those layers are allowed to stay unquantized (llm_int8_enable_fp32_cpu_offload)."""
    _quiet_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if name == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_use_double_quant=False,
                                  llm_int8_enable_fp32_cpu_offload=offload)
    if name == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=offload)
    raise InvalidSettingError(f"unknown quantization {name!r}", hint="use nf4, int8 or none")


def quantize_linears(module: nn.Module, name: str, compute_dtype: torch.dtype, device: torch.device,
                     skip: tuple[str, ...] = ()) -> None:
    """Replaces every nn.Linear under `module` (except names in `skip`) by its bitsandbytes version, in place."""
    _quiet_bitsandbytes()
    import bitsandbytes as bnb

    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, nn.Linear) or full in skip:
                continue
            weight = child.weight.data.to(compute_dtype)
            bias = child.bias is not None
            new: nn.Module
            if name == "nf4":  # quantized where the weight already is, on the move below
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=bias,
                                        compute_dtype=compute_dtype, quant_type="nf4", device="cpu")
                new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            else:
                new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=bias,
                                          has_fp16_weights=False, device="cpu")
                # Int8Params quantizes only on a move from the CPU
                new.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False)
            if bias:
                new.bias = nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
            setattr(parent, child_name, new.to(device))  # bitsandbytes quantizes on the move to a device
