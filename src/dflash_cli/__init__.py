"""dflash-cli: lossless block-diffusion speculative decoding (DFlash) from the terminal and from Python.

    import dflash_cli
    runtime = dflash_cli.load("smollm2-135m")             # or a folder; draft="DRAFTER_FOLDER" to speculate
    print(dflash_cli.generate(runtime, "Hello!", max_new_tokens=32).text)

Importing this package is cheap: torch and transformers load only when a model does (the names below
are imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "load": "dflash_cli.api", "stream_generate": "dflash_cli.api", "generate": "dflash_cli.api",
    "Runtime": "dflash_cli.runtime", "LocalRuntime": "dflash_cli.runtime.local", "ModelOptions": "dflash_cli.runtime",
    "Step": "dflash_cli.engine.response", "GenerationResult": "dflash_cli.engine.response",
    "GenerationStats": "dflash_cli.engine.response",
    "DFlashError": "dflash_cli.engine.errors",
}
__all__ = ["load", "stream_generate", "generate", "Runtime", "LocalRuntime", "ModelOptions", "Step",
           "GenerationResult", "GenerationStats",
           "DFlashError", "__version__"]

if TYPE_CHECKING:
    from dflash_cli.api import generate, load, stream_generate
    from dflash_cli.engine.errors import DFlashError
    from dflash_cli.engine.response import GenerationResult, GenerationStats, Step
    from dflash_cli.runtime import ModelOptions, Runtime
    from dflash_cli.runtime.local import LocalRuntime


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_cli' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
