"""Model ids on the Hugging Face Hub -> local folders, online: plan, pull, the configs alone, Hub errors translated.

Everything goes through huggingface_hub itself (one cache, the standard layout); this module never prints.
Failures surface as typed `DFlashError`s with a one-line message and a hint. Offline (HF_HUB_OFFLINE=1) a pull
only looks in the local cache (models/cache.py); where that cache is and the environment it is read from:
models/folders.py. HF_TOKEN is read at call time by huggingface_hub; HF_HUB_DISABLE_PROGRESS_BARS is honoured
by huggingface_hub's own bars (pass `tqdm_class` to draw your own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cli.engine.errors import CheckpointError, DFlashError
from dflash_cli.engine.pairing import PICKLE_SUFFIXES
from dflash_cli.models.cache import (
    ALLOW_PATTERNS,
    COMMIT_RE,
    CONFIG_FILES,
    IGNORE_PATTERNS,
    HubError,
    NotDownloadedError,
    local_snapshot,
    not_downloaded,
    validate_weights,
)
from dflash_cli.models.folders import (
    CACHE_SETTING,
    cache_path,
    cache_writes,
    folder_error,
    is_offline,
    storage_folder,
    unwritable,
)


# ----------------------------------------------------------------------------------------------- errors
class RepoNotFoundError(HubError):
    """The repository does not exist, or is private and the token cannot see it."""


class GatedRepoError(HubError):
    """The repository is gated: log in, or accept its licence."""


class RevisionNotFoundError(HubError):
    """The branch, tag or commit does not exist in the repository."""


class HubUnreachableError(HubError):
    """The Hub could not be reached (no network, DNS, proxy, server down)."""


class PickleOnlyRepoError(CheckpointError):
    """The repository holds its weights only as pickle files, which this tool refuses to load."""


class NoWeightsError(CheckpointError):
    """The repository holds no weights at all."""


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


# ----------------------------------------------------------------------------------------------- errors from hf
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
        if revision is not None and COMMIT_RE.fullmatch(revision):
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
    snapshot = storage_folder(cache_path(cache_dir), repo_id) / "snapshots" / commit
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

    cache = cache_path(cache_dir)
    offline = is_offline()
    doing = f"cannot write the configs of {repo_id}"
    blocked = None if offline else unwritable(storage_folder(cache, repo_id) / "blobs")
    if blocked is not None:
        raise folder_error(blocked, doing, CACHE_SETTING)
    with cache_writes(doing), _hub_errors(repo_id, revision, token, endpoint):
        try:
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, endpoint=endpoint,
                                            token=token, allow_patterns=list(CONFIG_FILES),
                                            local_files_only=offline))
        except Exception as exc:
            from huggingface_hub.errors import LocalEntryNotFoundError

            if offline and isinstance(exc, LocalEntryNotFoundError):
                raise not_downloaded(repo_id, revision) from exc
            raise
    if not (folder / "config.json").is_file():
        if offline:
            raise not_downloaded(repo_id, revision, ["config.json"])
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
    cache = cache_path(cache_dir)
    doing, space = f"cannot write the download of {repo_id}", fmt_bytes(plan.download_bytes)
    # Before anything is fetched: a cache that cannot be written fails here in one line, not half-way through
    # the download (nor after huggingface_hub's warnings about each file it could not write).
    blocked = unwritable(storage_folder(cache, repo_id) / "blobs")
    if blocked is not None:
        if all(f.cached for f in plan.files):  # nothing to write: a read-only shared cache still serves it
            return local_snapshot(repo_id, plan.commit, cache_dir=cache)
        raise folder_error(blocked, doing, CACHE_SETTING, space)
    # Pass the name (not plan.commit) so huggingface_hub records refs/<name> for offline use later.
    with cache_writes(doing, space), _hub_errors(repo_id, revision, token, endpoint):
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                        endpoint=endpoint, token=token, tqdm_class=tqdm_class,
                                        allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
                                        max_workers=max_workers))
    validate_weights(folder, repo_id=repo_id)
    return folder

