"""`--device-map` and `--max-memory`: checking them against the devices present, before any weights load,
and turning per-layer devices into the module map transformers and accelerate load with.

Which layer goes where is planned by models/memory/split.py (pure arithmetic); this module only knows devices.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dflash_cli.engine.errors import InvalidSettingError, SettingError
from dflash_cli.engine.hf_config import DEVICE_MAP_CHOICES, DEVICE_MAP_STRATEGIES

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")
MAX_MEMORY_HINT = "write DEVICE=SIZE pairs separated by commas, e.g. 0=14GiB,1=14GiB,cpu=30GiB"


def check_device(device: str | None) -> None:
    """--device names a device this machine has (or auto); as pick_device, with the setting named."""
    if device in (None, "", "auto"):
        return
    from dflash_cli.engine.device import pick_device

    try:
        pick_device(device)
    except InvalidSettingError as error:
        raise SettingError("{device}: " + str(error), error.hint, settings=("device",),
                           flag_message=str(error)) from None


def check_strategy(value: str | None) -> str | None:
    """None (one device, as without the option) or auto/balanced/sequential."""
    if value is None or value in ("", "none"):
        return None
    if value not in DEVICE_MAP_STRATEGIES:
        raise SettingError(f"{{device_map}}: unknown device map {value!r}", hint=f"use {', '.join(DEVICE_MAP_CHOICES)}",
                           settings=("device_map",), flag_message=f"unknown device map {value!r}")
    return value


def parse_size(text: str) -> int:
    """'14GiB', '500MB', '1.5 TiB', '1048576' (bytes) -> bytes."""
    m = _SIZE.match(text.lower())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_max_memory(text: str | None) -> dict[str, int]:
    """'0=14GiB,1=14GiB,cpu=30GiB' -> {'cuda:0': ..., 'cuda:1': ..., 'cpu': ...}; keys: a GPU index,
    cuda:N, mps, cpu or disk. Only the syntax is checked here; `device_budgets` checks the devices."""
    out: dict[str, int] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, size = item.partition("=")
        key = key.strip().lower()
        if not sep or not key:
            raise _memory_error(f"{item.strip()!r} is not DEVICE=SIZE", MAX_MEMORY_HINT)
        name = f"cuda:{key}" if key.isdigit() else "cuda:0" if key == "cuda" else key
        if not (re.fullmatch(r"cuda:\d+", name) or name in ("cpu", "disk", "mps")):
            raise _memory_error(f"unknown device {key!r}",
                                "devices are GPU indices (0, 1, ..), cuda:N, mps, cpu or disk")
        try:
            out[name] = parse_size(size)
        except ValueError:
            raise _memory_error(f"{size.strip()!r} is not a size",
                                "sizes are numbers with a unit: 14GiB, 500MiB, 16GB") from None
        if out[name] <= 0:
            raise _memory_error(f"{key}={size.strip()} leaves no memory",
                                "give a positive size, or leave the device out")
    return out


def _memory_error(detail: str, hint: str) -> SettingError:
    return SettingError("{max_memory}: " + detail, hint, settings=("max_memory",))


def _present() -> list[str]:
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["mps"] if torch.backends.mps.is_available() else []


def device_budgets(max_memory: dict[str, int]) -> list[tuple[str, int | None]]:
    """The devices a split may use, GPUs first, then cpu, then disk, each with its bytes (None: unbounded).

    Without --max-memory: every GPU present with its free memory, then cpu (available system memory) and
    disk as the last resorts. With it: exactly the devices it names. A GPU that is not here is an error.
    """
    from dflash_cli.engine.device import free_memory

    gpus = _present()
    if max_memory:
        missing = [d for d in max_memory if d not in gpus + ["cpu", "disk"]]
        if missing:
            here = ", ".join(gpus) if gpus else "no GPU"
            raise SettingError(f"{{max_memory}} names {missing[0]}, which is not here ({here})",
                               hint="name only the devices present, plus cpu and disk", settings=("max_memory",))
        order = [d for d in gpus + ["cpu", "disk"] if d in max_memory]
        if order == ["disk"]:
            raise SettingError("{max_memory} names only disk: a model cannot run from disk alone",
                               hint="add a GPU or cpu, e.g. cpu=30GiB,disk=100GiB", settings=("max_memory",))
        return [(d, max_memory[d]) for d in order]
    out: list[tuple[str, int | None]] = [(d, free_memory(torch.device(d))) for d in gpus]
    out.append(("cpu", free_memory(torch.device("cpu"))))
    out.append(("disk", None))
    return [(d, b if b is not None or d == "disk" else 0) for d, b in out]


def hot_device(budgets: Sequence[tuple[str, int | None]]) -> str:
    """Where the embeddings, LM head and drafter live: the first GPU of the split, else the CPU."""
    return budgets[0][0] if budgets[0][0] != "disk" else "cpu"


def module_map(model: nn.Module, layers: nn.ModuleList, layer_devices: Sequence[str], hot: str) -> dict[str, str]:
    """{module name: device} covering every parameter of `model`: each decoder layer on its device,
    everything else (embeddings, rotary embedding, final norm, LM head) on the hot device."""
    if len(layer_devices) != len(layers):
        raise InvalidSettingError(f"the split places {len(layer_devices)} layers, the model has {len(layers)}")
    owner = {id(layer): dev for layer, dev in zip(layers, layer_devices)}
    contains = {id(m) for layer in layers for m in _ancestors(model, layer)}
    out: dict[str, str] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if id(child) in owner:
                out[full] = owner[id(child)]
            elif id(child) in contains:
                walk(child, full + ".")
            else:
                out[full] = hot

    walk(model, "")
    return out


def _ancestors(model: nn.Module, target: nn.Module) -> list[nn.Module]:
    for name, module in model.named_modules():
        if module is target:
            parts = name.split(".")
            return [model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]
    return []


def offloaded(model: nn.Module) -> bool:
    """Whether some weights live off the model's execution device (accelerate keeps them on `meta` and
    copies them in for every forward: cpu or disk offload)."""
    return any(p.device.type == "meta" for p in model.parameters())


def resolve_split(device: str | None, device_map: str | None,
                  max_memory: str | dict[str, int] | None) -> tuple[str, list[tuple[str, int | None]]] | None:
    """Checks --device, --device-map and --max-memory, alone and together, before any weights load: None for
    one device (as without the options), else (strategy, the devices with their bytes, hot device first).
    Every error is a SettingError, so the command line can say where the bad value was set."""
    check_device(device)
    strategy = check_strategy(device_map)
    memory = parse_max_memory(max_memory) if isinstance(max_memory, str) or max_memory is None else max_memory
    if strategy is None:
        if memory:
            raise SettingError("{max_memory} applies to a split: it needs {device_map}",
                               hint="add --device-map auto (or balanced, sequential)",
                               settings=("max_memory", "device_map"))
        return None
    budgets = device_budgets(memory)
    hot = hot_device(budgets)
    if device not in (None, "", "auto"):
        from dflash_cli.engine.device import pick_device

        asked = pick_device(device)
        if str(asked) != hot and not (asked.type == "cuda" and asked.index is None and hot == "cuda:0"):
            raise SettingError(f"{{device}}: the split of {{device_map}} {strategy} starts on {hot}, not on {device}",
                               hint="leave --device at auto with --device-map; --max-memory picks the devices",
                               settings=("device", "device_map"),
                               flag_message=f"--device {device} and --device-map {strategy}: the split starts on {hot}")
    return strategy, budgets


@dataclass(frozen=True)
class Placement:
    """Where a target runs, resolved once from --device, --device-map and --max-memory and handed down: the
    hot device (embeddings, LM head, drafter) and, for a split, (strategy, the devices with their bytes)."""

    device: torch.device
    split: tuple[str, list[tuple[str, int | None]]] | None = None


def resolve_placement(device: str | None, device_map: str | None = None,
                      max_memory: str | dict[str, int] | None = None) -> Placement:
    """The checked settings as a Placement (every error a SettingError, before anything loads)."""
    from dflash_cli.engine.device import pick_device

    split = resolve_split(device, device_map, max_memory)
    return Placement(pick_device(hot_device(split[1]) if split else device), split)
