"""A loaded model pair and a conversation with it: what the terminal commands drive.

No terminal code here: chat and one-shot generation both go through `Conversation`, which keeps the
engine's caches between turns so a new turn only prefills its new tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cli import settings as S
from dflash_cli.engine.errors import CheckpointError, DFlashError, InvalidSettingError

if TYPE_CHECKING:  # the engine imports torch: only for annotations here
    from dflash_cli.engine.drafter import Drafter
    from dflash_cli.engine.target import Target


class TranscriptError(DFlashError):
    """A saved chat transcript cannot be read."""


@dataclass
class GenerationSettings:
    """Per-reply settings; chat changes them with /set."""

    max_tokens: int = S.DEFAULT_MAX_TOKENS
    temperature: float = S.DEFAULT_TEMPERATURE
    top_p: float = S.DEFAULT_TOP_P
    top_k: int = S.DEFAULT_TOP_K
    seed: int | None = None
    block_size: int | None = None  # None: the drafter's trained size
    think: bool | None = None  # None: the chat template's default
    chat_template: bool = True
    max_context: int | None = None  # None: the target's context length

    def engine_kwargs(self) -> dict[str, Any]:
        return dict(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, block_size=self.block_size, max_context=self.max_context)


@dataclass
class Runtime:
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
    fast_path: str = "transformers forward"
    pair: Any = None  # the registry PairEntry whose drafter is loaded (its thinking mode), else None

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    def info(self) -> dict[str, Any]:
        """What /show info and --verbose print about the loaded pair."""
        cfg = self.target.config
        out = {"target": str(self.target_dir), "architecture": type(self.target.model).__name__,
               "layers": self.target.num_layers, "hidden size": self.target.hidden_size,
               "vocabulary": self.target.vocab_rows, "dtype": self.dtype, "quantization": self.quant or "none",
               "device": self.device, "context length": getattr(cfg, "max_position_embeddings", None),
               "forward": self.fast_path}
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


def load_runtime(model: str | Path, draft: str | Path | None, *, quant: str | None = None, dtype: str | None = None,
                 device: str | None = None, compile: str = S.DEFAULT_COMPILE, max_context: int | None = None,
                 device_map: str | None = None, max_memory: str | dict[str, int] | None = None,
                 on_status: Callable[[str], None] | None = None,
                 on_notice: Callable[[str], None] | None = None,
                 before_weights: Callable[[Any], None] | None = None, quant_auto: bool = False) -> Runtime:
    """Loads a target folder (and drafter folder), checking the pair before any weights load.

    Names, repo ids and built-in models are turned into folders before this, by models/resolve.py.

    `compile` (auto/on/off) picks the target's forward: the static-cache fast path, compiled or not, or
    (off) transformers' own; `max_context` sizes the static cache. `on_notice` gets one-line warnings
    (a compile that failed and fell back). `before_weights(tokenizer)` runs before the weights load: checks
    that need only the tokenizer fail there, in a second rather than after a long load.
    `device_map` (auto/balanced/sequential) and `max_memory` ("0=14GiB,cpu=30GiB" or a dict) split the
    target's layers over devices as models/split.py plans them; the drafter goes on the hot device.
    `quant_auto`: `quant` was --quant auto's choice, so a weight-only one (q4/q8) that cannot run here
    (compile off, a target off the fast path) falls back to unquantized with a notice instead of an error.
    """
    from dflash_cli.engine.device import pick_device, pick_dtype
    from dflash_cli.engine.load import load_pair
    from dflash_cli.engine.placement import hot_device, resolve_split

    target_dir, drafter_dir = Path(model).expanduser(), Path(draft).expanduser() if draft else None
    for what, folder in (("model", target_dir), ("drafter", drafter_dir)):
        if folder is not None and not folder.is_dir():
            raise CheckpointError(f"{what} folder {folder} does not exist")
    if not any((target_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise CheckpointError(f"{target_dir} has no tokenizer files (tokenizer.json or tokenizer_config.json)",
                              hint="the model folder must include its tokenizer; 'dflash-cli pull' fetches it")
    started = time.perf_counter()
    split = resolve_split(device, device_map, max_memory)  # bad settings fail before anything loads
    dev = pick_device(hot_device(split[1]) if split else device)
    quant = None if quant in (None, "none") else quant
    dt = pick_dtype(dtype, dev, quant)
    layer_devices = plan_layers(target_dir, drafter_dir, split, quant or _plan_dtype(dt), max_context) \
        if split else None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer from {target_dir}: {e}") from None
    if before_weights is not None:
        before_weights(tokenizer)
    pair = load_pair(target_dir, drafter_dir, device=dev, dtype=dt, quant=quant, layer_devices=layer_devices,
                     offload_dir=S.cache_dir() / "offload")  # on disk: the system's temp folder may be RAM
    fast_path = enable_fast_path(pair.target, pair.drafter, compile, max_context,
                                 bnb_quant=quant if quant in ("int8", "nf4") else None,
                                 on_status=on_status, on_notice=on_notice, weights_optional=quant_auto)
    if quant in ("q4", "q8") and pair.target.weight_quant is None:  # --quant auto fell back
        quant = None
    if dev.type == "cuda" and not pair.target.fast_compiled:  # the first generation on a GPU runs at half speed
        from dflash_cli.engine.generate import warm_up

        warm_up(pair.target, pair.drafter)
    return Runtime(pair.target, pair.drafter, tokenizer, target_dir, drafter_dir,
                   time.perf_counter() - started, quant, str(dt).replace("torch.", ""), str(dev), fast_path)


def _plan_dtype(dtype: Any) -> str:
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(dtype), "fp32")


def plan_layers(target_dir: Path, drafter_dir: Path | None, split: tuple[str, list[tuple[str, int | None]]],
                quant: str, max_context: int | None) -> list[str]:
    """Each decoder layer's device, as models/split.py plans the split (what `show` prints)."""
    import json

    from dflash_cli.engine.pairing import HYBRID_MODEL_TYPES
    from dflash_cli.models.split import plan_split, split_hint

    def config(folder: Path) -> dict:
        return json.loads((folder / "config.json").read_text())

    target_cfg = config(target_dir)
    plan = plan_split(target_cfg, config(drafter_dir) if drafter_dir else None, devices=split[1],
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


def enable_fast_path(target: Any, drafter: Any, compile: str, max_context: int | None, *, bnb_quant: str | None,
                     on_status: Callable[[str], None] | None = None,
                     on_notice: Callable[[str], None] | None = None, weights_optional: bool = False) -> str:
    """Puts `target` on the static-cache fast path when it can take it; returns what runs, in words.

    With compilation, every short forward the loop can call (decode 1, verify blocks of 2..B padded to
    powers of two) is compiled here, before the first reply, so no reply pauses to compile.
    """
    from dflash_cli.engine.compile import compiler_for, resolve_compile, use_compile_cache
    from dflash_cli.engine.kernels import cuda_graphs
    from dflash_cli.engine.packed import pack_linears, room_to_pack
    from dflash_cli.models.smollm2 import default_cache_dir

    compiled, why = resolve_compile(compile, target.device, quant=bnb_quant)
    if compiled and target.split:
        compiled, why = False, "split over devices: not compiled"
    weights = getattr(target, "weight_quant", None)

    def drop_weights(why: str) -> None:
        target.weight_quant = None
        if on_notice is not None:
            on_notice(f"--quant auto: {weights} {why}; running unquantized")

    if compile == "off" and not target.hybrid:
        if weights and weights_optional:
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
        use_compile_cache(default_cache_dir() / "compile")
        step = compiler_for(target.device)
    reason = target.enable_fast_path(context, pad_to=block, compile_step=step, on_fallback=on_notice)
    if reason is not None:
        if weights and weights_optional:
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
        if target.fast.packed and drafter is not None and room_to_pack(drafter):
            pack_linears(drafter)  # its layers run at the same few rows as the target's
        return f"static cache, eager{form} ({why}){attention}"
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
    static.precompile(shared_draft_cache(drafter, target.fast.capacity + drafter.block_size), target.embed_weight)
    return ", drafter compiled" if static.compiled else f", drafter uncompiled ({static.fallback_reason})"


@dataclass
class ChatHistory:
    """The messages of a chat, whatever answers them (the local engine, or a remote one in remote.py):
    asking, regenerating, keeping a reply cut short, and the transcript file."""

    runtime: Any
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    interrupted: bool = False  # the last reply was cut short (and kept)
    cached_before: int = 0  # tokens the caches held before the last reply
    # None: the model has no <think> sections; else whether the prompt of the last reply opened one
    reply_in_thinking: bool | None = None

    def ask(self, text: str, settings: Any) -> Iterator[Any]:
        """Adds a user message and streams the reply (engine Steps); the reply joins the conversation."""
        self.messages.append({"role": "user", "content": text})
        return self._respond(settings)

    def regenerate(self, settings: Any) -> Iterator[Any]:
        """Drops the last reply and answers the last user message again; with a fixed seed it moves to the
        next seed (settings.seed += 1), since the same seed would give the same reply."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages:
            raise TranscriptError("nothing to regenerate yet")
        if settings.seed is not None and settings.temperature > 0:
            settings.seed += 1
        return self._respond(settings)

    def _respond(self, settings: Any) -> Iterator[Any]:
        raise NotImplementedError

    def _kept(self, steps: Iterator[Any]) -> Iterator[Any]:
        """Yields the reply's Steps; the reply joins the messages even when cut short (Ctrl-C, a broken
        stream)."""
        parts: list[str] = []
        self.interrupted = True
        try:
            for step in steps:
                parts.append(step.text)
                yield step
            self.interrupted = False
        finally:
            self.messages.append({"role": "assistant", "content": "".join(parts)})

    def clear(self) -> None:
        self.messages.clear()

    def _write(self, path: Path, source: dict[str, Any], settings: dict[str, Any]) -> None:
        data = {"format": "dflash-cli chat", "version": 1, **source, "system": self.system, "settings": settings,
                "messages": self.messages}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        tmp.replace(path)  # never leave a half-written transcript

    def load(self, path: Path) -> dict[str, Any]:
        """Replaces the conversation with a saved transcript; returns its saved settings."""
        try:
            data = json.loads(Path(path).read_text())
            messages = data["messages"]
            ok = isinstance(messages, list) and all(
                isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
                and isinstance(m.get("content"), str) for m in messages)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise TranscriptError(f"cannot read transcript {path}: {e}") from None
        if not ok:
            raise TranscriptError(f"{path} is not a dflash-cli transcript (bad 'messages')")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        self.system = data.get("system")
        return data.get("settings") or {}


@dataclass
class Conversation(ChatHistory):
    """A chat answered by the local engine, plus the engine state that caches it."""

    runtime: Runtime

    def __post_init__(self) -> None:
        from dflash_cli.engine.state import DecodeState

        self.state = DecodeState(self.runtime.target, self.runtime.drafter)
        self.controller = None  # the adaptive block-size choice, kept across turns
        if self.runtime.drafter is not None:
            from dflash_cli.engine.adaptive import BlockSizeController

            self.controller = BlockSizeController(self.runtime.drafter.block_size)

    def prompt_ids(self, settings: GenerationSettings) -> list[int]:
        from dflash_cli.engine.text import encode_prompt

        return encode_prompt(self.runtime.tokenizer, self.messages, chat_template=settings.chat_template,
                             enable_thinking=settings.think, system=self.system)

    def _respond(self, settings: GenerationSettings) -> Iterator[Any]:
        """Builds the prompt now (so reply_in_thinking is known before the first Step), then streams."""
        from dflash_cli.engine.text import opens_thinking, uses_think_tags

        prompt = self.prompt_ids(settings)
        tokenizer = self.runtime.tokenizer
        self.reply_in_thinking = opens_thinking(tokenizer, prompt) if uses_think_tags(tokenizer) else None
        return self._kept(self._generate(prompt, settings))

    def _generate(self, prompt: list[int], settings: GenerationSettings) -> Iterator[Any]:
        from dflash_cli.engine.generate import stream_generate

        self.cached_before = len(self.state.tokens)
        adaptive = settings.block_size is None
        yield from stream_generate(self.runtime.target, self.runtime.drafter, prompt,
                                   tokenizer=self.runtime.tokenizer, state=self.state, adaptive=adaptive,
                                   controller=self.controller if adaptive else None, **settings.engine_kwargs())

    def clear(self) -> None:
        super().clear()
        self.state.reset()

    def save(self, path: Path, settings: GenerationSettings) -> None:
        self._write(path, {"model": str(self.runtime.target_dir),
                           "drafter": str(self.runtime.drafter_dir) if self.runtime.drafter_dir else None},
                    asdict(settings))
