"""Where the Hugging Face cache is, and whether a folder can be written or removed.

Environment: HF_HOME / HF_HUB_CACHE (or the older HUGGINGFACE_HUB_CACHE) choose the cache and HF_TOKEN_PATH the
token file; HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE) makes every Hub function use the local cache only.
huggingface_hub reads HF_HUB_OFFLINE and the cache variables once at import time, so this module re-reads them
from the environment at call time.

Writability is checked without writing anything; a write that failed for want of a writable folder becomes one
`DFlashError` line naming the folder, with a hint.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from dflash_cli.engine.errors import DFlashError
from dflash_cli.settings import env_flag


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


def cache_path(cache_dir: str | Path | None) -> Path:
    """`cache_dir` (a ~ expanded), else the default Hub cache."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def storage_folder(cache: Path, repo_id: str) -> Path:
    """The `models--org--name` folder of `repo_id` in the Hub cache `cache`."""
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
def cache_writes(doing: str, space: str | None = None) -> Iterator[None]:
    """A write into the Hub cache that fails for want of a writable folder -> `folder_error`."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in WRITE_ERRNOS:
            raise
        raise folder_error(exc, doing, CACHE_SETTING, space) from exc


def remove_path(path: Path) -> None:
    """Deletes a folder and all below it (links not followed), or a file or a link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
