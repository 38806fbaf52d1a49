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

The build for the CPU's widest instructions (VARIANTS) is checked against a float64 reference in a child
process the first time it loads, so one that dies on an instruction or a tile shape costs a fallback to the
next variant, not the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = ("int8_matmul.c", "attention.c", "layer.c", "argmax.c", "draft.c")
# -ffp-contract=off keeps every row's float operations the same in any tile shape (row-exact); the
# scheduling flags keep the kernels' accumulators in registers (gcc otherwise spills them)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-fno-tree-reassoc",
         "-fschedule-insns", "-fsched-pressure", "-fPIC", "-shared")
ABI_VERSION = 5
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
COMPILE_TIMEOUT_S = 300
KERNELS_ENV = "DFLASH_KERNELS"
WRONG_SUMS = 3  # the exit status of a child whose build failed kernels_agree (_check_apart)


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: which instruction sums the 8-bit products (native/int8_matmul.c). Every
    variant gives the same bits; they differ in speed only."""
    name: str
    cpu_flags: tuple[str, ...]  # what /proc/cpuinfo must list for it
    compile_flags: tuple[str, ...]
    define: str  # the macro that selects it in the C source ("" for AVX2)

    def flags(self, emulate: bool = False) -> tuple[str, ...]:
        """Compiler flags; `emulate` (tests only) takes the instructions from SIMDe's headers instead, so the
        same source runs on a CPU without them."""
        if emulate and self.define:  # -O0: SIMDe's AVX-512 headers took 17-24 s a build at -O1 on 2 Zen 3 cores
            # and take 3-4 s at -O0, and under -ffp-contract=off every float operation is the same at any level
            return ("-O0", f"-D{self.define}", "-DDFQ_EMULATE")
        return (*self.compile_flags, *((f"-D{self.define}",) if self.define else ()))


# the fastest first: tiles for several rows beside vpdpbusd on 16 lanes, vpdpbusd on 16 lanes, on 8, then AVX2's
# maddubs + madd
VARIANTS = (
    Variant("amx", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"), "DFQ_AMX"),
    Variant("avx512-vnni", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"), "DFQ_AVX512_VNNI"),
    Variant("avx-vnni", ("avx_vnni",), ("-mavxvnni",), "DFQ_AVX_VNNI"),
    Variant("avx2", (), (), ""),
)


def variant_named(name: str) -> Variant:
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise ValueError(f"no kernel variant {name!r} (one of {', '.join(v.name for v in VARIANTS)})")


def variants_for(flags: set[str]) -> list[Variant]:
    """The variants a CPU with `flags` runs, the fastest first."""
    return [v for v in VARIANTS if set(v.cpu_flags) <= flags]


def chosen_variant(flags: set[str] | None = None) -> tuple[Variant, str]:
    """The variant to build here and why: $DFLASH_KERNELS when it names one this CPU runs, else the fastest."""
    flags = cpu_flags() if flags is None else flags
    runs = variants_for(flags)
    forced = os.environ.get(KERNELS_ENV, "").strip()
    if forced:
        variant = variant_named(forced)
        if variant not in runs:
            lacking = ", ".join(sorted(set(variant.cpu_flags) - flags))
            raise ValueError(f"{KERNELS_ENV}={forced}: this CPU lacks {lacking}")
        return variant, f"forced by {KERNELS_ENV}"
    best = runs[0]
    return best, (f"this CPU has {', '.join(best.cpu_flags)}" if best.cpu_flags else "no VNNI on this CPU")

P, LONG = ctypes.c_void_p, ctypes.c_long
SIGNATURES = {
    "dfq_quantize_rows": [P, LONG, LONG, P, P, P],
    "dfq_q4_matmul": [P, LONG, LONG, P, P, P, LONG, P, P],
    "dfq_q8_matmul": [P, LONG, LONG, P, P, LONG, P, P],
    "dfq_q8_rows": [P, P, LONG, LONG, P, LONG, P],
    "dfq_shortlist_rows": [P, LONG, LONG, P, P, P, LONG, P, LONG, LONG],
    "dfq_q8_to_q4": [P, P, LONG, LONG, P, P, P],
    "dfq_attention": [P, LONG, LONG, LONG, LONG, LONG, P, P, LONG, P, LONG, ctypes.c_float, P, ctypes.c_int],
    "dfq_stack_forward": [P, LONG, P, LONG, P, P, P, P, P, LONG, P, LONG, ctypes.c_int],
    "dfq_draft_layer_forward": [P, P, LONG, P, LONG, LONG, P, P, P, P, LONG],
    "dfq_amx_set_min_rows": [ctypes.c_int],
    "dfq_set_pair_min_rows": [ctypes.c_int],
    "dfq_set_guided_min_rows": [ctypes.c_int],
    "dfq_argmax_rows": [P, LONG, LONG, LONG, P],
    "dfq_argmax_confidence_rows": [P, LONG, LONG, LONG, P, P],
    "dfq_rms_norm_rows": [P, LONG, LONG, P, ctypes.c_float, P],
    "dfq_draft_greedy": [P, P, LONG, LONG, LONG, LONG, LONG, P, P, P, P, LONG, P, P, P],
    "dfq_model_forward": [P, P, LONG, P, LONG, P, P, P, P, P, LONG, P, LONG, ctypes.c_int, P, ctypes.c_int,
                          ctypes.c_int, P],
}
# what a call returns, where it returns something
RESULTS = {"dfq_stack_forward": ctypes.c_int, "dfq_argmax_rows": LONG, "dfq_argmax_confidence_rows": LONG,
           "dfq_q8_rows": LONG, "dfq_draft_greedy": ctypes.c_int,
           "dfq_model_forward": ctypes.c_int}


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
    variant: Variant = VARIANTS[-1]
    why: str = ""  # why this variant (doctor shows it)


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


def source_files() -> list[Path]:
    """Every file the build reads (sources and the headers they include)."""
    return sorted(p for p in source_dir().iterdir() if p.suffix in (".c", ".h"))


def _key(cc: str, variant: Variant) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(version.encode())
    for path in source_files():
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join((*FLAGS, *variant.flags())).encode())
    keyed = {"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_int8"}
    digest.update(" ".join(sorted(cpu_flags() & keyed)).encode())
    return digest.hexdigest()[:16]


def _why_not_here(flags: set[str] | None = None, cc: str | None | bool = False) -> str | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"torch reports {torch.backends.cpu.get_cpu_capability()} (the kernels need AVX2)"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in (cpu_flags() if flags is None else flags)]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if (compiler() if cc is False else cc) is None:
        return "no C compiler (cc or gcc) on the PATH to build them with"
    try:
        chosen_variant(flags)
    except ValueError as error:  # a DFLASH_KERNELS this CPU cannot run
        return str(error)
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


def _build(cc: str, out: Path, variant: Variant = VARIANTS[-1], emulate: bool = False) -> float:
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        made = Path(tmp) / out.name
        command = [cc, *FLAGS, *variant.flags(emulate), *(str(source_dir() / s) for s in SOURCES), "-o", str(made)]
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
        fn.argtypes, fn.restype = argtypes, RESULTS.get(name)
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
    variant, why = chosen_variant()  # _why_not_here checked it
    runs = variants_for(cpu_flags())
    # the chosen build, else the next fastest this CPU runs (AVX2 last): a build that fails costs speed, never
    # answers or the process
    later = [v for v in runs[runs.index(variant) + 1:] if v.define]
    candidates = [variant, *later, VARIANTS[-1]] if variant.define else [variant]
    for candidate, after in zip(candidates, candidates[1:]):
        got = _usable(cc, candidate, on_status)
        if isinstance(got, Built):
            got.why = why + _tiles_note(got)
            return got
        why = f"{got}: kept {'AVX2' if after is VARIANTS[-1] else after.name}"
    built = _built(cc, VARIANTS[-1], on_status)
    built.why = why
    return built


def _tiles_note(built: Built) -> str:
    if built.variant.name != "amx":
        return ""
    rows = built.lib.dfq_amx_min_rows()
    return (f"; tiles for calls of {rows}+ rows" if rows else
            "; tiles unused (Linux lent no tile state, or DFLASH_AMX_MIN_ROWS=0): VNNI on every call")


def _usable(cc: str, variant: Variant, on_status: Callable[[str], None] | None) -> Built | str:
    """`variant`'s build when it compiles and passes its check, else what went wrong (remembered in its cache
    folder, so the next start does not try again)."""
    failed = cache_folder() / _key(cc, variant) / "build-failed.txt"
    try:
        if failed.exists():
            return failed.read_text().strip()
    except OSError:
        pass
    try:
        built = _built(cc, variant, on_status)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:  # a compiler too old for the instructions
        problem = f"{cc} could not build {variant.name} ({error})"
    else:
        checked = _check_apart(built, variant)
        if checked is None:
            return built
        problem = checked
    try:
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text(problem)
    except OSError:
        pass
    return problem


def _check_apart(built: Built, variant: Variant) -> str | None:
    """kernels_agree for a new build, in a child process the first time: a build that dies on its first call
    (an instruction this CPU lacks after all, a tile shape it refuses) must not take the user's process with it.
    None when it passed (remembered beside the library). A child that cannot run the check at all (this
    package not importable from a bare interpreter) leaves it to this process, as before."""
    path = built.path
    passed = path.with_name("check-passed")
    if passed.exists():
        return None
    code = ("import sys; from pathlib import Path; from dflash_cli.engine.cpu import native; "
            f"sys.exit(0 if native.kernels_agree(native._load(Path(sys.argv[1]))) else {WRONG_SUMS})")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        return f"the {variant.name} build could not be checked ({error})"
    if done.returncode < 0:
        return f"the {variant.name} build crashed on its check ({signal.Signals(-done.returncode).name})"
    if done.returncode not in (0, WRONG_SUMS):
        return None if kernels_agree(built.lib) else f"the {variant.name} build gave wrong sums on its check"
    if done.returncode == WRONG_SUMS:
        return f"the {variant.name} build gave wrong sums on its check"
    try:
        passed.write_text("")
    except OSError:
        pass
    return None


def _built(cc: str, variant: Variant, on_status: Callable[[str], None] | None) -> Built:
    path = cache_folder() / _key(cc, variant) / "libdflash_int8.so"
    seconds = 0.0
    if not is_intact(path):  # not built yet, or damaged or replaced since: never opened
        if on_status is not None:
            on_status(f"Building the 8-bit-activation kernels ({variant.name}) for this CPU with {cc} "
                      "(once, a few seconds) ...")
        seconds = _build(cc, path, variant)
    try:
        return Built(_load(path), path, seconds, variant)
    except (OSError, AttributeError, RuntimeError) as error:
        # the file was ours and intact, and still did not load: a second build would not differ
        raise RuntimeError(f"{path} does not load ({error}); remove {path.parent} to build it again") from None


def build_variant(variant: Variant, folder: Path, emulate: bool = False) -> ctypes.CDLL:
    """`variant` built into `folder` and loaded, outside the cache (tests and benchmarks compare variants);
    `emulate`: its instructions from SIMDe's portable headers (Variant.flags)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on the PATH")
    torch.get_num_threads()
    path = folder / f"libdflash_int8-{variant.name}{'-emulated' if emulate else ''}.so"
    _build(cc, path, variant, emulate)
    return _load(path)


def can_emulate() -> bool:
    """Whether SIMDe's headers (Debian's libsimde-dev) are there to build an emulated variant."""
    cc = compiler()
    if cc is None:
        return False
    done = subprocess.run([cc, "-E", "-x", "c", "-"], input="#include <simde/x86/avx512.h>\n", capture_output=True,
                          text=True, timeout=COMPILE_TIMEOUT_S)
    return done.returncode == 0


def kernels_agree(lib: ctypes.CDLL) -> bool:
    """Whether `lib`'s q4 and q8 matmuls match a float64 reference of the same integer codes on a small
    random problem: 24 columns (a pair of groups and one alone), calls of 1, 5 and 17 rows (one group at a
    time; tiles of 4 and one; pairs of groups, and AMX's tile of 16 and one)."""
    from dflash_cli.engine.cpu.layout import pack_q4, pack_q8, pack_scales

    generator = torch.Generator().manual_seed(0)
    rows, n, k = 17, 24, 64
    x = torch.randn(rows, k, generator=generator)
    aq, ad, asum = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows, k // 32), torch.empty(rows, k // 32)
    lib.dfq_quantize_rows(x.data_ptr(), rows, k, aq.data_ptr(), ad.data_ptr(), asum.data_ptr())
    acts = (aq.double().view(rows, k // 32, 32) * ad.double()[..., None]).view(rows, k)
    d = (torch.rand(n, k // 32, generator=generator) * 0.1).half()
    mins = (torch.randn(n, k // 32, generator=generator) * 0.1).half()
    codes4 = torch.randint(0, 16, (n, k), generator=generator)
    codes8 = torch.randint(-127, 128, (n, k), generator=generator).to(torch.int8)
    w4 = (codes4.double().view(n, k // 32, 32) * d.double()[..., None] + mins.double()[..., None]).view(n, k)
    w8 = (codes8.double().view(n, k // 32, 32) * d.double()[..., None]).view(n, k)
    packed = pack_q4(codes4), pack_q8(codes8), pack_scales(d), pack_scales(mins)  # alive through the calls
    for m in (1, 5, rows):
        got4, got8 = torch.empty(m, n), torch.empty(m, n)
        lib.dfq_q4_matmul(x.data_ptr(), m, k, packed[0].data_ptr(), packed[2].data_ptr(), packed[3].data_ptr(), n,
                          None, got4.data_ptr())
        lib.dfq_q8_matmul(x.data_ptr(), m, k, packed[1].data_ptr(), packed[2].data_ptr(), n, None, got8.data_ptr())
        if not all(torch.allclose(got.double(), acts[:m] @ w.T, rtol=1e-4, atol=1e-4)
                   for got, w in ((got4, w4), (got8, w8))):
            return False
    return True


def library_if_built() -> Built | None:
    """library(), where it needs no compiling: the chosen build is in the cache (doctor asks, and then says
    which build really runs, after its check); else None."""
    got = _state.get("result")
    if got is not None:
        return got if isinstance(got, Built) else None
    cc = compiler()
    if _why_not_here() is not None or cc is None:
        return None
    if not is_intact(cache_folder() / _key(cc, chosen_variant()[0]) / "libdflash_int8.so"):
        return None
    return library()


def loaded() -> Built | None:
    """The library this process has loaded, or None (nothing built or loaded for it)."""
    got = _state.get("result")
    return got if isinstance(got, Built) else None


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
    buffers (1, kv, capacity, hd) of fp32 or fp16 whose row r holds position r, each row exact in any company
    (native/attention.c); (1, n, heads * hd)."""
    _, n, heads, hd = q.shape
    if q.stride(-1) != 1 or q.stride(2) != hd:
        q = q.contiguous()
    out = torch.empty(1, n, heads * hd)
    lib.dfq_attention(q.data_ptr(), q.stride(1), n, heads, keys.shape[1], hd, keys.data_ptr(), values.data_ptr(),
                      keys.shape[2], positions.data_ptr(), window or 0, scale, out.data_ptr(),
                      int(keys.dtype == torch.float16))
    return out


def argmax_rows(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor | None:
    """Each row's first maximum (torch.argmax's choice) of a CPU float32 (rows, n) tensor with unit column
    stride, as int64 (rows,); None when a row holds a NaN (torch's argmax picks it)."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    nans = lib.dfq_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return None if nans else out


def argmax_confidence_rows(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """argmax_rows, and each row's softmax probability of its maximum (float32 (rows,)); None when a row holds a
    NaN, or the library is a build from before the kernel (benchmarks/kernels_ab.py's baseline)."""
    if not hasattr(lib, "dfq_argmax_confidence_rows"):
        return None
    out, top = torch.empty(x.shape[0], dtype=torch.int64), torch.empty(x.shape[0], dtype=torch.float32)
    nans = lib.dfq_argmax_confidence_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                                          top.data_ptr())
    return None if nans else (out, top)


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of a CPU float32 tensor's rows (x / sqrt(mean(x^2) + eps) * weight) in one call; None where the
    kernel does not take it (another dtype or device, a width not a multiple of 8)."""
    k = x.shape[-1]
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or k % 8:
        return None
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    lib.dfq_rms_norm_rows(x.data_ptr(), x.numel() // k, k, weight.data_ptr(), eps, out.data_ptr())
    return out
