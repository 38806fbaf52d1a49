"""Writing safetensors files that others may read: safetensors creates them 0600 whatever the umask."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def umask_mode() -> int:
    """The mode a plain new file gets here (0o644 under the usual umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, then the mode an ordinary file gets (a drafter folder can be shared as is)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, umask_mode())
