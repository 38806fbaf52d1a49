"""Opening a model pair: the options that name it, the one way from them to a running model, and what a
command may use of the result.

`open_runtime(ModelOptions(...))` resolves the names (a folder, a registry name, a Hub repo id, the built-in
demo), checks the pair, the block size and the memory from config files before any download, then loads
the pair here (`LocalRuntime`) or, with `engine`, connects to an OpenAI-compatible server
(remote.RemoteRuntime). generate, chat, bench, serve and `dflash_cli.load` all come through here, and each
setting is resolved once (the device, the split over devices, the quantization) and handed down.
Commands use only what the `Runtime` protocol names, whichever kind they hold.

The package: local.py (the pair loaded here), remote.py and remote_stats.py (a pair on a vLLM/SGLang server
and the acceptance it reports), launch.py (the vLLM/SGLang command line `serve-cmd` prints).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Protocol, runtime_checkable

from dflash_cli import settings as S
from dflash_cli.engine.errors import InvalidSettingError

if TYPE_CHECKING:  # the engine imports torch: only for annotations here
    from dflash_cli.conversation import ChatHistory
    from dflash_cli.engine.placement import Placement
    from dflash_cli.runtime.local import LocalRuntime

Status = Callable[[str], None]


@dataclass(frozen=True)
class ModelOptions:
    """What to open and how: the model options of generate, chat, bench and serve, and of `dflash_cli.load`.

    quant None: "auto" for the built-in models, "none" for the rest; max_context None: the model's own
    (the memory check plans settings.DEFAULT_MAX_CONTEXT); engine: an OpenAI-compatible server's URL, which
    then runs the model (and `timeout` bounds each wait for it)."""

    model: str | None = None
    draft: str | None = None
    no_draft: bool = False
    quant: str | None = S.DEFAULT_QUANT
    dtype: str = S.DEFAULT_DTYPE
    device: str = S.DEFAULT_DEVICE
    device_map: str | None = S.DEFAULT_DEVICE_MAP
    max_memory: str | dict[str, int] | None = None
    compile: str = S.DEFAULT_COMPILE
    max_context: int | None = S.DEFAULT_MAX_CONTEXT
    engine: str | None = None
    timeout: float | None = None
    threads: int | None = None  # CPU threads; None: chosen from the free cores while generating
    draft_window: int | None = None  # the drafter's context window in tokens; 0: all; None: its config's, else all


@runtime_checkable
class Runtime(Protocol):
    """What a command may use of an opened model, loaded here (LocalRuntime) or served (remote.RemoteRuntime)."""

    load_seconds: float

    @property
    def speculative(self) -> bool:
        """Replies are decoded speculatively (by a server: as it decides; its statistics say)."""

    @property
    def marks_drafted(self) -> bool:
        """Each Step says which of its tokens the drafter proposed (the provenance colours)."""

    @property
    def model_name(self) -> str:
        """The target: its folder, or the model a server serves."""

    @property
    def drafter_name(self) -> str | None:
        """The drafter's folder (None: none here, or a server's own)."""

    @property
    def forward(self) -> str:
        """What runs the target's forwards, in words (--verbose, --json, /show info)."""

    @property
    def trained_block_size(self) -> int | None:
        """The loaded drafter's trained block size (None: no drafter here, or a server's own)."""

    @property
    def first_token_wait(self) -> str | None:
        """What the status line says while a reply's first token is awaited (None: nothing to say)."""

    def ready_line(self) -> str:
        """The line said once the model is open: the pair, where it runs, how long opening took."""

    def banner(self) -> str:
        """chat's first line: what answers."""

    def info(self) -> dict[str, Any]:
        """What /show info and --verbose print about it."""

    def conversation(self, system: str | None = None) -> ChatHistory:
        """A new chat answered by it."""

    def supports_thinking(self) -> bool | None:
        """Whether the chat template has a thinking switch (None: unknown, a server's template)."""

    def thinking_mode(self, think: bool | None) -> bool | None:
        """The thinking mode a reply runs in with the setting `think` (None: no switch, or unknown)."""

    def trained_thinking(self) -> tuple[str, bool] | None:
        """(registry name, thinking mode) the loaded drafter was trained with, where the registry says."""

    def check_block_size(self, block_size: int | None) -> None:
        """Raises InvalidSettingError unless replies can use `block_size` (None: the drafter's own)."""

    def close(self) -> None:
        """Releases what it holds open (a connection)."""


def open_runtime(options: ModelOptions, *, block_size: int | None = None, on_status: Status | None = None,
                 on_notice: Status | None = None, before_weights: Callable[[Any], None] | None = None,
                 busy: Callable[[str], ContextManager[Any]] | None = None) -> Runtime:
    """The model `options` name, ready to answer: loaded here, or (options.engine) the server connected to.

    `block_size` (the one replies will ask for) is checked against the drafter's config before any download.
    `on_status` gets progress lines (downloads, what --quant auto chose), `on_notice` one-line warnings;
    `before_weights(tokenizer)` runs before the weights load (checks that need the tokenizer alone).
    `busy(message)` wraps each long wait (loading the weights, connecting): the UI's spinner; what it yields,
    if callable, receives the status lines said during the wait (compiling)."""
    if options.engine:
        from dflash_cli.runtime.remote import RemoteRuntime, redact_url

        with _busy(busy, f"Connecting to {redact_url(options.engine)} ..."):  # never the password, even here
            return RemoteRuntime(options.engine, options.model, S.api_key(), timeout=options.timeout)
    return open_local(options, block_size=block_size, on_status=on_status, on_notice=on_notice,
                      before_weights=before_weights, busy=busy)


def open_local(options: ModelOptions, *, block_size: int | None = None, on_status: Status | None = None,
               on_notice: Status | None = None, before_weights: Callable[[Any], None] | None = None,
               busy: Callable[[str], ContextManager[Any]] | None = None) -> LocalRuntime:
    """`open_runtime` for a pair loaded here (its `engine` is not used)."""
    from dflash_cli.engine.placement import resolve_placement
    from dflash_cli.models.memory.preflight import placement_budget
    from dflash_cli.models.resolve import resolve_pair
    from dflash_cli.runtime.local import load_runtime

    if not options.model:
        raise InvalidSettingError("no model given", hint="name a folder, a known name such as qwen3-8b, or a Hub "
                                                         "repo id (-m/--model, DFLASH_MODEL)")
    status = on_status or (lambda _: None)
    placement = resolve_placement(options.device, options.device_map, options.max_memory)  # before any download
    budget = placement_budget(placement, options.dtype, options.max_context or S.DEFAULT_MAX_CONTEXT)
    pair = resolve_pair(options.model, options.draft, no_draft=options.no_draft, on_status=status,
                        quant=options.quant, budget=budget, block_size=block_size)
    if options.quant == "auto":
        status(f"--quant auto: {_auto_quant_reason(pair.quant, placement)}")
    with _busy(busy, f"Loading {options.model} ...") as update:
        runtime = load_runtime(pair.target_dir, pair.drafter_dir, quant=pair.quant, quant_auto=pair.quant_auto,
                               dtype=options.dtype, placement=placement, compile=options.compile,
                               max_context=options.max_context, threads=options.threads,
                               draft_window=options.draft_window, on_notice=on_notice,
                               on_status=update if callable(update) else status, before_weights=before_weights)
    runtime.drafter_entry, runtime.note = pair.drafter_entry, pair.drafter_note
    return runtime


def _busy(busy: Callable[[str], ContextManager[Any]] | None, message: str) -> ContextManager[Any]:
    return busy(message) if busy is not None else contextlib.nullcontext()


def _auto_quant_reason(chosen: str, placement: Placement) -> str:
    """What --quant auto chose, and why: on a CPU the format measured fastest there, else what fits."""
    from dflash_cli.engine.device import cpu_auto_quant

    what = chosen if chosen != "none" else "no quantization"
    return f"{what} ({cpu_auto_quant()[1]})" if placement.device.type == "cpu" else f"{what} fits"
