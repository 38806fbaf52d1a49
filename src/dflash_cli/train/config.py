"""TrainConfig: every training option with its default and its check, for the Python API and `train` alike
(ui/train_cmd.py takes its defaults and ranges from here). Imports no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from dflash_cli.engine.errors import InvalidSettingError

DEFAULT_LAYERS = 2  # a new drafter's shape, where neither --init nor a resumed checkpoint gives one
DEFAULT_BLOCK_SIZE = 16
DEFAULT_STEPS = 1000  # when neither steps nor a time budget is given
FORMATS = ("dflash", "transformers")


class Bound(NamedTuple):
    """A numeric option's range (None, where an option allows it, is always accepted)."""

    flag: str  # how an error names the option: its command-line flag, or its keyword where it has none
    low: float
    low_open: bool = False  # `low` itself is refused
    high: float | None = None


def _bounded(default: Any, flag: str, low: float, *, low_open: bool = False, high: float | None = None) -> Any:
    return field(default=default, metadata={"bound": Bound(flag, low, low_open, high)})


REPLY_FORMATS = ("fp32", "bf16", "q4", "q8", "q4a8", "q8a8")


@dataclass
class TrainConfig:
    """How to train a drafter (times in seconds). Made checked: a bad value raises InvalidSettingError."""

    # the drafter's shape; None: --init's or the resumed checkpoint's, else DEFAULT_LAYERS, DEFAULT_BLOCK_SIZE
    # and taps spread over the target (train/shape.py)
    layers: int | None = _bounded(None, "--layers", 1)
    block_size: int | None = _bounded(None, "--block-size", 2)
    taps: list[int] | None = None
    # the data: the target's replies to the prompts (train/data.py)
    max_new_tokens: int = _bounded(200, "--max-new-tokens", 2)
    gen_batch: int | None = _bounded(None, "--gen-batch", 1)  # None: 128 rows batched, 16 via transformers
    gen_time_budget: float | None = _bounded(None, "--gen-budget", 0)  # this run's; None: answer every prompt
    distill_topk: int = _bounded(0, "--distill-topk", 0)  # the target's k likeliest tokens stored per position
    # the format the batched generator writes the replies in (train/batched.py); None: its own rule
    reply_format: str | None = None
    # the fit (train/trainer.py)
    steps: int | None = _bounded(None, "--steps", 1)  # None: DEFAULT_STEPS, unless a time budget is given
    time_budget: float | None = _bounded(None, "--time-budget", 0, low_open=True)  # all runs of the folder
    lr: float = _bounded(6e-4, "--lr", 0)
    min_lr_ratio: float = _bounded(0.1, "min_lr_ratio", 0, high=1)
    warmup: int | None = _bounded(None, "warmup", 1)  # None: a 20th of the steps, at most 50
    batch: int = _bounded(4, "--batch", 1)
    anchors: int = _bounded(16, "--anchors", 1)
    gamma: float = _bounded(7.0, "gamma", 0, low_open=True)
    weight_decay: float = _bounded(0.01, "weight_decay", 0)
    distill: float = _bounded(0.0, "--distill", 0, high=1)  # weight of the top-k KL term (0 = hard labels only)
    sub_vocab: bool = True  # the loss over the tokens of the replies only
    checkpoint_every: int = _bounded(100, "checkpoint_every", 1)
    eval_every: int = _bounded(50, "eval_every", 1)
    seed: int = 0
    # the drafter written
    draft_vocab: bool = False  # ship the training vocabulary as the drafter's draft vocabulary
    drafter_format: str = "dflash"

    def __post_init__(self) -> None:
        if self.taps is not None:
            self.taps = list(self.taps)  # any sequence given, compared with --init's and stored as a list
        for f in fields(self):
            value = getattr(self, f.name)
            if "bound" in f.metadata and value is not None:
                check_bound(f.metadata["bound"], value)
        if self.steps is not None and self.time_budget is not None:
            raise InvalidSettingError("give --steps or --time-budget, not both")
        if self.distill > 0 and self.distill_topk == 0:
            raise InvalidSettingError("--distill needs the target's top-k distributions", hint="add --distill-topk 32")
        if self.draft_vocab and not self.sub_vocab:
            raise InvalidSettingError("--draft-vocab needs the training vocabulary", hint="drop --full-vocab")
        if self.reply_format not in (None, *REPLY_FORMATS):
            raise InvalidSettingError(f"unknown reply format {self.reply_format!r}",
                                      hint=f"use {', '.join(REPLY_FORMATS)} or auto")
        if self.drafter_format not in FORMATS:
            raise InvalidSettingError(f"unknown drafter format {self.drafter_format!r}",
                                      hint=f"use {' or '.join(FORMATS)}")

    @property
    def total_steps(self) -> int | None:
        """The step training stops at: `steps`, else DEFAULT_STEPS, or None when only the time budget stops it."""
        return DEFAULT_STEPS if self.steps is None and self.time_budget is None else self.steps

    def finished(self, step: int, seconds: float) -> bool:
        """Whether a training at `step` after `seconds` (over all runs) is done."""
        if self.total_steps is not None and step >= self.total_steps:
            return True
        return self.time_budget is not None and seconds >= self.time_budget

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(50, max(1, (self.total_steps or DEFAULT_STEPS) // 20))


def check_bound(bound: Bound, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidSettingError(f"{bound.flag} must be a finite number, got {value}")
    if bound.high is not None and not bound.low <= value <= bound.high:
        raise InvalidSettingError(f"{bound.flag} must be between {bound.low} and {bound.high}, got {value}")
    if value < bound.low or (bound.low_open and value == bound.low):
        least = "more than" if bound.low_open else "at least"
        raise InvalidSettingError(f"{bound.flag} must be {least} {bound.low}, got {value}")


def bound(name: str) -> Bound:
    """The range TrainConfig checks the option `name` against."""
    return next(f.metadata["bound"] for f in fields(TrainConfig) if f.name == name)
