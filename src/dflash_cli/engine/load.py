"""Loading a target, a drafter, or a pair from local folders. Never runs code shipped with a checkpoint."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_cli.engine.cpu.weightonly import Q4_CODES_FILE, WEIGHT_QUANTS
from dflash_cli.engine.device import pick_device, pick_dtype
from dflash_cli.engine.dflash2 import drafter_class
from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig
from dflash_cli.engine.errors import CheckpointError, InvalidSettingError
from dflash_cli.engine.pairing import check_pair, check_target_config, read_config, safetensors_files
from dflash_cli.engine.quant import bnb_config, check_quant, quantize_linears
from dflash_cli.engine.target import Target


def read_drafter_config(folder: Path) -> DrafterConfig:
    return DrafterConfig.from_dict(read_config(folder, "drafter"), source=str(Path(folder) / "config.json"))


def _read_state_dict(files: list[Path], expected: dict[str, torch.Size], device: torch.device,
                     dtype: torch.dtype, folder: Path, transformers_format: bool = False) -> dict[str, torch.Tensor]:
    """Reads every tensor of `expected` (our names) from the checkpoint, strictly; errors name the tensor
    as the checkpoint spells it. A transformers-format checkpoint's names are mapped from its own header."""
    from safetensors import SafetensorError, safe_open

    from dflash_cli.engine.hf_format import checkpoint_names, their_name

    tensors: dict[str, torch.Tensor] = {}
    prefix, path = "", None
    try:
        handles = []
        for path in files:
            handles.append((path, safe_open(str(path), framework="pt", device="cpu")))
        if transformers_format:
            prefix, ours = checkpoint_names([k for _, f in handles for k in f.keys()])
        for path, f in handles:
            for key in f.keys():
                if key == DRAFT_VOCAB and not transformers_format:
                    continue  # optional; read and checked by _read_draft_vocab
                name = ours[key] if transformers_format else key
                if name not in expected:
                    raise CheckpointError(f"{path}: unexpected tensor {key!r} (not part of this drafter's config)")
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(expected[name]):
                    raise CheckpointError(
                        f"{path}: tensor {key!r} has shape {list(shape)}, the config implies {list(expected[name])}")
                tensors[name] = f.get_tensor(key).to(device=device, dtype=dtype)
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})",
                              hint="the download may be truncated: delete it and fetch it again") from None
    missing = sorted(set(expected) - set(tensors))
    if transformers_format:
        missing = [their_name(m, prefix) for m in missing]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"drafter folder {folder} is missing tensor {', '.join(map(repr, missing[:3]))}{more}")
    return tensors


DRAFT_VOCAB = "draft_vocab"


def _read_draft_vocab(files: list[Path], cfg: DrafterConfig, device: torch.device) -> torch.Tensor | None:
    """The optional `draft_vocab` tensor (docs/format.md section 3): sorted, distinct token ids of the
    vocabulary, which the drafter drafts from. Checked strictly when present."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if DRAFT_VOCAB not in f.keys():
                continue
            ids = f.get_tensor(DRAFT_VOCAB)
        bad = None
        vocab = cfg.raw.get("vocab_size")
        if cfg.is_dflash2:
            bad = "is for DFlash v1 drafters only (a DFlash 2 selector walks the whole vocabulary)"
        elif ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1 or len(ids) == 0:
            dtype = str(ids.dtype).removeprefix("torch.")
            bad = f"must be a non-empty 1-D integer tensor, got {dtype} {list(ids.shape)}"
        elif len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            bad = "must hold distinct token ids in increasing order"
        elif int(ids[0]) < 0 or (vocab is not None and int(ids[-1]) >= int(vocab)):
            bad = f"holds ids outside the vocabulary [0, {vocab})"
        if bad:
            raise CheckpointError(f"{path}: tensor {DRAFT_VOCAB!r} {bad}")
        return ids.to(device=device, dtype=torch.long)
    return None


def load_drafter(folder: str | Path, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | str | None = None, quant: str | None = None) -> DFlashDrafter:
    """Loads a drafter folder (config.json + safetensors), strictly: every tensor, every shape.

    Args:
        folder: a local folder in the public DFlash checkpoint format (DFlashDraftModel or
            DFlash2DraftModel) or in transformers' format (muse_glimmer_assistant), told apart by config.json.
        device: defaults to cuda when available, else cpu.
        dtype: defaults to bf16 on GPUs and fast-bf16 CPUs, else fp32.
        quant: None, "int8" or "nf4" (bitsandbytes) for the draft layers (never the DFlash 2 selector).
    """
    folder = Path(folder)
    device = pick_device(str(device) if device is not None else None)
    dtype = dtype if isinstance(dtype, torch.dtype) else pick_dtype(dtype, device)
    quant = check_quant(quant)
    if quant in WEIGHT_QUANTS:
        raise InvalidSettingError(f"--quant {quant} is for targets; a drafter stays 16/32-bit",
                                  hint="4-bit drafters lose most of their acceptance; leave the drafter unquantized")
    cfg = read_drafter_config(folder)
    files = safetensors_files(folder, "drafter")
    with torch.device("meta"):
        model = drafter_class(cfg)(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = _read_state_dict(files, expected, device, dtype, folder, cfg.source_format == "transformers")
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.source_format != "transformers":
        model.draft_vocab = _read_draft_vocab(files, cfg, device)
    model.init_rotary(device)
    if quant:
        quantize_linears(model.layers, quant, dtype, device)
    return model.eval().requires_grad_(False)


def _load_kwargs(folder: Path, device: torch.device, dtype: torch.dtype, quant: str | None,
                 layer_devices: Sequence[str] | None, offload_dir: str | Path | None) -> tuple[dict[str, Any], Any]:
    """from_pretrained's arguments for a target (placement, offload folder, bitsandbytes), and the temporary
    offload folder made for it (None without disk offload)."""
    kwargs: dict[str, Any] = dict(dtype=dtype, device_map=str(device), trust_remote_code=False,
                                  use_safetensors=True)
    offloaded = None
    if layer_devices is not None:
        kwargs["device_map"] = split_map(folder, layer_devices, str(device))
        if "disk" in layer_devices:
            if offload_dir is not None:
                Path(offload_dir).mkdir(parents=True, exist_ok=True)
            offloaded = tempfile.TemporaryDirectory(prefix="dflash-offload-", dir=offload_dir)
            kwargs["offload_folder"] = offloaded.name
    if quant:
        offload = layer_devices is not None and any(d in ("cpu", "disk") for d in layer_devices)
        kwargs["quantization_config"] = bnb_config(quant, dtype, offload=offload)
    return kwargs, offloaded


def load_target(folder: str | Path, *, device: torch.device | str | None = None,
                dtype: torch.dtype | str | None = None, quant: str | None = None,
                layer_devices: Sequence[str] | None = None, offload_dir: str | Path | None = None,
                by_layer: bool = False) -> Target:
    """Loads a causal LM from a local folder through transformers' AutoModelForCausalLM.

    Args:
        folder: a local Hugging Face checkpoint folder with safetensors weights.
        device: defaults to cuda when available, else cpu. With `layer_devices`, the hot device: the
            embeddings, final norm and LM head go there (the drafter goes there too).
        dtype: compute dtype; defaults to bf16 on GPUs and fast-bf16 CPUs, else fp32.
        quant: None, "int8" or "nf4" to quantize the linear layers with bitsandbytes (GPUs); "q4" or "q8" for
            PyTorch's weight-only CPU kernels, applied when the fast path is enabled (engine/cpu/weightonly.py),
            with the 4-bit codes of `Q4_CODES_FILE` when the folder has one (a GGUF's own).
        layer_devices: the device of each decoder layer ("cuda:1", "cpu", "disk"), as models/memory/split.py
            plans them; accelerate offloads the layers on cpu (when the hot device is a GPU) and disk.
        offload_dir: where disk-offloaded weights go (in a temporary folder inside it, removed with the
            target); default: the system's temporary folder, which is often in RAM (tmpfs).
        by_layer: with a CPU `quant` (q4, q8, q4a8, q8a8), quantize each decoder layer as it loads where the
            checkpoint allows (engine/layerwise.py): the full-precision weights are never all in memory, and
            the target runs on the fast path only (the CLI's choice unless --compile off).
    """
    folder = Path(folder)
    device = pick_device(str(device) if device is not None else None)
    quant = check_quant(quant)
    dtype = dtype if isinstance(dtype, torch.dtype) else pick_dtype(dtype, device, quant)
    weight_quant = quant if quant in WEIGHT_QUANTS else None
    if weight_quant is not None:
        quant = None
        if device.type != "cpu" or layer_devices is not None:
            raise InvalidSettingError(f"--quant {weight_quant} runs on one CPU (weight-only CPU kernels)",
                                      hint="on a GPU use --quant nf4 or int8 (bitsandbytes)")
    config = read_config(folder, "target")
    check_target_config(config, str(folder))
    files = safetensors_files(folder, "target")
    codes = folder / Q4_CODES_FILE
    codes_file = codes if weight_quant in ("q4", "q4a8") and codes.is_file() else None
    if by_layer and weight_quant is not None and text_model_class(config) is None:
        from dflash_cli.engine.layerwise import load_by_layer

        loaded = load_by_layer(folder, files, config, dtype, weight_quant, codes_file)
        if loaded is not None:
            target = _target_of(loaded[0], folder, weight_quant, codes_file)
            target.quantized_layers, target.dense_freed = loaded[1], True
            return target
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    kwargs, offloaded = _load_kwargs(folder, device, dtype, quant, layer_devices, offload_dir)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    # accelerate warns that offloaded weights wait on `meta`: the load line says so (Target.placement)
    accelerate_log = logging.getLogger("accelerate.big_modeling")
    accelerate_level = accelerate_log.level
    accelerate_log.setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # the UI shows its own progress
    from safetensors import SafetensorError

    model_class: Any = AutoModelForCausalLM
    text_only = text_model_class(config)
    if text_only is not None:  # a multimodal checkpoint: its language model alone
        model_class, kwargs["key_mapping"] = text_only
    try:
        model = model_class.from_pretrained(str(folder), **kwargs)
    except SafetensorError as e:
        raise CheckpointError(f"cannot load target from {folder}: a weights file is damaged ({e})",
                              hint="the download may be truncated: delete it and fetch it again") from None
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot load target from {folder}: {first}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
        accelerate_log.setLevel(accelerate_level)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval().requires_grad_(False)
    target = _target_of(model, folder, weight_quant, codes_file)
    target.offload_dir = offloaded  # removed with the target
    return target


def _target_of(model: Any, folder: Path, weight_quant: str | None, codes_file: Path | None) -> Target:
    logging.getLogger(__name__).debug("loaded %s as %s", folder, type(model).__name__)
    target = Target(model, name=str(folder))
    target.weight_quant = weight_quant
    target.q4_codes_file = codes_file
    return target


def split_map(folder: Path, layer_devices: Sequence[str], hot: str) -> dict[str, str]:
    """The module map for transformers' `device_map=`: built on an empty (meta) model of the checkpoint's
    config, each decoder layer on its planned device, the rest on the hot device."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_cli.engine.placement import module_map
    from dflash_cli.engine.target import decoder_layers

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    text_only = text_model_class(config.to_dict())
    with init_empty_weights():
        if text_only is not None:  # the class load_target loads (its module names)
            empty = text_only[0](config.get_text_config())
        else:
            empty = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return module_map(empty, decoder_layers(empty), layer_devices, hot)


# Multimodal checkpoints whose language model loads alone: the text class, and how the checkpoint's tensor
# names map to it (transformers' AutoModelForCausalLM would load Gemma 4's vision tower too; Qwen3.5's
# multimodal checkpoints already load text-only through transformers' own mapping).
TEXT_ONLY = {"gemma4": ("Gemma4ForCausalLM", {r"^model\.language_model\.": "model."})}


def text_model_class(config: dict[str, Any]) -> tuple[Any, dict[str, str]] | None:
    """(text-only class, key mapping) for a multimodal target config that has one, else None."""
    entry = TEXT_ONLY.get(str(config.get("model_type")))
    if entry is None:
        return None
    import transformers

    return getattr(transformers, entry[0]), dict(entry[1])


@dataclass
class Pair:
    target: Target
    drafter: DFlashDrafter | None


def attach_drafter(target: Target, drafter: DFlashDrafter, *, drafter_name: str = "drafter") -> None:
    """Checks the pair against the loaded target's real shapes and makes the target tap the right layers."""
    taps = check_pair(target.config.to_dict(), drafter.config, target_name=target.name,
                      drafter_name=drafter_name, vocab_rows=target.vocab_rows)
    target.set_taps(taps)
    drafter.embed_scale = target.embed_scale  # Gemma's block embeddings are scaled as the target's are


def load_pair(target_folder: str | Path, drafter_folder: str | Path | None, *,
              device: torch.device | str | None = None, dtype: torch.dtype | str | None = None,
              quant: str | None = None, drafter_quant: str | None = None,
              layer_devices: Sequence[str] | None = None, offload_dir: str | Path | None = None,
              by_layer: bool = False) -> Pair:
    """Loads a target and (optionally) its drafter, checking the pairing from configs before any weights.

    With `layer_devices` (a split, see load_target) the drafter goes on the hot device `device`, beside
    the target's embeddings and LM head, which it uses on every draft. `by_layer`: see load_target."""
    device = pick_device(str(device) if device is not None else None)
    dtype = dtype if isinstance(dtype, torch.dtype) else pick_dtype(dtype, device, check_quant(quant))
    drafter_cfg = None
    if drafter_folder is not None:
        drafter_cfg = read_drafter_config(Path(drafter_folder))
        check_pair(read_config(Path(target_folder), "target"), drafter_cfg,
                   target_name=str(target_folder), drafter_name=str(drafter_folder))
    target = load_target(target_folder, device=device, dtype=dtype, quant=quant, layer_devices=layer_devices,
                         offload_dir=offload_dir, by_layer=by_layer)
    drafter = None
    if drafter_folder is not None:
        drafter = load_drafter(drafter_folder, device=target.device, dtype=dtype, quant=drafter_quant)
        attach_drafter(target, drafter, drafter_name=str(drafter_folder))
    return Pair(target, drafter)


def save_drafter(drafter: DFlashDrafter, folder: str | Path, *, format: str = "dflash") -> Path:
    """Writes a drafter as config.json + model.safetensors (what load_drafter reads).

    format: "dflash" (the z-lab checkpoint format) or "transformers" (muse_glimmer_assistant, which
    transformers' MuseGlimmerAssistantModel loads; v1 drafters only).
    """
    import json

    from dflash_cli.engine.files import save_tensors
    from dflash_cli.engine.hf_format import to_transformers_config, to_transformers_state_dict

    if format not in ("dflash", "transformers"):
        raise InvalidSettingError(f"unknown drafter format {format!r}", hint="use dflash or transformers")
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    if format == "transformers":
        config = to_transformers_config(drafter.config)
        tensors.pop(DRAFT_VOCAB, None)  # our extension; transformers' class has no such tensor
        tensors = to_transformers_state_dict(tensors)
    else:
        config = dict(drafter.config.raw)
        config.setdefault("architectures", [drafter.config.architecture])
        config.setdefault("model_type", "qwen3")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_tensors(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
