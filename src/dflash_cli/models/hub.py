"""Model ids on the Hugging Face Hub -> local folders: plan, pull, offline lookup, list, remove.

Everything goes through huggingface_hub itself (one cache, the standard layout); this module never prints.
Failures surface as typed `DFlashError`s with a one-line message and a hint.

Environment: HF_HOME / HF_HUB_CACHE (or the older HUGGINGFACE_HUB_CACHE) choose the cache and HF_TOKEN the
token (both read at call time here); HF_HUB_OFFLINE=1 makes every function use the local cache only;
HF_HUB_DISABLE_PROGRESS_BARS is honoured by huggingface_hub's own bars (pass `tqdm_class` to draw your own).
huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and the cache variables once at import time, so this module
re-reads HF_HUB_OFFLINE and the cache variables from the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cli.engine.errors import CheckpointError, DFlashError
from dflash_cli.engine.pairing import PICKLE_SUFFIXES
from dflash_cli.settings import env_flag

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
    status: str = "ok"  # "ok"; "partial": files a run needs are not downloaded; "damaged": unusable as it is
    problem: str | None = None  # what is wrong, for "partial" and "damaged"


# ----------------------------------------------------------------------------------------------- env
def offline_variable() -> str | None:
    """The variable that sets huggingface_hub offline, read now as the library reads it at import (HF_HUB_OFFLINE,
    or TRANSFORMERS_OFFLINE when that is unset), or None."""
    name = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    return name if env_flag(name) else None


def is_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub saw it at import, or as it is set now."""
    from huggingface_hub import constants

    return constants.is_offline_mode() or offline_variable() is not None


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(os.path.expandvars(os.path.expanduser(value))) if value else None


def hf_home() -> Path:
    """HF_HOME, else XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface: huggingface_hub's HF_HOME, read now."""
    home = _env_path("HF_HOME")
    return home if home is not None else (_env_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"


def default_cache_dir() -> Path:
    """The Hub cache as huggingface_hub resolves its HF_HUB_CACHE: HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE,
    else HF_HOME/hub. Read now, because huggingface_hub reads the environment once, at import; with none of
    those variables set it is the library's own value."""
    cache = _env_path("HF_HUB_CACHE") or _env_path("HUGGINGFACE_HUB_CACHE")
    if cache is not None:
        return cache
    if os.environ.get("HF_HOME") or os.environ.get("XDG_CACHE_HOME"):
        return hf_home() / "hub"
    try:
        from huggingface_hub import constants
    except ImportError:  # a broken install: `doctor` still reports where the cache is
        return hf_home() / "hub"
    return Path(constants.HF_HUB_CACHE)


def token_path() -> Path:
    """Where `hf auth login` keeps the token: HF_TOKEN_PATH, else HF_HOME/token (read now)."""
    return _env_path("HF_TOKEN_PATH") or hf_home() / "token"


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


# ------------------------------------------------------------------------------------- folders that cannot be written
# What a write into a folder that cannot take it fails with: read-only, not ours, full, or a file in the way.
WRITE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                          errno.EEXIST, errno.EISDIR})
CACHE_SETTING = "HF_HUB_CACHE (or HF_HOME)"


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def _not_writable(folder: Path) -> OSError:
    code = errno.EACCES
    with contextlib.suppress(OSError, AttributeError):
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            code = errno.EROFS
    return OSError(code, os.strerror(code), str(folder))


def unwritable(folder: Path) -> OSError | None:
    """Why nothing can be created in `folder` (or in the folders that would be made for it), else None. Checked
    on the nearest folder that exists, without writing anything (root passes where only permissions refuse)."""
    here = _existing(folder)
    if not here.is_dir():
        return NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(here))
    return None if os.access(here, os.W_OK | os.X_OK) else _not_writable(here)


def undeletable(path: Path) -> OSError | None:
    """Why `path` (a file, a link, or a folder and all below it) cannot be removed, else None."""
    folders = [path.parent]
    if path.is_dir() and not path.is_symlink():
        folders += [Path(root) for root, _dirs, _files in os.walk(path)]
    for folder in folders:
        if not os.access(folder, os.W_OK | os.X_OK):
            return _not_writable(folder)
    return None


def removal_error(name: str, where: Path, blocked: OSError) -> DFlashError:
    """`undeletable`'s answer as one line naming what and where, and a hint."""
    return DFlashError(f"cannot remove {name} from {where}: {os.strerror(blocked.errno or errno.EACCES).lower()}",
                       hint=f"nothing was removed; {blocked.filename} must be writable first")


def _file_in_the_way(path: Path) -> Path | None:
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return None if p.is_dir() else p
    return None


def folder_error(error: OSError, doing: str, setting: str, space: str | None = None) -> DFlashError:
    """A write that failed for want of a writable folder, as one line naming the folder and a hint.

    `doing`: "cannot write the download of org/name"; `setting`: what moves the folder elsewhere (an
    environment variable); `space`: how much room the write needs ("about 350 MB"), when known."""
    path = Path(error.filename) if error.filename else None
    code = error.errno
    blocker = _file_in_the_way(path) if path is not None and code in (errno.ENOTDIR, errno.EEXIST) else None
    if blocker is not None:
        return DFlashError(f"{doing}: {blocker} is a file, not a folder",
                           hint=f"move {blocker} away, or point {setting} at a folder")
    where = _existing(path) if path is not None else None
    if where is not None and not where.is_dir():
        where = where.parent
    reason = os.strerror(code).lower() if code else str(error)
    message = f"{doing} in {where}: {reason}" if where is not None else f"{doing}: {reason}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        hint = f"free {space or 'some space'} there, or point {setting} at another disk"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = (f"make {where or 'it'} writable, or point {setting} at a writable folder"
                + (f" with {space} free" if space else ""))
    else:
        hint = f"point {setting} at another folder"
    return DFlashError(message, hint=hint)


@contextlib.contextmanager
def _cache_writes(doing: str, space: str | None = None) -> Iterator[None]:
    """A write into the Hub cache that fails for want of a writable folder -> `folder_error`."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in WRITE_ERRNOS:
            raise
        raise folder_error(exc, doing, CACHE_SETTING, space) from exc


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
    doing = f"cannot write the configs of {repo_id}"
    blocked = None if offline else unwritable(_storage_folder(cache, repo_id) / "blobs")
    if blocked is not None:
        raise folder_error(blocked, doing, CACHE_SETTING)
    with _cache_writes(doing), _hub_errors(repo_id, revision, token, endpoint):
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

    from dflash_cli.units import fmt_bytes

    if local_files_only or is_offline():
        return local_snapshot(repo_id, revision, cache_dir=cache_dir)
    try:
        plan = plan_download(repo_id, revision, cache_dir=cache_dir, endpoint=endpoint, token=token)
    except HubUnreachableError:
        try:  # like huggingface_hub: a complete cached copy still works when the Hub cannot be reached
            return local_snapshot(repo_id, revision, cache_dir=cache_dir)
        except NotDownloadedError:
            pass
        raise
    cache = _cache(cache_dir)
    doing, space = f"cannot write the download of {repo_id}", fmt_bytes(plan.download_bytes)
    # Before anything is fetched: a cache that cannot be written fails here in one line, not half-way through
    # the download (nor after huggingface_hub's warnings about each file it could not write).
    blocked = unwritable(_storage_folder(cache, repo_id) / "blobs")
    if blocked is not None:
        if all(f.cached for f in plan.files):  # nothing to write: a read-only shared cache still serves it
            return local_snapshot(repo_id, plan.commit, cache_dir=cache)
        raise folder_error(blocked, doing, CACHE_SETTING, space)
    # Pass the name (not plan.commit) so huggingface_hub records refs/<name> for offline use later.
    with _cache_writes(doing, space), _hub_errors(repo_id, revision, token, endpoint):
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
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
    missing = _missing(storage, commit, folder)
    if missing:
        raise _not_downloaded(repo_id, revision, missing)
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

    cache = _cache(cache_dir)
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
    cache = _cache(cache_dir)
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
            raise removal_error(r.repo_id, _cache(cache_dir), blocked)
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


def remove_path(path: Path) -> None:
    """Deletes a folder and all below it (links not followed), or a file or a link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
