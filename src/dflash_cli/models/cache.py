"""The local Hugging Face cache: offline lookup of a snapshot, the safetensors check, listing and removal.

Everything goes through huggingface_hub's own layout (one cache, the standard `models--org--name` folders);
this module never prints and never uses the network. Failures surface as typed `DFlashError`s with a
one-line message and a hint. Where the cache is: models/folders.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cli.engine.errors import CheckpointError, DFlashError
from dflash_cli.engine.pairing import PICKLE_SUFFIXES
from dflash_cli.models.folders import cache_path, removal_error, remove_path, storage_folder, undeletable

# Files a pull fetches, so what a complete snapshot holds: configs, tokenizer, chat templates and safetensors
# weights. Never code or pickles.
ALLOW_PATTERNS: list[str] = [
    "*.json",  # config.json, tokenizer_config.json, ...
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "vocab*",
    "merges.txt",
    "*.jinja",
    "*.safetensors",
]
# Applied after ALLOW_PATTERNS: "tokenizer*" or "vocab*" must never let a `tokenizer.py` through.
IGNORE_PATTERNS: list[str] = ["*.py", "*.pyc"] + [f"*{s}" for s in PICKLE_SUFFIXES]
CONFIG_FILES = ("config.json", "generation_config.json")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


# ----------------------------------------------------------------------------------------------- errors
class HubError(DFlashError):
    """Something about a Hub repository or the connection to the Hub."""


class NotDownloadedError(HubError):
    """Offline, and the requested repository (or some of its files) is not in the local cache."""


class CorruptWeightsError(CheckpointError):
    """A downloaded safetensors file is truncated or its header is malformed."""


# ----------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class LocalRepo:
    repo_id: str
    revisions: tuple[str, ...]  # commit hashes
    refs: tuple[str, ...]  # branch/tag names pointing at one of them
    size_on_disk: int
    last_modified: float  # POSIX timestamp
    path: Path
    status: str = "ok"  # "ok"; "partial": files a run needs are not downloaded; "damaged": unusable as it is
    problem: str | None = None  # what is wrong, for "partial" and "damaged"


# ----------------------------------------------------------------------------------------------- offline
def not_downloaded(repo_id: str, revision: str | None, missing: list[str] | None = None) -> NotDownloadedError:
    """The NotDownloadedError for `repo_id` (or the files of it that are `missing`), with the pull to run."""
    what = f"{repo_id}" + (f" (revision {revision})" if revision and revision != "main" else "")
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        msg = f"{what} is only partly downloaded: missing {shown}"
    else:
        msg = f"{what} is not downloaded"
    pin = f" --revision {revision}" if revision and revision != "main" else ""
    return NotDownloadedError(msg, hint=f"run `dflash-cli pull {repo_id}{pin}` (needs the network)")


def local_snapshot(repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None,
                   validate: bool = True) -> Path:
    """The cached snapshot folder for `repo_id` at `revision`, complete and checked; never uses the network."""
    rev = revision or "main"
    storage = storage_folder(cache_path(cache_dir), repo_id)
    if COMMIT_RE.fullmatch(rev):
        commit = rev
    else:
        ref = storage / "refs" / rev
        if not ref.is_file():
            raise not_downloaded(repo_id, revision)
        commit = ref.read_text().strip()
    folder = storage / "snapshots" / commit
    if not folder.is_dir():
        raise not_downloaded(repo_id, revision)
    missing = _missing(storage, commit, folder)
    if missing:
        raise not_downloaded(repo_id, revision, missing)
    if validate:
        validate_weights(folder, repo_id=repo_id)
    return folder


def _missing(storage: Path, commit: str, folder: Path) -> list[str]:
    """The files a pull fetches that snapshot `folder` lacks: those of huggingface_hub's cached tree listing
    of the commit, or (without one) what a loader needs at least."""
    from huggingface_hub.utils import filter_repo_objects

    expected = _cached_tree(storage, commit)
    if expected is not None:
        want = list(filter_repo_objects(expected, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    else:  # no tree listing cached: require what a loader needs at least
        want = ["config.json"]
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                want += sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError):
                pass
        elif not any(folder.glob("*.safetensors")):
            want.append("*.safetensors")
    return [p for p in want if not (folder / p).exists()]


def _cached_tree(storage: Path, commit: str) -> list[str] | None:
    """File paths from huggingface_hub's tree listing cache (trees/<commit>.json), or None."""
    from huggingface_hub._tree_cache import read_tree_cache  # the public get_cached_repo_tree needs a repo id

    entries = read_tree_cache(str(storage), commit)
    return None if entries is None else sorted(entries)


# ----------------------------------------------------------------------------------------------- weights check
def check_safetensors(path: str | Path) -> None:
    """Raises CorruptWeightsError unless `path` has a sound safetensors header covering the whole file."""
    path = Path(path)
    size = path.stat().st_size
    bad = None
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                bad = "shorter than a safetensors header"
            else:
                (n,) = struct.unpack("<Q", head)
                if n == 0 or n > 100_000_000 or 8 + n > size:
                    bad = "header length is out of range"
                else:
                    header = json.loads(f.read(n))
                    end = 0
                    for name, meta in header.items():
                        if name == "__metadata__":
                            continue
                        begin, stop = meta["data_offsets"]
                        if not 0 <= begin <= stop:
                            bad = f"bad offsets for tensor {name}"
                            break
                        end = max(end, stop)
                    if bad is None and 8 + n + end != size:
                        bad = f"{size} bytes on disk, header describes {8 + n + end}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        bad = "header is not valid JSON"
    if bad:
        raise CorruptWeightsError(f"{path} is corrupt or truncated ({bad})",
                                  hint="delete it (or `dflash-cli rm` the model) and pull again")


def validate_weights(folder: str | Path, *, repo_id: str | None = None) -> None:
    for file in sorted(Path(folder).rglob("*.safetensors")):
        check_safetensors(file)


# ----------------------------------------------------------------------------------------------- cache management
def _scan(cache_dir: str | Path | None):
    from huggingface_hub import scan_cache_dir

    cache = cache_path(cache_dir)
    if not cache.is_dir():
        return None
    return scan_cache_dir(cache)


def _shown(names: list[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _check_revisions(storage: Path, revisions: Iterable[Any]) -> tuple[str, str | None]:
    """(status, problem) of a repo huggingface_hub scanned as sound: "damaged" when a safetensors file is
    truncated or unreadable, "partial" when files a pull fetches are missing (as `local_snapshot` would say)."""
    partial = None
    for rev in revisions:
        snapshot = Path(rev.snapshot_path)
        for name in sorted(Path(f.file_path).relative_to(snapshot).as_posix() for f in rev.files):
            if name.endswith(".safetensors"):
                try:
                    check_safetensors(snapshot / name)
                except CorruptWeightsError:
                    return "damaged", f"{name} is truncated or corrupt"
                except OSError as e:
                    return "damaged", f"{name} cannot be read ({(e.strerror or str(e)).lower()})"
        missing = _missing(storage, rev.commit_hash, snapshot)
        if missing and partial is None:
            partial = f"missing {_shown(missing)}"
    return ("partial", partial) if partial else ("ok", None)


def _why_damaged(entry: Path, warnings: Iterable[Exception]) -> str:
    """What is wrong with a cache entry huggingface_hub's scan refused, in a few words."""
    if not entry.is_dir():
        return "not a folder"
    snapshots, refs = entry / "snapshots", entry / "refs"
    if not snapshots.is_dir():
        return "its snapshots folder is missing"
    try:
        broken = sorted(p.relative_to(snapshots).as_posix() for p in snapshots.rglob("*")
                        if p.is_symlink() and not p.exists())
        if broken:
            names = sorted({b.split("/", 1)[-1] for b in broken})
            return f"{len(broken)} file{'s are' if len(broken) != 1 else ' is'} missing from its blobs: {_shown(names)}"
        if refs.is_file():
            return "its refs folder is a file"
        commits = {p.name for p in snapshots.iterdir() if p.is_dir()}
        for ref in sorted(refs.rglob("*")) if refs.is_dir() else []:
            if ref.is_file() and ref.read_text(errors="replace").strip() not in commits:
                return f"refs/{ref.relative_to(refs).as_posix()} points at a snapshot that is not there"
    except OSError as e:
        return f"cannot be read ({(e.strerror or str(e)).lower()})"
    marker = str(entry.resolve())
    for w in warnings:
        if marker in str(w):
            return str(w).replace(marker + os.sep, "")
    return "not a valid cache entry"


def _damaged_entry(entry: Path, warnings: Iterable[Exception]) -> LocalRepo:
    """A `models--org--name` entry of the cache that huggingface_hub's scan refused, as a LocalRepo."""
    size, modified = 0, 0.0
    paths = [entry] + ([p for p in entry.rglob("*")] if entry.is_dir() and not entry.is_symlink() else [])
    for p in paths:
        with contextlib.suppress(OSError):
            st = p.lstat()
            modified = max(modified, st.st_mtime)
            if p.is_file() and not p.is_symlink():
                size += st.st_size
    revisions, refs = [], []
    with contextlib.suppress(OSError):
        if (entry / "snapshots").is_dir():
            revisions = sorted(p.name for p in (entry / "snapshots").iterdir() if p.is_dir())
        if (entry / "refs").is_dir():
            refs = sorted(p.relative_to(entry / "refs").as_posix() for p in (entry / "refs").rglob("*") if p.is_file())
    repo_id = entry.name.removeprefix("models--").replace("--", "/")
    return LocalRepo(repo_id, tuple(revisions), tuple(refs), size, modified, entry, "damaged",
                     _why_damaged(entry, warnings))


def _local(cache_dir: str | Path | None) -> tuple[Any, list[LocalRepo]]:
    """(huggingface_hub's scan or None, every model entry of the cache: sound, partial and damaged ones)."""
    cache = cache_path(cache_dir)
    info = _scan(cache)
    if info is None:
        return None, []
    out, scanned = [], set()
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        scanned.add(Path(repo.repo_path).name)
        revs = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        status, problem = _check_revisions(Path(repo.repo_path), revs)
        out.append(LocalRepo(repo.repo_id, tuple(r.commit_hash for r in revs),
                             tuple(sorted(ref for r in revs for ref in r.refs)), repo.size_on_disk,
                             repo.last_modified, Path(repo.repo_path), status, problem))
    # Entries the scan refused (a blob deleted, no snapshots folder, a ref to nowhere) are only warnings to
    # huggingface_hub: they are listed here, so that they can be seen and removed.
    for entry in sorted(cache.iterdir()):
        if entry.name.startswith("models--") and entry.name not in scanned:
            out.append(_damaged_entry(entry, info.warnings))
    return info, sorted(out, key=lambda r: r.repo_id)


def list_local(cache_dir: str | Path | None = None) -> list[LocalRepo]:
    """Model repositories in the local Hub cache, sorted by id, damaged and partial ones included (`status`)."""
    return _local(cache_dir)[1]


def remove(repo_ids: str | Iterable[str], cache_dir: str | Path | None = None) -> int:
    """Deletes every cached revision of these repositories (damaged entries as a whole); returns the bytes freed.

    Raises NotDownloadedError (deleting nothing) when one of them is not in the cache, and DFlashError
    (deleting nothing) when one cannot be removed (a read-only cache, folders that are not ours).
    """
    ids = [repo_ids] if isinstance(repo_ids, str) else list(repo_ids)
    info, local = _local(cache_dir)
    repos = {r.repo_id: r for r in local}
    unknown = [i for i in ids if i not in repos]
    if unknown:
        raise NotDownloadedError(f"not in the local cache: {', '.join(unknown)}",
                                 hint="`dflash-cli ls` shows what is downloaded")
    if not ids:
        return 0
    chosen = [repos[i] for i in ids]
    for r in chosen:
        blocked = undeletable(r.path)
        if blocked is not None:
            raise removal_error(r.repo_id, cache_path(cache_dir), blocked)
    freed = 0
    sound = [r.repo_id for r in chosen if r.status != "damaged"]
    if sound:
        scanned = {r.repo_id: r for r in info.repos if r.repo_type == "model"}
        # Scope the scan to these repos: delete_revisions matches commit hashes across every repo, and a
        # duplicated repository shares its commit hashes with the original.
        scoped = dataclasses.replace(info, repos=frozenset(scanned[i] for i in sound))
        hashes = [rev.commit_hash for i in sound for rev in scanned[i].revisions]
        strategy = scoped.delete_revisions(*hashes)
        strategy.execute()
        freed += int(strategy.expected_freed_size)
    for r in chosen:
        if r.status == "damaged":  # not in huggingface_hub's scan: the whole entry goes
            remove_path(r.path)
            freed += r.size_on_disk
    return freed


# -------------------------------------------------------------------------- the built-in model's conversions

BUILTIN_DTYPES = ("bfloat16", "float16", "float32")  # smollm2_dir's folders (only bfloat16 is made by the CLI)


def builtin_folders() -> list[tuple[str, Path]]:
    """(dtype, folder) of each conversion of the built-in SmolLM2-135M on disk, complete or not."""
    from dflash_cli.models.smollm2 import smollm2_dir

    found = []
    for dtype in BUILTIN_DTYPES:
        folder = smollm2_dir(dtype=dtype)
        if os.path.lexists(folder):
            found.append((dtype, folder))
    return found


def builtin_problem(folder: Path, dtype: str) -> str | None:
    """Why a conversion cannot be used as it is, or None: the check every run makes before it uses the folder
    (a marker, every file, weights as long as their headers say), which converts it again when it fails."""
    from dflash_cli.models import smollm2

    return None if smollm2.is_complete(folder, dtype, None) else "incomplete or truncated"


def folder_size(folder: Path) -> tuple[int, float]:
    """(bytes of the files in `folder`, the newest modification time), links not followed."""
    size, modified = 0, 0.0
    paths = [folder] + (list(folder.rglob("*")) if folder.is_dir() and not folder.is_symlink() else [])
    for p in paths:
        try:
            st = p.lstat()
        except OSError:
            continue
        modified = max(modified, st.st_mtime)
        if stat.S_ISREG(st.st_mode):
            size += st.st_size
    return size, modified
