"""Checks that need only config.json files: can this target run, and does this drafter fit it.

Used before loading weights (and, by the model manager, before downloading them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflash_cli.engine.errors import CheckpointError, IncompatiblePairError, UnsupportedModelError
from dflash_cli.engine.hf_config import DrafterConfig, text_config

# weight files in pickle formats, which can run code when loaded: never loaded, never downloaded
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def read_config(folder: Path, what: str) -> dict[str, Any]:
    """The config.json of the `what` ("target", "drafter") folder `folder`, checked as read_config_file does."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"{what} folder {folder} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{what} folder {folder} has no config.json")
    return read_config_file(path)


def read_config_file(path: Path) -> dict[str, Any]:
    """A config.json file as a dict: the one reader, so every command words a bad file the same way."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a model configuration (expected a JSON object)")
    return config


def safetensors_files(folder: Path, what: str) -> list[Path]:
    """The safetensors weight files of a checkpoint folder; refuses folders with only pickle weights."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"{what} folder {folder} is incomplete: missing {', '.join(missing)}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    for path in files:
        if path.is_symlink() and not path.exists():  # a dangling link (a Hub cache whose blob was deleted)
            raise CheckpointError(f"{path} links to {os.readlink(path)}, which does not exist",
                                  hint="the download is incomplete: delete the folder and fetch it again")
        if path.exists() and not path.is_file():
            raise CheckpointError(f"{path} is not a regular file",
                                  hint="point the folder's weights at a real safetensors file")
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{what} folder {folder} holds only pickle weights ({', '.join(pickles)})",
            hint="dflash-cli loads safetensors only, since pickle files can run code; "
                 "use a repository that publishes model.safetensors",
        )
    raise CheckpointError(f"{what} folder {folder} has no weights (no *.safetensors file)")


# hybrids whose linear-attention state the fast path rolls back exactly (engine/linear_attention.py):
# Qwen3.5/3.6 (dense and MoE, multimodal and text-only) and Qwen3-Next (Qwen3-Coder-Next)
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
#: what the memory planner (models/memory/sizes.py) and the loader read from a target's config.json
TARGET_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


def check_target_config(config: dict[str, Any], name: str) -> None:
    """Refuses configs that lack a field the planner or loader needs, and targets whose cache cannot be
    rolled back to an accepted length."""
    source = f"{name}/config.json"
    if not isinstance(config, dict) or not isinstance(config.get("text_config") or {}, dict):
        raise CheckpointError(f"{source} is not a model configuration (expected a JSON object)")
    cfg = text_config(config)
    for key in TARGET_FIELDS:
        if key == "intermediate_size" and "intermediate_size" not in cfg and cfg.get("moe_intermediate_size"):
            key = "moe_intermediate_size"  # a mixture of experts with no dense MLP layer
        value = cfg.get(key)
        if value is None:
            raise CheckpointError(f"{source}: required field {key!r} is missing",
                                  hint="the folder is incomplete or not a transformers causal LM: "
                                       "download the model again")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{source}: field {key!r} must be a positive integer, not {value!r}")
    kinds = set(cfg.get("layer_types") or [])
    recurrent = kinds & {"linear_attention", "mamba", "conv", "recurrent"}
    if recurrent == {"linear_attention"} and cfg.get("model_type") in HYBRID_MODEL_TYPES:
        return
    if recurrent:
        raise UnsupportedModelError(
            f"{name} has {', '.join(sorted(recurrent))} layers whose state cannot be rolled back after a "
            "rejected draft; such hybrid targets are not supported yet",
            hint="use a target with attention layers only (Qwen3, Llama 3, ...)",
        )


def check_pair(target_config: dict[str, Any], drafter: DrafterConfig, *, target_name: str = "target",
               drafter_name: str = "drafter", vocab_rows: int | None = None) -> list[int]:
    """Checks a drafter against a target and returns the target layers to tap.

    `vocab_rows` is the real number of rows of the target's embedding matrix, when known.
    """
    cfg = text_config(target_config)
    both = f"drafter {drafter_name} and target {target_name}"
    hidden = cfg.get("hidden_size")
    if hidden != drafter.hidden_size:
        raise IncompatiblePairError(
            f"{both} do not match: the drafter has hidden size {drafter.hidden_size}, the target {hidden}",
            hint="a drafter is trained for one target: pick the drafter made for this target",
        )
    depth = cfg.get("num_hidden_layers")
    taps = drafter.tap_layers(depth)
    bad = [t for t in taps if depth is not None and not 0 <= t < depth]
    if bad:
        assert depth is not None  # a tap is out of range only against a known depth
        raise IncompatiblePairError(
            f"{both} do not match: the drafter taps target layers {taps}, "
            f"but the target has {depth} layers (0..{depth - 1})")
    if drafter.num_target_layers is not None and depth is not None and drafter.num_target_layers != depth:
        raise IncompatiblePairError(
            f"{both} do not match: the drafter was trained on a {drafter.num_target_layers}-layer target, "
            f"this one has {depth} layers")
    rows = vocab_rows if vocab_rows is not None else cfg.get("vocab_size")
    if rows is not None and not 0 <= drafter.mask_token_id < rows:
        raise IncompatiblePairError(
            f"{both} do not match: the drafter's mask token id {drafter.mask_token_id} is outside the "
            f"target's embedding matrix ({rows} rows)")
    codebook = drafter.raw.get("vocab_size")
    if drafter.is_dflash2 and rows is not None and codebook != rows:
        raise IncompatiblePairError(
            f"{both} do not match: the drafter's selector has codebooks for {codebook} tokens, "
            f"the target's vocabulary has {rows}",
            hint="a drafter is trained for one target: pick the drafter made for this target")
    return taps
