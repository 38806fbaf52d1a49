"""Model ids on the Hugging Face Hub -> local folders: plan, pull, offline lookup, list, remove.

Everything goes through huggingface_hub itself (one cache, the standard layout); this module never prints.
Failures surface as typed `DFlashError`s with a one-line message and a hint.

Environment: HF_HOME / HF_HUB_CACHE choose the cache and HF_TOKEN the token (both read at call time here);
HF_HUB_OFFLINE=1 makes every function use the local cache only; HF_HUB_DISABLE_PROGRESS_BARS is honoured
by huggingface_hub's own bars (pass `tqdm_class` to draw your own). huggingface_hub reads HF_ENDPOINT and
HF_HUB_OFFLINE once at import time, so this module also re-reads HF_HUB_OFFLINE from the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cli.engine.errors import CheckpointError, DFlashError
from dflash_cli.engine.pairing import PICKLE_SUFFIXES

# Files a pull fetches: configs, tokenizer, chat templates and safetensors weights. Never code or pickles.
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
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


# ----------------------------------------------------------------------------------------------- errors
class HubError(DFlashError):
    """Something about a Hub repository or the connection to the Hub."""


class RepoNotFoundError(HubError):
    """The repository does not exist, or is private and the token cannot see it."""


class GatedRepoError(HubError):
    """The repository is gated: log in, or accept its licence."""


class RevisionNotFoundError(HubError):
    """The branch, tag or commit does not exist in the repository."""


class HubUnreachableError(HubError):
    """The Hub could not be reached (no network, DNS, proxy, server down)."""


class NotDownloadedError(HubError):
    """Offline, and the requested repository (or some of its files) is not in the local cache."""


class PickleOnlyRepoError(CheckpointError):
    """The repository holds its weights only as pickle files, which this tool refuses to load."""


class NoWeightsError(CheckpointError):
    """The repository holds no weights at all."""


class CorruptWeightsError(CheckpointError):
    """A downloaded safetensors file is truncated or its header is malformed."""


# ----------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class FileInfo:
    path: str
    size: int


@dataclass(frozen=True)
class PlannedFile:
    path: str
    size: int
    cached: bool


@dataclass(frozen=True)
class DownloadPlan:
    repo_id: str
    revision: str
    commit: str
    files: tuple[PlannedFile, ...]  # what a pull would fetch (ALLOW_PATTERNS minus IGNORE_PATTERNS)
    skipped: tuple[str, ...]  # files in the repo that a pull leaves out

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def cached_bytes(self) -> int:
        return sum(f.size for f in self.files if f.cached)

    @property
    def download_bytes(self) -> int:
        return self.total_bytes - self.cached_bytes

    @property
    def cached(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files if f.cached)


@dataclass(frozen=True)
class LocalRepo:
    repo_id: str
    revisions: tuple[str, ...]  # commit hashes
    refs: tuple[str, ...]  # branch/tag names pointing at one of them
    size_on_disk: int
    last_modified: float  # POSIX timestamp
    path: Path


# ----------------------------------------------------------------------------------------------- env
def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub saw it at import, or as it is set now."""
    from huggingface_hub import constants

    return constants.is_offline_mode() or _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(
        os.environ.get("TRANSFORMERS_OFFLINE"))


def default_cache_dir() -> Path:
    """HF_HUB_CACHE, else HF_HOME/hub, read now (huggingface_hub's own constant is frozen at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _cache(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _token_found(token: str | bool | None) -> bool:
    if isinstance(token, str):
        return bool(token)
    if token is False:
        return False
    from huggingface_hub import get_token

    try:
        return get_token() is not None
    except Exception:  # an OIDC exchange failing here must not hide the real error
        return False


def _storage_folder(cache: Path, repo_id: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache / repo_folder_name(repo_id=repo_id, repo_type="model")


# ----------------------------------------------------------------------------------------------- errors from hf
def _translate(exc: BaseException, repo_id: str, revision: str | None, token: str | bool | None,
               endpoint: str | None) -> DFlashError | None:
    import httpx2
    from huggingface_hub import errors as hf

    rev = revision or "main"
    if isinstance(exc, hf.GatedRepoError):
        status = exc.response.status_code if exc.response is not None else None
        page = f"https://huggingface.co/{repo_id}"
        if status == 403:
            return GatedRepoError(f"{repo_id} is gated and your account has not been granted access yet",
                                  hint=f"accept the licence at {page}, then pull again")
        if not _token_found(token):
            return GatedRepoError(f"{repo_id} is gated: log in first",
                                  hint=f"run `hf auth login` or set HF_TOKEN, and accept the licence at {page}")
        return GatedRepoError(f"{repo_id} is gated and the Hub rejected your token",
                              hint=f"check HF_TOKEN or run `hf auth login` again; accept the licence at {page}")
    if isinstance(exc, hf.RevisionNotFoundError):
        return RevisionNotFoundError(f"revision {rev!r} was not found in {repo_id}",
                                     hint="check the branch, tag or commit name (default: main)")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return RepoNotFoundError(f"repository {repo_id} was not found on the Hub (or it is private)",
                                 hint="check the id (owner/name); for a private repo log in with `hf auth login`")
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return NotDownloadedError(f"{repo_id} is not downloaded and HF_HUB_OFFLINE is set",
                                  hint=f"unset HF_HUB_OFFLINE and run `dflash-cli pull {repo_id}`")
    network = (httpx2.ConnectError, httpx2.TimeoutException, httpx2.RemoteProtocolError, httpx2.NetworkError)
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(c, network) for c in chain) or (
            isinstance(exc, hf.LocalEntryNotFoundError) and not isinstance(exc, hf.OfflineModeIsEnabled)):
        from huggingface_hub import constants

        where = endpoint or constants.ENDPOINT
        return HubUnreachableError(f"cannot reach the Hub at {where} to get {repo_id}",
                                   hint="check your connection; to use models already pulled, set HF_HUB_OFFLINE=1")
    if isinstance(exc, hf.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return HubError(f"the Hub answered HTTP {status} for {repo_id}",
                        hint="try again later; with HF_HUB_OFFLINE=1 models already pulled still work")
    return None


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, token: str | bool | None,
                endpoint: str | None) -> Iterator[None]:
    try:
        yield
    except DFlashError:
        raise
    except Exception as exc:
        mapped = _translate(exc, repo_id, revision, token, endpoint)
        if mapped is None:
            raise
        raise mapped from exc


# ----------------------------------------------------------------------------------------------- patterns
def wanted(path: str) -> bool:
    """Whether a pull fetches this repo file."""
    from huggingface_hub.utils import filter_repo_objects

    return bool(list(filter_repo_objects([path], allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)))


def _check_weights(repo_id: str, paths: Iterable[str]) -> None:
    paths = list(paths)
    if any(p.endswith(".safetensors") for p in paths):
        return
    pickles = sorted(p for p in paths if p.endswith(PICKLE_SUFFIXES))
    if pickles:
        shown = ", ".join(pickles[:3]) + (f" (+{len(pickles) - 3} more)" if len(pickles) > 3 else "")
        raise PickleOnlyRepoError(f"{repo_id} has weights only as pickle files ({shown}), which are refused",
                                  hint="use a repository that ships *.safetensors weights")
    raise NoWeightsError(f"{repo_id} has no *.safetensors weights",
                         hint="check the repository id; a model repo needs safetensors weights")


# ----------------------------------------------------------------------------------------------- online
def _api(endpoint: str | None, token: str | bool | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token)


def _require_online(repo_id: str) -> None:
    if is_offline():
        raise NotDownloadedError(f"cannot ask the Hub about {repo_id}: HF_HUB_OFFLINE is set",
                                 hint="unset HF_HUB_OFFLINE to use the network")


def _resolve_and_list(repo_id: str, revision: str | None, endpoint: str | None,
                      token: str | bool | None) -> tuple[str, list[FileInfo]]:
    from huggingface_hub import RepoFile

    _require_online(repo_id)
    api = _api(endpoint, token)
    with _hub_errors(repo_id, revision, token, endpoint):
        if revision is not None and _COMMIT_RE.fullmatch(revision):
            commit = revision
        else:
            info = api.model_info(repo_id, revision=revision)
            commit = info.sha
        files = [FileInfo(f.path, int(f.lfs.size if f.lfs is not None else f.size))
                 for f in api.list_repo_tree(repo_id, recursive=True, revision=commit)
                 if isinstance(f, RepoFile)]
    return commit, sorted(files, key=lambda f: f.path)


def repo_files(repo_id: str, revision: str | None = None, endpoint: str | None = None,
               token: str | bool | None = None) -> list[FileInfo]:
    """Every file of the repository at `revision` with its size (no filtering)."""
    return _resolve_and_list(repo_id, revision, endpoint, token)[1]


def plan_download(repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None,
                  endpoint: str | None = None, token: str | bool | None = None) -> DownloadPlan:
    """What `pull` would fetch, with sizes and which files are already cached. Refuses pickle-only repos."""
    commit, files = _resolve_and_list(repo_id, revision, endpoint, token)
    _check_weights(repo_id, (f.path for f in files))
    snapshot = _storage_folder(_cache(cache_dir), repo_id) / "snapshots" / commit
    planned, skipped = [], []
    for f in files:
        if wanted(f.path):
            planned.append(PlannedFile(f.path, f.size, (snapshot / f.path).exists()))
        else:
            skipped.append(f.path)
    return DownloadPlan(repo_id, revision or "main", commit, tuple(planned), tuple(skipped))


def fetch_configs(repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None,
                  endpoint: str | None = None, token: str | bool | None = None) -> Path:
    """Downloads only config.json (and generation_config.json when present); returns the snapshot folder."""
    from huggingface_hub import snapshot_download

    cache = _cache(cache_dir)
    offline = is_offline()
    with _hub_errors(repo_id, revision, token, endpoint):
        try:
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, endpoint=endpoint,
                                            token=token, allow_patterns=list(CONFIG_FILES),
                                            local_files_only=offline))
        except Exception as exc:
            from huggingface_hub.errors import LocalEntryNotFoundError

            if offline and isinstance(exc, LocalEntryNotFoundError):
                raise _not_downloaded(repo_id, revision) from exc
            raise
    if not (folder / "config.json").is_file():
        if offline:
            raise _not_downloaded(repo_id, revision, ["config.json"])
        raise CheckpointError(f"{repo_id} has no config.json", hint="is this a transformers model repository?")
    return folder


def pull(repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None,
         endpoint: str | None = None, token: str | bool | None = None, tqdm_class: Any = None,
         local_files_only: bool = False, max_workers: int = 8) -> Path:
    """Downloads configs, tokenizer and safetensors weights into the Hub cache; returns the snapshot folder.

    Offline (HF_HUB_OFFLINE=1 or `local_files_only=True`) it only looks in the cache (`local_snapshot`).
    Files already cached are not fetched again. Every safetensors file is checked after the download.
    """
    from huggingface_hub import snapshot_download

    if local_files_only or is_offline():
        return local_snapshot(repo_id, revision, cache_dir=cache_dir)
    try:
        plan_download(repo_id, revision, cache_dir=cache_dir, endpoint=endpoint, token=token)
    except HubUnreachableError:
        try:  # like huggingface_hub: a complete cached copy still works when the Hub cannot be reached
            return local_snapshot(repo_id, revision, cache_dir=cache_dir)
        except NotDownloadedError:
            pass
        raise
    # Pass the name (not plan.commit) so huggingface_hub records refs/<name> for offline use later.
    with _hub_errors(repo_id, revision, token, endpoint):
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=_cache(cache_dir),
                                        endpoint=endpoint, token=token, tqdm_class=tqdm_class,
                                        allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
                                        max_workers=max_workers))
    validate_weights(folder, repo_id=repo_id)
    return folder


# ----------------------------------------------------------------------------------------------- offline
def _not_downloaded(repo_id: str, revision: str | None, missing: list[str] | None = None) -> NotDownloadedError:
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
    from huggingface_hub.utils import filter_repo_objects

    rev = revision or "main"
    storage = _storage_folder(_cache(cache_dir), repo_id)
    if _COMMIT_RE.fullmatch(rev):
        commit = rev
    else:
        ref = storage / "refs" / rev
        if not ref.is_file():
            raise _not_downloaded(repo_id, revision)
        commit = ref.read_text().strip()
    folder = storage / "snapshots" / commit
    if not folder.is_dir():
        raise _not_downloaded(repo_id, revision)
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
    missing = [p for p in want if not (folder / p).exists()]
    if missing:
        raise _not_downloaded(repo_id, revision, missing)
    if validate:
        validate_weights(folder, repo_id=repo_id)
    return folder


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

    cache = _cache(cache_dir)
    if not cache.is_dir():
        return None
    return scan_cache_dir(cache)


def list_local(cache_dir: str | Path | None = None) -> list[LocalRepo]:
    """Model repositories in the local Hub cache, sorted by id."""
    info = _scan(cache_dir)
    if info is None:
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        revs = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        out.append(LocalRepo(repo.repo_id, tuple(r.commit_hash for r in revs),
                             tuple(sorted(ref for r in revs for ref in r.refs)), repo.size_on_disk,
                             repo.last_modified, Path(repo.repo_path)))
    return sorted(out, key=lambda r: r.repo_id)


def remove(repo_ids: str | Iterable[str], cache_dir: str | Path | None = None) -> int:
    """Deletes every cached revision of these repositories; returns the bytes freed.

    Raises NotDownloadedError (deleting nothing) when one of them is not in the cache.
    """
    ids = [repo_ids] if isinstance(repo_ids, str) else list(repo_ids)
    info = _scan(cache_dir)
    repos = {r.repo_id: r for r in (info.repos if info is not None else ()) if r.repo_type == "model"}
    unknown = [i for i in ids if i not in repos]
    if unknown:
        raise NotDownloadedError(f"not in the local cache: {', '.join(unknown)}",
                                 hint="`dflash-cli ls` shows what is downloaded")
    if not ids:
        return 0
    chosen = [repos[i] for i in ids]
    # Scope the scan to these repos: delete_revisions matches commit hashes across every repo, and a duplicated
    # repository shares its commit hashes with the original.
    scoped = dataclasses.replace(info, repos=frozenset(chosen))
    hashes = [rev.commit_hash for repo in chosen for rev in repo.revisions]
    strategy = scoped.delete_revisions(*hashes)
    strategy.execute()
    return int(strategy.expected_freed_size)
