"""Distilling a DFlash drafter for a local target (train/api.py):

    from dflash_cli.train import TrainConfig, train_drafter
    result = train_drafter("./target", "./drafter", TrainConfig(steps=2000), prompts="mix:3000")
    print(result.folder, result.heldout_tau)                # or train_drafter(..., steps=2000): the same

Importing this package is cheap: torch loads with the names that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_EXPORTS = {"train_drafter": "dflash_cli.train.api", "TrainConfig": "dflash_cli.train.config",
            "TrainResult": "dflash_cli.train.output"}
__all__ = ["train_drafter", "TrainConfig", "TrainResult"]

if TYPE_CHECKING:
    from dflash_cli.train.api import train_drafter
    from dflash_cli.train.config import TrainConfig
    from dflash_cli.train.output import TrainResult


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_cli.train' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
