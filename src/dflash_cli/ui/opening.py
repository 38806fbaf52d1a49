"""Opening the model for a command at the terminal: runtime.open_runtime with a spinner around the long
waits, the options a server ignores said once, the ready line, and the thinking-mode warnings."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

from dflash_cli import settings as S

if TYPE_CHECKING:
    from dflash_cli.runtime import Runtime

NO_MODEL = ("no model given: pass -m/--model (a folder, a known name such as qwen3-8b, or a Hub repo id), "
            "or set DFLASH_MODEL")


def open_model(out: Any, options: Any, *, quiet: bool, settings: Any = None,
               before_weights: Callable[[Any], None] | None = None) -> Any:
    """The Runtime `options` (runtime.ModelOptions) name, opened: progress on stderr unless `quiet`; warnings
    always, but the options a server ignores are said unless `quiet`. `settings` (GenerationSettings, where
    the command has them): their block size is checked before any download, and with an engine the ones
    only a local model uses are said to be ignored."""
    from dflash_cli.runtime import open_runtime

    if options.engine:
        warn_engine_ignores(out, options, settings, quiet=quiet)
    elif not options.model:
        raise click.UsageError(NO_MODEL)

    @contextlib.contextmanager
    def busy(message: str) -> Iterator[Callable[[str], None] | None]:
        with out.spinner(message) as spinner:  # its line shows what a long step (compiling) is doing
            yield spinner.update if spinner is not None else None

    runtime = open_runtime(options, block_size=getattr(settings, "block_size", None),
                           on_status=(lambda _: None) if quiet else out.info, on_notice=out.warn,
                           before_weights=before_weights, busy=busy)
    if not quiet:
        out.info(runtime.ready_line())
    return runtime


def engine_ignores(options: Any, settings: Any = None) -> list[str]:
    """The flags given that only a model loaded here uses."""
    local = {"--block-size": settings is not None and settings.block_size is not None,
             "--quant": options.quant not in (None, "none"),
             "--dtype": options.dtype not in (None, S.DEFAULT_DTYPE),
             "--device": options.device not in (None, S.DEFAULT_DEVICE),
             "--compile": options.compile not in (None, S.DEFAULT_COMPILE),
             "--max-context": options.max_context not in (None, S.DEFAULT_MAX_CONTEXT),
             "--no-chat-template": settings is not None and not settings.chat_template,
             "--device-map": options.device_map not in (None, S.DEFAULT_DEVICE_MAP),
             "--max-memory": options.max_memory is not None,
             "--no-draft": options.no_draft}
    return [name for name, given in local.items() if given]


def warn_engine_ignores(out: Any, options: Any, settings: Any, *, quiet: bool) -> None:
    """Said once, not dropped without a word (--hide-thinking, --think and the sampling options apply to a
    remote reply too)."""
    if quiet:
        return
    if options.draft:
        out.warn("--draft is ignored with --engine: the server runs its own drafter")
    ignored = engine_ignores(options, settings)
    if ignored:
        out.warn(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored with --engine: "
                 "the server loads and runs the model, with its own chat template")


def check_thinking(out: Any, runtime: Runtime, think: bool | None, *, chat_template: bool = True,
                   drafter: bool = True) -> None:
    """Warns when the think setting cannot apply, and (`drafter`) when the thinking mode differs from the
    one the registry says the drafter was trained with."""
    if think is not None and runtime.supports_thinking() is False:
        out.warn("this model's chat template has no thinking switch: the think setting is ignored")
    warning = drafter_thinking_warning(runtime, think) if drafter and chat_template else None
    if warning:
        out.warn(warning)


def check_format(settings: Any) -> None:
    """A structured reply starts at its first token: it cannot also open with the model's reasoning."""
    if settings.output_format is not None and settings.think:
        from dflash_cli.engine.errors import InvalidSettingError

        raise InvalidSettingError(f"--think cannot be combined with {settings.output_format.describe()}: the "
                                  "reply must follow the format from its first token",
                                  hint="drop --think (a format turns thinking off by itself)")


def drafter_thinking_warning(runtime: Runtime, think: bool | None) -> str | None:
    trained = runtime.trained_thinking()
    if trained is None:
        return None
    alias, trained_mode = trained
    mode = runtime.thinking_mode(think)
    if mode is None or mode == trained_mode:
        return None
    trained_word, chosen = ("on", "off") if trained_mode else ("off", "on")
    switch = "think" if trained_mode else "no-think"
    return (f"the drafter for {alias} was trained with thinking {trained_word}: with thinking {chosen}, expect "
            f"lower acceptance (fewer tokens per step); --{switch} (chat: /set {switch.replace('-', '')}) "
            "matches its training")
