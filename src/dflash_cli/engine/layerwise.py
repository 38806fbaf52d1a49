"""Loading a dense target in a CPU integer format (q4, q8, q4a8, q8a8) one decoder layer at a time.

transformers' from_pretrained materializes the whole model in the compute dtype before the fast path
quantizes it: a 4B target in fp32 holds 16 GB at its peak for 2.5 GB of 4-bit codes. Here each layer's
tensors are read from the safetensors files, turned into the fast path's projections
(fast_layers.layer_projections) and their dense weights dropped before the next layer is read, so a load
holds the codes, the embeddings and norms, and one layer in full precision.

Only where nothing of from_pretrained's work is missed: a dense family the fast path runs
(fast_layers.FAMILIES), no quantization config in the checkpoint, and every parameter of the model present
under its own name and shape (no renamed, fused or split tensors). Anything else returns None and loads the
usual way (engine/load.py).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_cli.engine.errors import CheckpointError
from dflash_cli.engine.fast_layers import (
    FAMILIES,
    QuantizedLayers,
    architecture_unsupported,
    codes_lookup,
    free_dense_weights,
    layer_projections,
)
from dflash_cli.engine.hf_module import HFModule

log = logging.getLogger(__name__)


def load_by_layer(folder: Path, files: list[Path], config: dict[str, Any], dtype: torch.dtype, weights: str,
                  codes_file: Path | None) -> tuple[HFModule, QuantizedLayers] | None:
    """The model (its linears' dense weights empty) and its layers' projections in `weights`, or None when
    this checkpoint must load through from_pretrained. `codes_file`: ready 4-bit codes (a GGUF's own)."""
    if config.get("model_type") not in FAMILIES or config.get("quantization_config"):
        return None
    model = _empty_model(folder, dtype)
    if architecture_unsupported(model) is not None:
        return None
    from safetensors import SafetensorError

    try:
        shapes, where = _index(files)
        why = _mismatch(model, shapes)
        if why is not None:
            log.debug("%s loads whole: %s", folder, why)
            return None
        quantized = _fill(model, where, dtype, weights, codes_file)
    except SafetensorError as e:
        raise CheckpointError(f"cannot load target from {folder}: a weights file is damaged ({e})",
                              hint="the download may be truncated: delete it and fetch it again") from None
    _read_generation_config(model, folder)
    return model.eval().requires_grad_(False), quantized


def _empty_model(folder: Path, dtype: torch.dtype) -> HFModule:
    """The model with its parameters on `meta` (no memory), its buffers (rotary frequencies) computed."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=False)
    model.tie_weights()  # from_pretrained ties after loading; from_config leaves a tied head apart
    return model


def _index(files: list[Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    """Each tensor's shape and file, from the files' headers."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                shapes[key], where[key] = tuple(f.get_slice(key).get_shape()), path
    return shapes, where


def _read(where: dict[str, Path], names: list[str], dtype: torch.dtype,
          as_saved: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors `names` in `dtype` (`as_saved`: that one as the checkpoint holds it), each file mapped only
    while they are read: its pages would otherwise stay in the process's resident memory to the end."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in dict.fromkeys(where[name] for name in names):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out.update((name, f.get_tensor(name) if name == as_saved else f.get_tensor(name).to(dtype))
                       for name in names if where[name] == path)
    return out


def _keep_16bit_embeddings(model: HFModule, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """A float32 target keeps bf16/fp16 embeddings as saved, its embedding module widening the rows it looks up
    to float32: the same values (every 16-bit float is a float32) in half the memory, 1.6 GB of a 4B
    target's. (A tied LM head is quantized from them, exactly as from their float32 copy.)"""
    if dtype != torch.float32 or weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    model.get_input_embeddings().register_forward_hook(_widen_to_float32)
    return True


def _widen_to_float32(module: nn.Module, args: Any, rows: torch.Tensor) -> torch.Tensor:
    return rows.float()


def _release_freed_heap() -> None:
    """Hands the heap pages freed so far back to the system (glibc keeps a freed layer's weights otherwise,
    between the codes allocated after them, and the process's memory grows by them layer after layer)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return
    trim(0)


def _mismatch(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why the checkpoint's tensors are not the model's parameters one for one, or None when they are."""
    params = dict(model.named_parameters())  # a tied LM head is listed once, as the embeddings
    persistent = set(model.state_dict(keep_vars=True)) - set(params) - _aliases(model)
    if persistent:
        return f"buffers saved with the weights ({sorted(persistent)[0]})"
    for name, param in params.items():
        if name not in shapes:
            return f"no tensor named {name}"
        shape = shapes[name]
        if shape != tuple(param.shape):
            return f"{name} has shape {list(shape)}, the config implies {list(param.shape)}"
    return None


def _aliases(model: nn.Module) -> set[str]:
    """State-dict names of parameters listed under another name too (a tied LM head)."""
    seen: dict[int, str] = {}
    aliases = set()
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            aliases.add(name)
        seen.setdefault(id(value), name)
    return aliases


def _fill(model: HFModule, where: dict[str, Path], dtype: torch.dtype, weights: str,
          codes_file: Path | None) -> QuantizedLayers:
    """Reads the parameters outside the decoder layers, then each layer's, quantizing and freeing its linears
    before the next is read."""
    from dflash_cli.engine.cpu.weightonly import read_q4_codes

    layers = model.get_decoder().layers
    names = {id(m): name for name, m in model.named_modules()}
    prefixes = tuple(names[id(layer)] + "." for layer in layers)
    params = [name for name, _ in model.named_parameters()]
    embeddings = names[id(model.get_input_embeddings())] + ".weight"
    for name, value in _read(where, [n for n in params if not n.startswith(prefixes)], dtype, embeddings).items():
        if name == embeddings and not _keep_16bit_embeddings(model, value, dtype):
            value = value.to(dtype)
        _assign(model, name, value)
    model.tie_weights()  # the embeddings are a new parameter now: the tied head takes it too
    codes = read_q4_codes(codes_file) if codes_file is not None else None
    used: list[str] = []
    lookup = codes_lookup(model, codes, used) if codes else None
    projections, freed = nn.ModuleList(), 0
    for prefix, layer in zip(prefixes, layers):
        for name, value in _read(where, [n for n in params if n.startswith(prefix)], dtype).items():
            _assign(model, name, value)
        replaced: list[nn.Module] = []
        projections.append(layer_projections(layer, False, weights, lookup, replaced))
        freed += free_dense_weights(replaced)
        _release_freed_heap()
    return QuantizedLayers(weights, projections, len(set(used)), freed)


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))


def _read_generation_config(model: Any, folder: Path) -> None:
    """generation_config.json (its end-of-generation ids), as from_pretrained reads it."""
    if not (folder / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        log.debug("%s: generation_config.json not read (%s)", folder, e)
