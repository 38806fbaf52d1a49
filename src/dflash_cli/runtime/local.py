"""The pair loaded here: `LocalRuntime` (the Runtime protocol of runtime/__init__.py), and `load_runtime`, which loads
a target folder and its drafter folder and puts the target on its fast path (compiled where that pays).

`runtime.open_runtime` turns names into folders and checks what can be checked first; this module does
the loading itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dflash_cli import settings as S
from dflash_cli.engine.errors import CheckpointError, InvalidSettingError

if TYPE_CHECKING:  # the engine imports torch: only for annotations here
    from dflash_cli.conversation import Conversation
    from dflash_cli.engine.drafter import Drafter
    from dflash_cli.engine.placement import Placement
    from dflash_cli.engine.target import Target
    from dflash_cli.models.registry import PairEntry

Status = Callable[[str], None]


@dataclass
class LocalRuntime:
    """A target, its drafter (or None) and its tokenizer, loaded once per process."""

    target: Target
    drafter: Drafter | None
    tokenizer: Any
    target_dir: Path
    drafter_dir: Path | None
    load_seconds: float
    quant: str | None
    dtype: str
    device: str
    forward: str = "transformers forward"
    drafter_entry: PairEntry | None = None  # the registry pair whose drafter is loaded (its thinking mode), else None
    note: str = ""  # why speculation is on or off (the ready line)
    costs_key: dict[str, Any] | None = None  # where the drafter's round costs are kept for the next process

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def marks_drafted(self) -> bool:
        return self.speculative

    @property
    def model_name(self) -> str:
        return str(self.target_dir)

    @property
    def drafter_name(self) -> str | None:
        return str(self.drafter_dir) if self.drafter_dir else None

    @property
    def first_token_wait(self) -> str | None:
        return None  # the status line shows the prefill itself

    @property
    def trained_block_size(self) -> int | None:
        return self.drafter.block_size if self.drafter is not None else None

    def ready_line(self) -> str:
        where = f"{self.device} {self.dtype}" + (f" {self.quant}" if self.quant else "")
        if self.target.split:
            where += f" · layers on {self.target.placement}"
        note = self.note or ("speculation on" if self.speculative else "speculation off")
        block = f" (block {self.drafter.block_size})" if self.drafter is not None else ""
        return f"{note}{block} · {where} · loaded in {self.load_seconds:.1f}s"

    def banner(self) -> str:
        if self.drafter is None or self.drafter_dir is None:
            return f"{self.target_dir.name} · speculation off"
        return f"{self.target_dir.name} + drafter {self.drafter_dir.name} (block {self.drafter.block_size})"

    def info(self) -> dict[str, Any]:
        cfg = self.target.config
        out = {"target": str(self.target_dir), "architecture": type(self.target.model).__name__,
               "layers": self.target.num_layers, "hidden size": self.target.hidden_size,
               "vocabulary": self.target.vocab_rows, "dtype": self.dtype, "quantization": self.quant or "none",
               "device": self.device, "context length": getattr(cfg, "max_position_embeddings", None),
               "forward": self.forward}
        fast = self.target.fast
        if fast is not None:
            from dflash_cli.engine.kernels import cuda_graphs

            out["attention"] = fast.attention_kernel
            graphs = cuda_graphs(fast.device) if fast.compiled else None
            if graphs is not None:
                out["cuda graphs"] = graphs
        if self.target.split:
            out["layers on"] = self.target.placement
        if self.drafter is not None:
            dc = self.drafter.config
            out.update({"drafter": str(self.drafter_dir), "draft layers": dc.num_hidden_layers,
                        "block size": dc.block_size, "tapped layers": self.target._taps,
                        "mask token id": dc.mask_token_id})
        else:
            out["drafter"] = "none (speculation off)"
        return out

    def conversation(self, system: str | None = None) -> Conversation:
        from dflash_cli.conversation import Conversation

        return Conversation(self, system=system)

    def supports_thinking(self) -> bool:
        from dflash_cli.engine.text import supports_thinking

        return supports_thinking(self.tokenizer)

    def thinking_mode(self, think: bool | None) -> bool | None:
        from dflash_cli.engine.text import thinking_default

        if not self.supports_thinking():
            return None
        return think if think is not None else thinking_default(self.tokenizer)

    def trained_thinking(self) -> tuple[str, bool] | None:
        if self.drafter_entry is None or self.drafter_entry.thinking is None or self.drafter is None:
            return None
        return self.drafter_entry.alias, self.drafter_entry.thinking

    def check_block_size(self, block_size: int | None) -> None:
        from dflash_cli.engine.hf_config import check_block_size

        check_block_size(block_size, self.trained_block_size)

    def close(self) -> None:
        """Leaves the round costs learnt for the next process (the weights go with the process)."""
        if self.drafter is not None and self.costs_key is not None:
            from dflash_cli.runtime.round_costs import keep

            keep(self.drafter, self.costs_key)


def load_runtime(model: str | Path, draft: str | Path | None, *, quant: str | None = None, dtype: str | None = None,
                 device: str | None = None, compile: str = S.DEFAULT_COMPILE, max_context: int | None = None,
                 device_map: str | None = None, max_memory: str | dict[str, int] | None = None,
                 placement: Placement | None = None, on_status: Status | None = None,
                 on_notice: Status | None = None, before_weights: Callable[[Any], None] | None = None,
                 quant_auto: bool = False, threads: int | None = None,
                 draft_window: int | None = None) -> LocalRuntime:
    """Loads a target folder (and drafter folder), checking the pair before any weights load.

    Names, repo ids and built-in models become folders before this (`open_runtime`, models/resolve.py).

    `compile` (auto/on/off) picks the target's forward: the static-cache fast path, compiled or not, or
    (off) transformers' own; `max_context` sizes the static cache. `on_notice` gets one-line warnings
    (a compile that failed and fell back). `before_weights(tokenizer)` runs before the weights load: checks
    that need only the tokenizer fail there, in a second rather than after a long load.
    `device_map` (auto/balanced/sequential) and `max_memory` ("0=14GiB,cpu=30GiB" or a dict) split the
    target's layers over devices as models/memory/split.py plans them; the drafter goes on the hot device.
    `placement`: those three already resolved (engine/placement.py), in their place.
    `quant_auto`: `quant` was --quant auto's choice, so a weight-only one (q4/q8) that cannot run here
    (compile off, a target off the fast path) falls back to unquantized with a notice instead of an error.
    `threads`: the CPU thread count of a target on the CPU (None: chosen while generating, engine/cpu/threads.py).
    `draft_window`: the drafter attends to that many of the latest context positions only (0: all; None: the
    window its config names, else all).
    """
    from dflash_cli.engine.cpu.threads import ThreadGovernor
    from dflash_cli.engine.device import pick_dtype
    from dflash_cli.engine.dtypes import plan_dtype
    from dflash_cli.engine.load import load_pair
    from dflash_cli.engine.placement import resolve_placement

    target_dir, drafter_dir = Path(model).expanduser(), Path(draft).expanduser() if draft else None
    _check_folders(target_dir, drafter_dir)
    started = time.perf_counter()
    if placement is None:  # bad settings fail before anything loads
        placement = resolve_placement(device, device_map, max_memory)
    dev, split = placement.device, placement.split
    # made now: the load is its first window on what the rest of the machine keeps busy
    governor = ThreadGovernor(threads) if dev.type == "cpu" or threads else None
    if governor is not None:
        governor.check()
    quant = None if quant in (None, "none") else quant
    quant = _integer_formats_with(quant, dtype, dev, quant_auto)
    built_note = ""
    if quant in ("q4a8", "q8a8") and dev.type == "cpu":
        quant, built_note = _native_kernels(quant, quant_auto, on_status, on_notice)
    dt = pick_dtype(dtype, dev, quant)
    layer_devices = plan_layers(target_dir, drafter_dir, split, quant or plan_dtype(dt), max_context) \
        if split else None
    tokenizer = _load_tokenizer(target_dir)
    if before_weights is not None:
        before_weights(tokenizer)
    pair = load_pair(target_dir, drafter_dir, device=dev, dtype=dt, quant=quant, layer_devices=layer_devices,
                     offload_dir=S.cache_dir() / "offload",  # on disk: the system's temp folder may be RAM
                     by_layer=compile != "off")  # --compile off runs transformers' forward, on dense weights
    forward = enable_fast_path(pair.target, pair.drafter, compile, max_context,
                               bnb_quant=quant if quant in ("int8", "nf4") else None,
                               on_status=on_status, on_notice=on_notice, quant_auto=quant_auto)
    forward += built_note
    pair.target.threads = governor
    if pair.drafter is not None and draft_window is not None:  # else the window its config names, if any
        cast(Any, pair.drafter).context_window = draft_window or None
    if quant in ("q4", "q8", "q4a8", "q8a8") and pair.target.weight_quant is None:  # --quant auto fell back
        quant = None
    if dev.type == "cuda" and not pair.target.fast_compiled:  # the first generation on a GPU runs at half speed
        from dflash_cli.engine.generate import warm_up

        warm_up(pair.target, pair.drafter)
    costs_key = None
    if pair.drafter is not None and drafter_dir is not None:
        costs_key = _round_costs(pair, target_dir, drafter_dir, quant=quant, dtype=dt, device=dev, threads=threads)
    return LocalRuntime(pair.target, pair.drafter, tokenizer, target_dir, drafter_dir,
                        time.perf_counter() - started, quant, str(dt).replace("torch.", ""), str(dev), forward,
                        costs_key=costs_key)


def _check_folders(target_dir: Path, drafter_dir: Path | None) -> None:
    """The folders exist and the target's holds its tokenizer (before anything loads)."""
    for what, folder in (("model", target_dir), ("drafter", drafter_dir)):
        if folder is not None and not folder.is_dir():
            raise CheckpointError(f"{what} folder {folder} does not exist")
    if not any((target_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise CheckpointError(f"{target_dir} has no tokenizer files (tokenizer.json or tokenizer_config.json)",
                              hint="the model folder must include its tokenizer; 'dflash-cli pull' fetches it")


def _round_costs(pair: Any, target_dir: Path, drafter_dir: Path, **settings: Any) -> dict[str, Any]:
    """The key of the pair's round costs, with an earlier process's costs restored under it. The key holds the
    window the drafter drafts with (its config's unless --draft-window), not the option: costs and acceptance
    learned seeing the whole context do not hold for a window."""
    from dflash_cli.engine.cpu import native
    from dflash_cli.runtime.round_costs import costs_key, restore

    built = native.library_if_built() if settings.get("quant") in ("q4a8", "q8a8") else None
    key = costs_key(target_dir, drafter_dir, kernels=built.variant.name if built is not None else None,
                    compiled=pair.target.fast_compiled, split=bool(pair.target.split),
                    draft_quant=getattr(pair.drafter, "head_quant", None),
                    draft_window=getattr(pair.drafter, "context_window", None), **settings)
    restore(pair.drafter, key)
    return key


def _load_tokenizer(target_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer from {target_dir}: {e}") from None


def plan_layers(target_dir: Path, drafter_dir: Path | None, split: tuple[str, list[tuple[str, int | None]]],
                quant: str, max_context: int | None) -> list[str]:
    """Each decoder layer's device, as models/memory/split.py plans the split (what `show` prints)."""
    from dflash_cli.engine.pairing import HYBRID_MODEL_TYPES, read_config
    from dflash_cli.models.memory.split import plan_split, split_hint

    target_cfg = read_config(target_dir, "target")
    plan = plan_split(target_cfg, read_config(drafter_dir, "drafter") if drafter_dir else None, devices=split[1],
                      strategy=split[0], quant=quant, context_tokens=max_context or S.DEFAULT_MAX_CONTEXT)
    hybrid = target_cfg.get("model_type") in HYBRID_MODEL_TYPES
    if not plan.fits:  # hybrids cannot offload: disk is no way out for them
        raise InvalidSettingError(f"{target_dir.name} does not fit the split: {plan.problem}",
                                  hint=split_hint(hybrid))
    if plan.offloaded_layers and hybrid:
        raise InvalidSettingError(f"{target_dir.name} would offload {plan.offloaded_layers} layers to cpu/disk, "
                                  "which hybrid (linear-attention) targets cannot run with",
                                  hint="give the GPUs more room (--max-memory), or use --quant nf4")
    return plan.layer_devices()


def _integer_formats_with(quant: str | None, dtype: str | None, dev: Any, quant_auto: bool) -> str | None:
    """q4a8/q8a8 compute everything but their 8-bit matmuls in fp32 (their kernels read fp32 activations):
    with another --dtype, --quant auto takes the weight-only q4 (bf16) or none instead, and an explicit
    q4a8/q8a8 is refused before anything loads."""
    import torch

    from dflash_cli.engine.device import pick_dtype

    if quant not in ("q4a8", "q8a8") or dtype in (None, "auto"):
        return quant
    chosen = pick_dtype(dtype, dev)
    if chosen == torch.float32:
        return quant
    if quant_auto:
        return "q4" if chosen == torch.bfloat16 else None
    raise InvalidSettingError(f"--quant {quant} computes in float32 around its 8-bit matmuls, so it cannot run "
                              f"with --dtype {dtype}", hint="drop --dtype, or use --quant q4 (bf16 activations)")


def _native_kernels(quant: str, quant_auto: bool, on_status: Status | None,
                    on_notice: Status | None) -> tuple[str | None, str]:
    """Builds (once per CPU) or loads the q4a8/q8a8 kernels: (`quant`, what the build cost, in words, for
    --verbose's forward line), or (None, "") when --quant auto's choice cannot be had here (a notice says
    why); an explicit choice that cannot is an error."""
    from dflash_cli.engine.cpu import native

    built = native.library(on_status)
    if built is not None:
        note = f"; {built.variant.name} kernels built for this CPU in {built.seconds:.1f}s, kept in " \
            f"{built.path.parent}" if built.seconds else ""
        return quant, note
    if quant_auto:
        if on_notice is not None:
            on_notice(f"--quant auto: {quant} is not available ({native.unavailable()}); running unquantized")
        return None, ""
    why = native.unavailable() or ""
    hint = f"unset {native.KERNELS_ENV}, or name a build this CPU runs (doctor lists them)" \
        if native.KERNELS_ENV in why else "install a C compiler (gcc), or use --quant q4, q8 or none"
    raise InvalidSettingError(f"--quant {quant} needs this project's AVX2 kernels: {why}", hint=hint)


def enable_fast_path(target: Any, drafter: Any, compile: str, max_context: int | None, *, bnb_quant: str | None,
                     on_status: Callable[[str], None] | None = None,
                     on_notice: Callable[[str], None] | None = None, quant_auto: bool = False) -> str:
    """Puts `target` on the static-cache fast path when it can take it; returns what runs, in words.

    With compilation, every short forward the loop can call (decode 1, verify blocks of 2..B padded to
    powers of two) is compiled here, before the first reply, so no reply pauses to compile. `quant_auto`:
    the weight quantization was --quant auto's choice, so where it cannot run the target runs unquantized.
    """
    from dflash_cli.engine.compile import compiler_for, resolve_compile, use_compile_cache
    from dflash_cli.engine.cpu.c_layers import fuse_drafter
    from dflash_cli.engine.cpu.int8act import INT8_ACT_QUANTS, ShortlistHead, draft_quant, quantize_drafter
    from dflash_cli.engine.cpu.packed import pack_linears, room_to_pack
    from dflash_cli.engine.kernels import cuda_graphs

    compiled, why = resolve_compile(compile, target.device, quant=bnb_quant)
    if compiled and target.split:
        compiled, why = False, "split over devices: not compiled"
    weights = getattr(target, "weight_quant", None)

    def drop_weights(why: str) -> None:
        target.weight_quant = None
        if on_notice is not None:
            on_notice(f"--quant auto: {weights} {why}; running unquantized")

    if compile == "off" and not target.hybrid:
        if weights and quant_auto:
            drop_weights("runs on the fast path, which --compile off turns off")
        elif weights:
            raise InvalidSettingError(f"--quant {weights} runs on the fast path, which --compile off turns off",
                                      hint="drop --compile off, or use --quant none")
        return "transformers forward (compile off)"
    if compile == "off":
        why = "compile off; a hybrid target always takes the fast path, whose linear-attention state rolls back"
    context = min(c for c in (target.max_positions, max_context or S.DEFAULT_MAX_CONTEXT) if c)
    block = drafter.block_size if drafter is not None else 1
    step = None
    if compiled:
        use_compile_cache(S.cache_dir() / "compile")
        step = compiler_for(target.device)
    reason = target.enable_fast_path(context, pad_to=block, compile_step=step, on_fallback=on_notice)
    if reason is not None:
        if weights and quant_auto:
            drop_weights(f"needs the fast path, which this target cannot take ({reason})")
        elif weights:
            raise InvalidSettingError(f"--quant {weights} needs the fast path, which this target cannot take "
                                      f"({reason})", hint="use --quant none")
        if compile == "on" and on_notice is not None:
            on_notice(f"--compile on: this target cannot take the fast path ({reason}); running uncompiled")
        return f"transformers forward ({reason})"
    form = f", {target.fast.weight_form}" if target.fast.weight_form else ""
    attention = f"; attention: {target.fast.attention_kernel}"
    if not compiled:
        drafting = ""
        if drafter is not None and target.fast.weights in INT8_ACT_QUANTS:
            kind, chosen = draft_quant()
            quantize_drafter(drafter, kind)  # the same few rows as the target's, on the same kernels
            fuse_drafter(drafter)
            drafting = f"; drafter {kind} ({chosen})"
            if hasattr(drafter, "greedy_head_for") and isinstance(drafter.greedy_head_for(target.logits_head),
                                                                  ShortlistHead):
                drafting += ", greedy drafts through a 4-bit copy of its head"
            if hasattr(drafter, "greedy_call") and drafter.greedy_call(target.embed_table, target.logits_head):
                drafting += ", each greedy draft one C call"
        if target.fast.packed and drafter is not None and room_to_pack(drafter):
            pack_linears(drafter)  # its layers run at the same few rows as the target's
        if drafter is not None and target.defers_head:
            target.head_costs()  # measured now (10-150 ms), not in the first reply's decode
        return f"static cache, eager{form} ({why}){attention}{drafting}"
    if on_status is not None:
        on_status("Compiling the decode and verify forwards (first run; kept on disk for the next) ...")
    started = time.perf_counter()
    target.fast.precompile(taps=drafter is not None, max_block=block)
    if not target.fast_compiled:
        return f"static cache, eager (compile failed: {target.fast.fallback_reason}){attention}"
    drafting = _compile_drafter(target, drafter, step, on_notice)
    graphs = cuda_graphs(target.device)
    return (f"static cache, compiled in {time.perf_counter() - started:.0f}s ({why}){drafting}{attention}"
            + (f"; CUDA graphs: {graphs}" if graphs else ""))


def _compile_drafter(target: Any, drafter: Any, step: Any, on_notice: Callable[[str], None] | None) -> str:
    """Drafts at fixed shapes through the compiler of the target's forwards (engine/draft_graph.py), compiled
    and, on CUDA, recorded now; returns what runs, in words ("" without a drafter that can)."""
    if not hasattr(drafter, "static_draft"):  # no drafter, or one that is not a DFlash module
        return ""
    from dflash_cli.engine.draft_graph import StaticDraft
    from dflash_cli.engine.state import shared_draft_cache

    drafter.static_draft = static = StaticDraft(drafter, compile_step=step, on_fallback=on_notice)
    static.precompile(shared_draft_cache(drafter, target.fast.capacity + drafter.block_size),
                      target.hidden_size, target.device)
    return ", drafter compiled" if static.compiled else f", drafter uncompiled ({static.fallback_reason})"


