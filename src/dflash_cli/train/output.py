"""The output folder: checked before a run, written after it (the drafter, its training record and log).

Layout (the drafter itself is what the engine loads like any published drafter):
    OUT/config.json, OUT/model.safetensors   the drafter (public DFlash format) + a `training` entry
    OUT/training_log.json                     every step's loss and every held-out evaluation
    OUT/data/                                 generated sequences + tapped features (resumable cache)
    OUT/checkpoint/latest.safetensors(+.json) drafter, optimizer, step, rng (resumable; no pickle)
    OUT/checkpoint/best.safetensors           the weights with the best held-out acceptance estimate so far
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.load import save_drafter
from dflash_cli.train.data import Example, read_index
from dflash_cli.train.trainer import Evaluation, State

CHECKPOINT = Path("checkpoint") / "latest.safetensors"


def check_output_folder(out_dir: Path, target_dir: Path) -> None:
    """Refuses, in one line and before anything loads or is written: an output folder that cannot be written,
    one whose training data another target generated (resuming would train on it and label the drafter with
    this target), and one holding a model no train run wrote there (a downloaded drafter, which training
    would overwrite)."""
    index = read_index(out_dir / "data") if (out_dir / "data").is_dir() else {}
    stored = (index.get("key") or {}).get("target") if index.get("shards") else None
    if stored is not None and Path(stored).expanduser().resolve() != target_dir.expanduser().resolve():
        raise InvalidSettingError(f"{out_dir} holds training data that {stored} generated, not {target_dir}",
                                  hint=f"train this target into another folder (-o), or pass -m {stored} to resume")
    ours = (out_dir / CHECKPOINT).exists() or (out_dir / "data").is_dir()
    theirs = (out_dir / "config.json").is_file() or any(out_dir.glob("*.safetensors")) if out_dir.is_dir() else False
    if theirs and not ours:
        raise InvalidSettingError(f"{out_dir} already holds a model that no train run wrote there: training would "
                                  "overwrite it", hint="write the new drafter to another folder (-o)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidSettingError(f"cannot create the output folder {out_dir}: {e.strerror or e}",
                                  hint="choose a folder you can write (-o)") from None
    if not os.access(out_dir, os.W_OK):
        raise InvalidSettingError(f"cannot write into the output folder {out_dir}",
                                  hint="choose a folder you can write (-o)")


def seconds_trained(out_dir: Path) -> float:
    """Training seconds the folder's checkpoint records (all runs), 0 without one."""
    meta = out_dir / CHECKPOINT.with_name(CHECKPOINT.name + ".json")
    return json.loads(meta.read_text())["state"]["seconds"] if meta.exists() else 0.0


@dataclass
class TrainResult:
    """A train run's drafter: where it was written and what its config's `training` entry records."""

    folder: Path  # load it with --draft FOLDER (or dflash_cli.load(target, draft=FOLDER))
    step: int  # optimizer steps trained, over all runs of the folder
    saved_step: int  # the step whose weights were written: the best held-out estimate's
    heldout_tau: float | None  # held-out acceptance estimate of those weights (greedy, full blocks)
    heldout_tau_by_set: dict[str, float] | None  # the same per prompt category, for the built-in sets
    final_loss: float  # mean training loss of the last 10 steps
    train_seconds: float  # training time, over all runs of the folder
    wall_seconds: float  # this run's time, generation included
    train_sequences: int
    heldout_sequences: int


def training_record(state: State, saved: Evaluation | None, train_set: list[Example],
                    held_set: list[Example]) -> dict[str, Any]:
    """What the drafter's config records about the fit that made it (`saved`: the evaluation whose weights
    the drafter holds)."""
    return dict(step=state.step, train_seconds=round(state.seconds, 1),
                train_sequences=len(train_set), heldout_sequences=len(held_set),
                train_tokens=sum(len(e.ids) - e.prompt_len for e in train_set),
                final_loss=sum(state.losses[-10:]) / max(len(state.losses[-10:]), 1),
                saved_step=saved[0] if saved else state.step,
                heldout_tau=saved[2] if saved else None,
                heldout_tau_by_set=saved[3] if saved and len(saved) > 3 and saved[3] else None,
                last_heldout_tau=state.evals[-1][2] if state.evals else None)


def write_drafter(out_dir: Path, drafter: DFlashDrafter, raw: dict, draft_vocab: torch.Tensor | None,
                  dtype: torch.dtype, drafter_format: str, state: State, wall_seconds: float) -> TrainResult:
    """Writes the drafter with the config `raw` (its `training` entry complete) and the training log."""
    drafter.config.raw.clear()
    drafter.config.raw.update(raw)
    drafter.draft_vocab = draft_vocab
    save_drafter(drafter.to(dtype), out_dir, format=drafter_format)
    (out_dir / "training_log.json").write_text(json.dumps(
        {"losses": state.losses, "evals": state.evals, "wall_seconds": wall_seconds}))
    record = raw["training"]
    return TrainResult(out_dir, record["step"], record["saved_step"], record["heldout_tau"],
                       record["heldout_tau_by_set"], record["final_loss"], record["train_seconds"], wall_seconds,
                       record["train_sequences"], record["heldout_sequences"])
