"""Distilling a DFlash drafter for a local target: `train_drafter` (see train/api.py)."""

from __future__ import annotations


def __getattr__(name: str):  # keeps `import dflash_cli.train` free of torch
    if name == "train_drafter":
        from dflash_cli.train.api import train_drafter

        return train_drafter
    raise AttributeError(name)


__all__ = ["train_drafter"]
