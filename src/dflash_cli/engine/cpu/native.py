"""The project's own C kernels (engine/cpu/native/*.c), built once per CPU with the system's C compiler and
loaded through ctypes.

Only where the CPU has AVX2 and FMA. The library is kept in the cache folder under a key of the source, the
compiler's version and the CPU's flags, so a first start pays one compile (3.2 s on 2 AVX2 cores) and later
starts load it. Beside it a manifest records its size and SHA-256 at build time; a library that does not
match (cut short by a full disk, or another file put there) is never opened, since mapping a truncated
library kills the process with SIGBUS: it is built again. It links the OpenMP runtime torch has already
loaded (the same `libgomp.so.1`), so its threads are torch's threads and `torch.set_num_threads` governs
both (engine/cpu/threads.py sets it). Without a compiler, or on another
CPU, `library()` is None and `unavailable()` says why; callers keep their other formats.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = ("int8_matmul.c", "attention.c", "layer.c")
# -ffp-contract=off keeps every row's float operations the same in any tile shape (row-exact); the
# scheduling flags keep the kernels' accumulators in registers (gcc otherwise spills them)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-fno-tree-reassoc",
         "-fschedule-insns", "-fsched-pressure", "-fPIC", "-shared")
ABI_VERSION = 2
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
COMPILE_TIMEOUT_S = 300

P, LONG = ctypes.c_void_p, ctypes.c_long
SIGNATURES = {
    "dfq_quantize_rows": [P, LONG, LONG, P, P, P],
    "dfq_q4_matmul": [P, LONG, LONG, P, P, P, LONG, P, P],
    "dfq_q8_matmul": [P, LONG, LONG, P, P, LONG, P, P],
    "dfq_attention": [P, LONG, LONG, LONG, LONG, LONG, P, P, LONG, P, LONG, ctypes.c_float, P],
    "dfq_layer_forward": [P, P, LONG, P, P, P, P, P, LONG],
    "dfq_draft_layer_forward": [P, P, LONG, P, LONG, LONG, P, P, P, P, LONG],
}


class Linear(ctypes.Structure):
    """native/dfq.h's struct dfq_linear: kind 4 or 8, (n, k), codes, d, m, bias."""
    _fields_ = [("kind", LONG), ("n", LONG), ("k", LONG), ("codes", P), ("d", P), ("m", P), ("bias", P)]


class Layer(ctypes.Structure):
    """native/layer.c's struct dfq_layer."""
    _fields_ = [("hidden", LONG), ("heads", LONG), ("kv", LONG), ("hd", LONG), ("inter", LONG),
                ("norm1", P), ("norm2", P), ("q_norm", P), ("k_norm", P),
                ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("qk_eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear)]


class DraftLayer(ctypes.Structure):
    """native/layer.c's struct dfq_draft_layer."""
    _fields_ = [("hidden", LONG), ("heads", LONG), ("kv", LONG), ("hd", LONG), ("inter", LONG),
                ("norm1", P), ("norm2", P), ("q_norm", P), ("k_norm", P),
                ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("qk_eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("q", Linear), ("k", Linear), ("v", Linear), ("o", Linear),
                ("gate", Linear), ("up", Linear), ("down", Linear), ("window", LONG)]


@dataclass
class Built:
    lib: ctypes.CDLL
    path: Path
    seconds: float  # the compile's time, 0 when loaded from the cache


_lock = threading.Lock()
_state: dict[str, Built | str] = {}


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compiler() -> str | None:
    """The C compiler to build with: $CC, else cc or gcc on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def source_dir() -> Path:
    return Path(__file__).with_name("native")


def cache_folder() -> Path:
    from dflash_cli.settings import cache_dir

    return cache_dir() / "kernels"


def _key(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(version.encode())
    for name in SOURCES:
        digest.update((source_dir() / name).read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(" ".join(sorted(cpu_flags() & {"avx2", "fma", "f16c", "avx512f", "avx512_vnni"})).encode())
    return digest.hexdigest()[:16]


def _why_not_here(flags: set[str] | None = None, cc: str | None | bool = False) -> str | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"torch reports {torch.backends.cpu.get_cpu_capability()} (the kernels need AVX2)"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in (cpu_flags() if flags is None else flags)]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if (compiler() if cc is False else cc) is None:
        return "no C compiler (cc or gcc) on the PATH to build them with"
    return None


def manifest_path(library_path: Path) -> Path:
    return library_path.with_name(library_path.name + ".json")


def _fingerprint(path: Path) -> dict[str, object]:
    data = path.read_bytes()
    return {"abi": ABI_VERSION, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def is_intact(library_path: Path) -> bool:
    """Whether the file at `library_path` is the library built there: its size and hash as recorded at build."""
    try:
        recorded = json.loads(manifest_path(library_path).read_text())
        return isinstance(recorded, dict) and recorded == _fingerprint(library_path)
    except (OSError, ValueError):
        return False


def _build(cc: str, out: Path) -> float:
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        made = Path(tmp) / out.name
        command = [cc, *FLAGS, *(str(source_dir() / s) for s in SOURCES), "-o", str(made)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise RuntimeError(f"{cc} failed: {first[:200]}")
        manifest = Path(tmp) / "manifest.json"
        manifest.write_text(json.dumps(_fingerprint(made)))
        # whole or not at all: a second process never loads a half-written library, and until the manifest
        # lands beside the new library it rebuilds rather than trusts it
        os.replace(made, out)
        os.replace(manifest, manifest_path(out))
    return time.perf_counter() - started


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.dfq_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} is of another version")
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def library(on_status: Callable[[str], None] | None = None) -> Built | None:
    """The built library, built now if this CPU has none yet (`on_status` hears it); None when it cannot
    be had here (`unavailable()` says why). Built at most once per process."""
    with _lock:
        if "result" in _state:
            got = _state["result"]
            return got if isinstance(got, Built) else None
        result: Built | str
        try:
            result = _make(on_status)
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            result = f"the kernels could not be built ({error})"
        _state["result"] = result
        return result if isinstance(result, Built) else None


def _make(on_status: Callable[[str], None] | None) -> Built | str:
    torch.get_num_threads()  # torch's OpenMP runtime is loaded before ours links to it
    why = _why_not_here()
    if why is not None:
        return why
    cc = compiler()
    assert cc is not None
    path = cache_folder() / _key(cc) / "libdflash_int8.so"
    seconds = 0.0
    if not is_intact(path):  # not built yet, or damaged or replaced since: never opened
        if on_status is not None:
            on_status(f"Building the 8-bit-activation kernels for this CPU with {cc} (once, a few seconds) ...")
        seconds = _build(cc, path)
    try:
        return Built(_load(path), path, seconds)
    except (OSError, AttributeError, RuntimeError) as error:
        # the file was ours and intact, and still did not load: a second build would not differ
        raise RuntimeError(f"{path} does not load ({error}); remove {path.parent} to build it again") from None


def unavailable() -> str | None:
    """Why library() is None (after a call), or None when it loaded."""
    got = _state.get("result")
    return got if isinstance(got, str) else None


def available_without_building() -> str | None:
    """Why the kernels cannot be had here, judged without compiling anything; None when they can."""
    got = _state.get("result")
    return got if isinstance(got, str) else _why_not_here()


def reset_for_tests() -> None:
    with _lock:
        _state.clear()


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def attention(lib: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              positions: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """Causal fp32 attention of one sequence's queries q (1, n, heads, hd) at `positions` (n,) over cache
    buffers (1, kv, capacity, hd) whose row r holds position r, each row exact in any company
    (native/attention.c); (1, n, heads * hd)."""
    _, n, heads, hd = q.shape
    if q.stride(-1) != 1 or q.stride(2) != hd:
        q = q.contiguous()
    out = torch.empty(1, n, heads * hd)
    lib.dfq_attention(q.data_ptr(), q.stride(1), n, heads, keys.shape[1], hd, keys.data_ptr(), values.data_ptr(),
                      keys.shape[2], positions.data_ptr(), window or 0, scale, out.data_ptr())
    return out
