"""Every default, declared once, with the environment variable that overrides it.

Only this module reads the environment; the engine receives plain values.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MAX_TOKENS = 512
DEFAULT_TEMPERATURE = 0.0  # greedy: fastest with speculation, and reproducible
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_QUANT = "none"
DEFAULT_DTYPE = "auto"
DEFAULT_DEVICE = "auto"
DEFAULT_COLOR = "auto"

ENV = {
    "model": "DFLASH_MODEL",
    "draft": "DFLASH_DRAFT",
    "quant": "DFLASH_QUANT",
    "dtype": "DFLASH_DTYPE",
    "device": "DFLASH_DEVICE",
    "max_tokens": "DFLASH_MAX_TOKENS",
    "temperature": "DFLASH_TEMPERATURE",
    "top_p": "DFLASH_TOP_P",
    "top_k": "DFLASH_TOP_K",
    "seed": "DFLASH_SEED",
    "block_size": "DFLASH_BLOCK_SIZE",
    "system": "DFLASH_SYSTEM",
    "color": "DFLASH_COLOR",
    "no_history": "DFLASH_NO_HISTORY",
}
DEBUG_ENV = "DFLASH_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "no")


def data_dir() -> Path:
    """Where user data lives (chat history): $DFLASH_DATA_DIR, else $XDG_DATA_HOME/dflash-cli."""
    if os.environ.get("DFLASH_DATA_DIR"):
        return Path(os.environ["DFLASH_DATA_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "dflash-cli"


def history_path() -> Path:
    return data_dir() / "chat_history"
