"""`dflash-cli doctor`: an environment report for bug reports.

:func:`collect` gathers the checks as plain data (no printing); :func:`render_text` and :func:`to_json`
turn them into the command's output. Importing this module is cheap: torch, transformers, bitsandbytes
and huggingface_hub load inside the collectors, so `dflash-cli --help` stays fast.

Every collector is run through :func:`_safe`: a collector that raises becomes one `warn` check instead of
a crash, so the report always comes out (that is when it is needed most).
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import logging
import os
import platform
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_cli.sysinfo import system_memory

OK, WARN, FATAL = "ok", "warn", "fatal"
STATUSES = (OK, WARN, FATAL)
LOW_MEMORY_BYTES = 2 * 1024**3
MIN_PYTHON = (3, 11)

# Distribution names whose absence is fatal (torch and transformers are checked by importing them).
REQUIRED_PACKAGES = ("huggingface-hub", "accelerate", "safetensors", "tokenizers", "prompt-toolkit", "rich",
                     "click")


@dataclass(frozen=True)
class Check:
    """One line of the report. `value` is for people; `data` (optional) is the raw value for scripts."""

    name: str
    value: str
    status: str = OK
    hint: str | None = None
    data: Any = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


def _fmt_bytes(n: int | None) -> str:
    from dflash_cli.units import fmt_bytes

    return fmt_bytes(n)


def _dist_version(dist: str) -> str:
    """The installed version of a distribution; raises importlib.metadata.PackageNotFoundError."""
    return metadata.version(dist)


def _requirement_for(dist: str) -> Any:
    """dflash-cli's own requirement on `dist` (a packaging Requirement), or None when unknown."""
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name

        for line in metadata.requires("dflash-cli") or []:
            req = Requirement(line)
            if canonicalize_name(req.name) == canonicalize_name(dist) and not req.marker:
                return req
    except Exception:  # packaging missing or odd metadata: no version check
        return None
    return None


def _version_check(name: str, dist: str, version: str) -> Check:
    req = _requirement_for(dist)
    if req is not None and req.specifier and not req.specifier.contains(version, prereleases=True):
        return Check(name, version, WARN, f"dflash-cli needs {req}: pip install -U '{req}'", version)
    return Check(name, version, data=version)


def _path_state(path: Path) -> str:
    return f"{path}" if path.exists() else f"{path} (not created yet)"


# ---------------------------------------------------------------------------------------------------------
# Collectors: each returns a list of checks and never prints
# ---------------------------------------------------------------------------------------------------------


def check_dflash() -> list[Check]:
    from dflash_cli import __version__

    return [Check("dflash-cli", __version__, data=__version__)]


def check_python() -> list[Check]:
    v = sys.version_info
    version = f"{v.major}.{v.minor}.{v.micro}"
    impl = platform.python_implementation()
    if (v.major, v.minor) < MIN_PYTHON:
        python = Check("python", f"{version} ({impl})", FATAL,
                       f"dflash-cli needs Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer", version)
    else:
        python = Check("python", f"{version} ({impl})", data=version)
    return [python, Check("python executable", sys.executable, data=sys.executable)]


def check_platform() -> list[Check]:
    value = f"{platform.platform()} ({platform.machine() or 'unknown machine'})"
    return [Check("platform", value, data={"system": platform.system(), "release": platform.release(),
                                           "machine": platform.machine(), "platform": platform.platform()})]


def check_torch() -> list[Check]:
    try:
        import torch
    except Exception as error:  # any import failure is the finding
        return [Check("torch", f"not importable ({type(error).__name__}: {error})", FATAL,
                      "install PyTorch first: https://pytorch.org/get-started/locally/", None)]
    if getattr(torch.version, "cuda", None):
        build = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip}"
    else:
        build = "CPU-only build"
    return [Check("torch", torch.__version__, data=torch.__version__),
            Check("torch build", build, data={"cuda": torch.version.cuda,
                                              "hip": getattr(torch.version, "hip", None)})]


def _driver_version() -> str | None:
    """The NVIDIA driver version (nvml, then nvidia-smi), else the CUDA driver API version torch sees."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # optional source
        pass
    try:
        import shutil
        import subprocess

        smi = shutil.which("nvidia-smi")
        if smi:
            done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=10, check=True)
            first = done.stdout.strip().splitlines()
            if first and first[0].strip():
                return first[0].strip()
    except Exception:  # optional source
        pass
    try:
        import torch

        api = torch._C._cuda_getDriverVersion()  # type: ignore[attr-defined]  # private, present in CUDA builds
        if api:
            return f"CUDA driver API {api // 1000}.{(api % 1000) // 10}"
    except Exception:  # private API, may be missing
        pass
    return None


def check_gpu() -> list[Check]:
    try:
        import torch
    except Exception:  # reported by check_torch
        return [Check("cuda available", "unknown (torch is not importable)", WARN, None, None)]
    if not torch.cuda.is_available():
        extra = ""
        try:
            if torch.backends.mps.is_available():
                extra = " (Apple MPS is available)"
        except Exception:
            pass
        hint = ("no GPU: speculation runs on the CPU (works, but slower)"
                + ("" if torch.version.cuda else "; for an NVIDIA GPU install a CUDA build of torch"))
        return [Check("cuda available", "no" + extra, WARN, hint, False),
                Check("gpu", "none", data=[])]
    count = torch.cuda.device_count()
    checks = [Check("cuda available", f"yes ({count} device{'s' if count != 1 else ''})", data=True)]
    driver = _driver_version()
    checks.append(Check("cuda driver", driver or "unknown", data=driver))
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        checks.append(Check(f"gpu {i}", f"{props.name} (compute capability {props.major}.{props.minor})",
                            data={"name": props.name, "capability": [props.major, props.minor]}))
        checks.append(_attention_check(torch.device("cuda", i)))
        try:
            free, total = torch.cuda.mem_get_info(i)
        except Exception as error:  # a busy or broken device
            checks.append(Check(f"gpu {i} memory", f"unknown ({error})", WARN,
                                "the GPU did not report its memory; check nvidia-smi", None))
            continue
        value = f"{_fmt_bytes(free)} free of {_fmt_bytes(total)}"
        data = {"free_bytes": free, "total_bytes": total}
        if free < LOW_MEMORY_BYTES:
            checks.append(Check(f"gpu {i} memory", value, WARN,
                                "less than 2 GiB free: close other GPU programs, or use --quant nf4", data))
        else:
            checks.append(Check(f"gpu {i} memory", value, data=data))
    return checks


def _attention_check(device: Any) -> Check:
    """The dtype a model computes in on this GPU and the attention kernel the engine's calls get there,
    for a target shaped like Qwen3-8B (32 query heads over 8 key/value heads of 128)."""
    from dflash_cli.engine.device import cuda_dtype
    from dflash_cli.engine.kernels import attention_kernel

    dtype = cuda_dtype(device)
    kernel = attention_kernel(device, dtype, heads=32, kv_heads=8, head_dim=128)
    value = f"{kernel} in {str(dtype).replace('torch.', '')}"
    if kernel.startswith("math"):
        return Check(f"gpu {device.index} attention", value, WARN,
                     "long prompts will need GiBs for attention scores: update torch", value)
    return Check(f"gpu {device.index} attention", value, data=value)


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def check_cpu() -> list[Check]:
    logical = os.cpu_count()
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = logical
    value = f"{logical or 'unknown'}" + (f" ({usable} usable)" if usable != logical else "")
    try:
        import torch

        value += f", torch uses {torch.get_num_threads()} thread(s)"
    except Exception:
        pass
    checks = [Check("cpu cores", value, data={"logical": logical, "usable": usable}), _check_threads()]

    total, available = system_memory()
    checks.append(Check("system memory", _fmt_bytes(total) if total is not None else "unknown", data=total))
    on_cpu = not _cuda_available()
    if available is None:
        checks.append(Check("available memory", "unknown", data=None))
    elif on_cpu and available < LOW_MEMORY_BYTES:
        checks.append(Check("available memory", _fmt_bytes(available), WARN,
                            "less than 2 GiB of memory free: close other programs, or use --quant nf4 or a "
                            "smaller model", available))
    else:
        checks.append(Check("available memory", _fmt_bytes(available), data=available))

    try:
        from dflash_cli.engine.device import cpu_has_fast_bf16

        bf16 = cpu_has_fast_bf16()
        checks.append(Check("cpu bf16", "yes (native AVX512-BF16/AMX)" if bf16 else
                            "no (CPU runs use float32 by default)", data=bf16))
    except Exception as error:  # engine import needs torch
        checks.append(Check("cpu bf16", f"unknown ({type(error).__name__})", data=None))
    try:
        from dflash_cli.engine.device import cpu_auto_quant

        chosen, why = cpu_auto_quant()
        checks.append(Check("cpu format", f"{chosen or 'none'} for --quant auto and the built-in models ({why})",
                            data={"quant": chosen, "why": why}))
    except Exception as error:  # engine import needs torch
        checks.append(Check("cpu format", f"unknown ({type(error).__name__})", data=None))
    checks.append(check_kernels())
    return checks


def check_kernels() -> Check:
    """Which build of the q4a8/q8a8 kernels this CPU gets (engine/cpu/native.py's variants), without building."""
    try:
        from dflash_cli.engine.cpu import native

        missing = native.available_without_building()
        if missing is not None:
            forced = native.KERNELS_ENV in missing
            return Check("cpu kernels", f"none ({missing})", WARN if forced else OK,
                         f"unset {native.KERNELS_ENV}, or name one this CPU runs" if forced else None, data=None)
        built = native.library_if_built()  # the build that runs, after its check; else the one to build
        variant, why = (built.variant, built.why) if built is not None else native.chosen_variant()
        runs = [v.name for v in native.variants_for(native.cpu_flags())]
    except Exception as error:  # engine import needs torch
        return Check("cpu kernels", f"unknown ({type(error).__name__})", data=None)
    others = [name for name in runs if name != variant.name]
    value = (f"{variant.name} ({why}{'' if built is not None else '; built at first use'})"
             + (f"; this CPU also runs {', '.join(others)}" if others else ""))
    return Check("cpu kernels", value, data={"variant": variant.name, "why": why, "runs": runs,
                                             "built": built is not None})


def _check_threads() -> Check:
    """The thread count a CPU generation would start with now, from what other processes keep busy."""
    from dflash_cli import settings as S

    forced = os.environ.get(S.ENV["threads"])
    try:
        from dflash_cli.engine.cpu.threads import ThreadGovernor

        governor = ThreadGovernor(apply=lambda n: None)
        chosen = governor.measure()
    except Exception as error:  # engine import needs torch
        return Check("cpu threads", f"unknown ({type(error).__name__})", data=None)
    busy = governor.others_busy
    value = (f"{chosen} of {len(governor.cpus)} usable (auto: other processes keep "
             + (f"{busy:.1f} core(s) busy now" if busy is not None else "an unknown share busy")
             + "; re-checked every half second while generating)")
    if forced:
        value = f"{forced} ({S.ENV['threads']}); auto would take {value}"
    status = WARN if busy is not None and chosen < governor.most else OK
    hint = "other processes keep cores busy: generation runs on fewer threads until they finish" \
        if status == WARN else None
    data = {"auto": chosen, "others_busy": busy, "forced": int(forced) if forced and forced.isdigit() else None}
    return Check("cpu threads", value, status, hint, data=data)


def check_bitsandbytes() -> list[Check]:
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # it warns about the optional `kernels`
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes
    except Exception as error:  # ImportError, or a broken native library
        return [Check("bitsandbytes", f"not available ({type(error).__name__}: {error})", WARN,
                      "--quant int8/nf4 needs it: pip install bitsandbytes", None)]
    version = getattr(bitsandbytes, "__version__", None)
    if not version:
        try:
            version = _dist_version("bitsandbytes")
        except metadata.PackageNotFoundError:
            version = "unknown"
    backend = "cuda" if _cuda_available() else "cpu"
    return [_version_check("bitsandbytes", "bitsandbytes", version),
            Check("bitsandbytes backend", backend,
                  hint="bitsandbytes never needs the optional `kernels` package; do not install it "
                       "(it downloads from the Hub at import)", data=backend)]


def check_transformers() -> list[Check]:
    try:
        import transformers
    except Exception as error:  # any import failure is the finding
        return [Check("transformers", f"not importable ({type(error).__name__}: {error})", FATAL,
                      "pip install 'transformers>=5,<6'", None)]
    return [_version_check("transformers", "transformers", transformers.__version__)]


def check_packages() -> list[Check]:
    checks = []
    for dist in REQUIRED_PACKAGES:
        name = dist.replace("-", "_")
        try:
            version = _dist_version(dist)
        except metadata.PackageNotFoundError:
            checks.append(Check(name, "not installed", FATAL, f"pip install {dist}", None))
            continue
        checks.append(_version_check(name, dist, version))
    return checks


def token_source() -> tuple[str, str | None]:
    """(source, path) of the Hub token: never the token itself."""
    from dflash_cli.models.folders import token_path

    if os.environ.get("HF_TOKEN", "").strip():
        return "HF_TOKEN environment variable", None
    path = token_path()
    try:
        if path.is_file() and path.read_text(encoding="utf-8").strip():
            return "token file", str(path)
    except OSError:
        pass
    return "none", None


def check_hub() -> list[Check]:
    from dflash_cli.models.folders import default_cache_dir, offline_variable

    cache = default_cache_dir()
    checks = [Check("hf cache", str(cache), data=str(cache))]
    if not cache.is_dir():
        checks.append(Check("hf cache size", "0 B (no cache yet)", data={"bytes": 0, "repos": 0}))
    else:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(cache)
        repos = len(info.repos)
        value = f"{_fmt_bytes(info.size_on_disk)} in {repos} repo{'s' if repos != 1 else ''}"
        data = {"bytes": info.size_on_disk, "repos": repos}
        if info.warnings:
            checks.append(Check("hf cache size", f"{value}, {len(info.warnings)} unreadable", WARN,
                                f"`hf cache scan` lists them; first: {info.warnings[0]}", data))
        else:
            checks.append(Check("hf cache size", value, data=data))
    offline = offline_variable()  # as a command started now reads it
    checks.append(Check("hf offline", f"yes ({offline})" if offline else "no", data=offline is not None))
    source, path = token_source()
    if source == "none":
        checks.append(Check("hf token", "none", hint="only gated or private repos need one: `hf auth login` "
                            "or HF_TOKEN", data={"source": None}))
    else:
        checks.append(Check("hf token", source + (f" ({path})" if path else ""),
                            data={"source": source, "path": path}))
    return checks


def dflash_cache_dir() -> Path:
    from dflash_cli.settings import cache_dir

    return cache_dir()


def check_dirs() -> list[Check]:
    from dflash_cli import settings

    data, cache = settings.data_dir(), dflash_cache_dir()
    return [Check("data dir", _path_state(data), data=str(data)),
            Check("cache dir", _path_state(cache), data=str(cache))]


def check_smollm2() -> list[Check]:
    from dflash_cli.models import smollm2

    try:
        gguf = smollm2.gguf_path()
    except smollm2.SmolLM2NotInstalled:
        return [Check("smollm2", "not installed (optional built-in model)",
                      hint=f"to use -m smollm2-135m offline: {smollm2.INSTALL_HINT}",
                      data={"installed": False, "converted": False})]
    converted = smollm2.is_converted()
    value = "installed, " + ("converted" if converted else "not converted yet (done once on first use)")
    return [Check("smollm2", value, data={"installed": True, "converted": converted, "gguf": str(gguf)})]


def _safe(collector: Callable[[], list[Check]]) -> list[Check]:
    try:
        return list(collector())
    except Exception as error:  # the report must come out whatever breaks
        name = getattr(collector, "__name__", "check").removeprefix("check_").replace("_", " ")
        return [Check(name, f"check failed ({type(error).__name__}: {error})", WARN,
                      "please include this line in your bug report", None)]


def collect() -> list[Check]:
    """Every check, in report order. Pure data: prints nothing."""
    collectors = (check_dflash, check_python, check_platform, check_torch, check_gpu, check_cpu,
                  check_bitsandbytes, check_transformers, check_packages, check_hub, check_dirs, check_smollm2)
    checks: list[Check] = []
    for collector in collectors:
        checks.extend(_safe(collector))
    return checks


# ---------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------


def is_ok(checks: list[Check]) -> bool:
    return not any(c.status == FATAL for c in checks)


def to_json(checks: list[Check]) -> str:
    return json.dumps({"checks": [c.to_dict() for c in checks], "ok": is_ok(checks)}, indent=2)


def render_text(checks: list[Check], color: bool = False) -> list[str]:
    """Aligned `name: value` lines; warn/fatal lines carry a marker and, below them, their hint."""
    from dflash_cli.ui.render import BOLD, RED, RESET, YELLOW

    width = max((len(c.name) for c in checks), default=0) + 1
    lines = []
    for c in checks:
        line = f"{c.name + ':':<{width}} {c.value}"
        if c.status != OK:
            marker = "[warning]" if c.status == WARN else "[FATAL]"
            style = YELLOW if c.status == WARN else RED + BOLD
            line += "  " + (f"{style}{marker}{RESET}" if color else marker)
            if c.hint:
                lines.append(line)
                line = f"{'':<{width}} hint: {c.hint}"
        lines.append(line)
    return lines


def run_doctor(out: Any, *, as_json: bool, color: bool) -> int:
    """The command body: prints the report to stdout, a one-line summary to stderr; 1 when anything is fatal."""
    checks = collect()
    if as_json:
        print(to_json(checks), file=out.out, flush=True)
    else:
        print("\n".join(render_text(checks, color)), file=out.out, flush=True)
        fatal = [c for c in checks if c.status == FATAL]
        warned = [c for c in checks if c.status == WARN]
        if fatal:
            out.error(f"{len(fatal)} fatal problem(s): {', '.join(c.name for c in fatal)}",
                      fatal[0].hint)
        elif warned:
            out.info(f"{len(warned)} warning(s), no fatal problems")
    return 0 if is_ok(checks) else 1
