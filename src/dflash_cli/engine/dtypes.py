"""Dtype and quantization names: the one map from what a user writes ("bf16", "torch.float16", "half") to
torch's names, the short names the memory planner counts in, and the --quant choices. No torch here: the
planner, the CLI and the SmolLM2 converter name them before torch is loaded (engine/device.py turns the names
into torch dtypes)."""

from __future__ import annotations

# a dtype as written, "torch." and case aside -> torch's name for it
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32",
               "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16"}
#: --dtype's choices
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
#: the target's quantizations (--quant, besides auto): q4/q8 weight-only CPU kernels (engine/cpu/weightonly.py),
#: q4a8/q8a8 with 8-bit activations (engine/cpu/int8act.py), int8/nf4 bitsandbytes (engine/quant.py)
QUANT_CHOICES = ("none", "int8", "nf4", "q4", "q8", "q4a8", "q8a8")
_PLAN_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
KV_CACHE_ENV = "DFLASH_KV_CACHE"  # f16: the C layers' caches in fp16 (engine/fast.py, FastPath.cache_dtype)


def half_caches_asked() -> bool:
    """Whether DFLASH_KV_CACHE asks for the C layers' caches in fp16."""
    import os

    return os.environ.get(KV_CACHE_ENV, "").strip().lower() in ("f16", "fp16", "float16")


def dtype_name(dtype: object) -> str | None:
    """torch's name of `dtype` (a name as written, or a torch dtype), or None for one not in DTYPE_NAMES."""
    return DTYPE_NAMES.get(str(dtype).removeprefix("torch.").lower())


def plan_dtype(dtype: object) -> str:
    """The memory planner's name of a dtype: "bf16", "fp16", or "fp32" (also for any other dtype)."""
    return _PLAN_NAMES.get(dtype_name(dtype) or "", "fp32")
