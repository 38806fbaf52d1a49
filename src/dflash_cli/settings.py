"""Every default, declared once, with the environment variable that overrides it.

dflash-cli's own variables (DFLASH_*, and the XDG folders they fall back to) are read only here; the
engine receives plain values. Variables of other tools are read where they are used: Hugging Face's
(HF_*) by models/folders.py, ui/download_progress.py and the doctor, the terminal's (NO_COLOR, TERM) by
ui/render.py; their on/off flags all read through :func:`env_flag`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MAX_TOKENS = 512
DEFAULT_BENCH_MAX_TOKENS = 128  # per prompt and mode: enough for tau, short enough for a set in minutes
DEFAULT_TEMPERATURE = 0.0  # greedy: fastest with speculation, and reproducible
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_QUANT = None  # "none", except for the built-in models: "auto" (q4 on CPUs where it measured fastest)
DEFAULT_DTYPE = "auto"
DEFAULT_DEVICE = "auto"
DEFAULT_COLOR = "auto"
DEFAULT_MAX_CONTEXT = 8192
DEFAULT_COMPILE = "auto"  # compile the fast path where it pays (engine/compile.py)
DEFAULT_DEVICE_MAP = "none"  # one device; auto/balanced/sequential split the target (models/memory/split.py)

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
    "max_context": "DFLASH_MAX_CONTEXT",
    "compile": "DFLASH_COMPILE",
    "hide_thinking": "DFLASH_HIDE_THINKING",
    "engine": "DFLASH_ENGINE",
    "timeout": "DFLASH_TIMEOUT",
    "device_map": "DFLASH_DEVICE_MAP",
    "max_memory": "DFLASH_MAX_MEMORY",
    "threads": "DFLASH_THREADS",
    "draft_window": "DFLASH_DRAFT_WINDOW",
    "format": "DFLASH_FORMAT",
    "schema": "DFLASH_SCHEMA",
    "grammar": "DFLASH_GRAMMAR",
    "regex": "DFLASH_REGEX",
}
API_KEY_ENV = "DFLASH_API_KEY"  # the bearer token for --engine (vLLM and SGLang --api-key)
DEBUG_ENV = "DFLASH_DEBUG"


# huggingface_hub's ENV_VARS_TRUE_VALUES (not imported: the doctor reports on a broken huggingface_hub too)
TRUE_WORDS = frozenset({"1", "ON", "YES", "TRUE"})


def env_flag(name: str) -> bool:
    """Whether the on/off variable `name` is on, as huggingface_hub reads its flags (1, on, yes, true)."""
    return os.environ.get(name, "").strip().upper() in TRUE_WORDS


def api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def debug_enabled() -> bool:
    return env_flag(DEBUG_ENV)


def data_dir() -> Path:
    """Where user data lives (chat history): $DFLASH_DATA_DIR, else $XDG_DATA_HOME/dflash-cli."""
    if os.environ.get("DFLASH_DATA_DIR"):
        return Path(os.environ["DFLASH_DATA_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "dflash-cli"


def cache_dir() -> Path:
    """Where converted models and compiled kernels live: $DFLASH_CACHE_DIR, else $XDG_CACHE_HOME/dflash-cli."""
    explicit = os.environ.get("DFLASH_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dflash-cli"


def history_path() -> Path:
    return data_dir() / "chat_history"


# -- the config file ---------------------------------------------------------------------------------

CONFIG_ENV = "DFLASH_CONFIG"
# key -> type of the value in the file; every key is also an option of generate/chat (same name).
CONFIG_KEYS: dict[str, type | tuple[type, ...]] = {
    "model": str, "draft": str, "quant": str, "dtype": str, "device": str, "max_tokens": int,
    "temperature": (int, float), "top_p": (int, float), "top_k": int, "seed": int, "block_size": int,
    "system": str, "color": str, "provenance": bool, "max_context": int, "compile": str,
    "hide_thinking": bool, "engine": str, "device_map": str, "max_memory": str, "timeout": (int, float),
    "threads": int, "draft_window": int, "format": str, "schema": str, "grammar": str, "regex": str,
}


class ConfigError(Exception):
    """The config file cannot be used. It is never rewritten by dflash-cli. Every config problem (a bad
    value, a malformed or unreadable file, a folder where the file should be) is a usage error (exit 2), as
    the same value in a flag or a DFLASH_* variable is."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 2):
        super().__init__(message)
        self.hint = hint
        self.exit_code = exit_code


@dataclass(frozen=True)
class Config:
    path: Path
    values: dict[str, Any] = field(default_factory=dict)
    pairs: dict[str, Any] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)  # key -> its line in the file

    def where(self, key: str) -> str:
        """'config file PATH, line N' for a top-level key, to name in an error."""
        line = self.lines.get(key)
        return f"config file {self.path}" + (f", line {line}" if line else "")

    def default_map(self) -> dict[str, dict[str, Any]]:
        """click's default_map: config values become option defaults (flags and env vars still win)."""
        model_keys = {k: v for k, v in self.values.items()
                      if k in ("model", "draft", "quant", "dtype", "device", "max_context", "block_size", "color",
                               "compile", "engine", "device_map", "max_memory", "timeout", "threads",
                               "draft_window")}
        return {"generate": dict(self.values), "chat": dict(self.values), "bench": model_keys}


def config_path() -> Path:
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dflash-cli" / "config.toml"


def load_config(path: Path | None = None) -> Config:
    """Reads the TOML config file; a missing file is an empty config."""
    import tomllib

    named = path is None and bool(os.environ.get(CONFIG_ENV))
    path = path or config_path()
    if not path.is_file():
        what = ("a folder" if path.is_dir() else "a link to nothing" if path.is_symlink() and not path.exists()
                else "missing" if not path.exists() else "not a file")
        if named:
            raise ConfigError(f"{CONFIG_ENV} names {path}, which is {what}",
                              f"point {CONFIG_ENV} at a TOML file, or unset it", exit_code=2)
        if path.exists() or path.is_symlink():  # a folder, a dangling link, a device: not silently ignored
            raise ConfigError(f"config file {path} is {what}", "remove it or make it a TOML file", exit_code=2)
        return Config(path)
    hint = f"fix or remove {path} (dflash-cli never rewrites it)"
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}", hint) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})", hint) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}", hint) from None
    pairs = data.pop("pairs", {})
    if not isinstance(pairs, dict):
        raise ConfigError(f"config file {path}: [pairs] must be a table of tables", hint)
    config = Config(path, data, pairs, _key_lines(text))
    for key, value in data.items():
        expected = CONFIG_KEYS.get(key)
        if expected is None:
            raise ConfigError(f"{config.where(key)}: unknown key {key!r}",
                              f"known keys: {', '.join(CONFIG_KEYS)}, and [pairs.NAME] tables")
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise ConfigError(f"{config.where(key)}: {key} = {value!r} has the wrong type (expected "
                              f"{_TYPE_NAMES.get(expected, 'a number')})", hint)
    return config


_TYPE_NAMES: dict[object, str] = {str: "a string", int: "an integer", bool: "true or false"}


def _key_lines(text: str) -> dict[str, int]:
    """The line of each top-level `key = value` (tomllib does not report positions)."""
    import re

    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("["):
            break  # the top-level keys end at the first table
        match = re.match(r"\s*([A-Za-z0-9_-]+)\s*=", line)
        if match:
            lines.setdefault(match.group(1), number)
    return lines
