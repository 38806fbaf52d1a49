"""Exceptions -> one line of cause, one line of fix, and an exit code. Tracebacks only with --debug."""

from __future__ import annotations

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def describe(error: BaseException) -> tuple[str, str | None, int]:
    """(message, hint, exit code) for an exception that reached the command line."""
    from dflash_cli.engine.errors import DFlashError, InvalidSettingError
    from dflash_cli.settings import ConfigError

    if isinstance(error, ConfigError):
        return str(error), error.hint, error.exit_code
    if isinstance(error, InvalidSettingError):
        return str(error), error.hint, EXIT_USAGE
    if isinstance(error, DFlashError):
        return str(error), error.hint, EXIT_ERROR
    if type(error).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError, without importing torch
        return ("out of GPU memory while generating",
                "try --quant nf4, a smaller --block-size, a shorter prompt, or fewer --max-tokens", EXIT_ERROR)
    if isinstance(error, MemoryError):
        return "out of memory", "try --quant nf4 or a smaller model", EXIT_ERROR
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (f"unexpected {type(error).__name__}" + (f": {first}" if first else ""),
            "run again with --debug (or DFLASH_DEBUG=1) to see the traceback, and report it", EXIT_ERROR)
