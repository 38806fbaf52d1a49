"""The target LLM: a transformers causal LM plus what speculative decoding needs from it.

Two ways to run it, behind one `forward`: the fast path (engine/fast.py: static cache, one traceable
forward, optionally compiled) for Llama-style targets once `enable_fast_path` is called, and transformers'
own forward with a DynamicCache for everything else. On the transformers path, tapped hidden states are
captured with removable forward hooks on the decoder layers, without patching its classes.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_cli.engine.errors import UnsupportedModelError
from dflash_cli.engine.hf_module import HFModule
from dflash_cli.engine.linear_attention import is_linear_attention

if TYPE_CHECKING:
    from dflash_cli.engine.cpu.threads import ThreadGovernor
    from dflash_cli.engine.fast import FastPath
    from dflash_cli.engine.fast_layers import QuantizedLayers


def decoder_layers(model: HFModule) -> nn.ModuleList:
    """The list of decoder layers of a transformers causal LM (Llama, Qwen, Mistral, gpt-oss, ...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(f"{type(model).__name__}: cannot find its decoder layers")
    return layers


def make_cache(model: HFModule):
    """A fresh KV cache for `model` that can be cropped (rolled back) to any committed length."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56
        cache = DynamicCache()
    if hasattr(cache, "activate_past_recording"):  # lets sliding-window layers roll back too
        cache.activate_past_recording()
        # DecodeState.prefill asks how far back the cache can go (Gemma's sliding layers keep only a window)
        setattr(cache, "reachable", lambda length: sliding_reachable(cache, length))
    return cache


def sliding_reachable(cache, length: int) -> int:
    """`length` when every sliding-window layer of a transformers cache still holds the window before
    it (such a layer keeps window - 1 rows, plus the last forward's until the next crop), else 0: the
    sequence must then be read again from its start."""
    for layer in getattr(cache, "layers", ()):
        window = getattr(layer, "sliding_window", None)
        if not window or not getattr(layer, "is_initialized", False):
            continue
        first = int(layer.get_seq_length()) - layer.keys.shape[-2]  # the earliest position it holds
        if max(0, length - window + 1) < first:
            return 0
    return length


def cache_length(cache) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache, length: int) -> None:
    """Rolls the cache back to `length` tokens, layer by layer: after an interrupted forward the layers
    may hold different lengths. A negative crop means 'remove n' on every transformers version.
    A fast-path StaticCache (no `layers`) crops to a length, which is only a length update."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # StaticCache, or transformers < 4.56: one crop for all layers
        if cache_length(cache) > length:
            cache.crop(length)
        return
    for layer in layers:
        extra = int(layer.get_seq_length()) - length
        if extra > 0:
            layer.crop(-extra)


def placement_of(model: HFModule, layers: nn.ModuleList) -> list[str]:
    """Each decoder layer's device as loaded: accelerate's map when there is one (it names offloaded
    layers' home, "cpu" or "disk", whose weights wait on `meta`), else where its weights are."""
    device_map = getattr(model, "hf_device_map", None) or {}
    names = {id(m): n for n, m in model.named_modules()} if device_map else {}
    out = []
    for layer in layers:
        name = names.get(id(layer))
        where = device_map.get(name) if name is not None else None
        if where is None:
            where = str(next(layer.parameters()).device)
        out.append(f"cuda:{where}" if isinstance(where, int) else str(where))
    return out


class Target:
    """A loaded causal LM and the hooks that read its tapped layers."""

    def __init__(self, model: HFModule, name: str = "target"):
        self.model = model
        self.name = name
        self.layers = decoder_layers(model)
        self.num_layers = len(self.layers)
        weight = model.get_input_embeddings().weight
        self.embed_weight: torch.Tensor = weight  # empty once a tied head's codes took its place (embed_table)
        self.lm_head: nn.Module = model.get_output_embeddings()
        # the hot device: embeddings, LM head, logits, the drafter and the tapped states live here, also
        # when a device map spreads the decoder layers over several devices (`layer_devices`)
        self.device = weight.device
        self.layer_devices = placement_of(model, self.layers)
        self.vocab_rows, self.hidden_size = weight.shape
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._final_norm = getattr(model.get_decoder(), "norm", None) if hasattr(model, "get_decoder") else None
        self._taps: list[int] = []
        self._hooks: list[Any] = []
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False
        self.fast: FastPath | None = None  # engine.fast.FastPath once enable_fast_path() succeeded
        self.offload_dir: Any = None  # a TemporaryDirectory holding disk-offloaded weights, if any
        self.weight_quant: str | None = None  # "q4"/"q8"/"q4a8"/"q8a8": the fast path runs the linears quantized
        self.q4_codes_file: Any = None  # a Path of ready 4-bit codes (weightonly.Q4_CODES_FILE), if any
        # the layers' projections in weight_quant's format, made as they loaded (engine/layerwise.py), if so
        self.quantized_layers: QuantizedLayers | None = None
        # on a CPU, the thread count of its generations (engine/cpu/threads.py); None: torch's default, untouched
        self.threads: ThreadGovernor | None = None
        # set once a quantized fast path freed the dense weights it replaced: transformers' forward cannot run
        self.dense_freed = False
        # linear-attention (Qwen3.5) layers: transformers' cache cannot roll their state back, ours can
        self.hybrid = any(is_linear_attention(layer) for layer in self.layers)

    @property
    def split(self) -> bool:
        """Whether the decoder layers are spread over devices other than the hot one."""
        return set(self.layer_devices) != {str(self.device)}

    @property
    def offloaded(self) -> bool:
        """Whether some layers are offloaded to cpu/disk (run on the hot device, copied in per forward)."""
        away = ("disk",) if self.device.type == "cpu" else ("disk", "cpu")
        return any(d in away for d in self.layer_devices)

    @property
    def placement(self) -> str:
        """Where the layers are, in words: 'cuda:0 18 layers, cuda:1 18 layers' (offloaded: slow)."""
        counts: dict[str, int] = {}
        for d in self.layer_devices:
            counts[d] = counts.get(d, 0) + 1
        text = ", ".join(f"{d} {n} layer{'s' if n != 1 else ''}" for d, n in counts.items())
        return text + (" (offloaded layers: slow)" if self.offloaded else "")

    def enable_fast_path(self, context: int, *, compile_step=None, pad_to: int = 1,
                         on_fallback=None) -> str | None:
        """Runs this target on static caches of `context` positions (plus `pad_to` of padding for
        fixed-length compiled calls) from now on; returns why it cannot, or None."""
        from dflash_cli.engine.fast import FastPath
        from dflash_cli.engine.fast_layers import fast_path_unsupported

        quantized = self.quantized_layers
        reason = fast_path_unsupported(self.model, quantized=quantized)
        if reason is not None:
            return reason
        codes = None
        if quantized is None and self.weight_quant in ("q4", "q4a8") and self.q4_codes_file is not None:
            from dflash_cli.engine.cpu.weightonly import read_q4_codes

            codes = read_q4_codes(self.q4_codes_file)
        self.fast = FastPath(self.model, context, pad_to=pad_to, compile_step=compile_step,
                             on_fallback=on_fallback, weights=self.weight_quant, q4_codes=codes, free_dense=True,
                             quantized=quantized)
        self.fast.set_taps(self._taps)
        if self.fast.codes_embedding is not None:  # the dense table is freed: rows come from the head's codes
            self.embed_weight = self.embed_weight.new_empty(0)
        self.dense_freed = self.dense_freed or self.fast.freed_bytes > 0
        return None

    def disable_fast_path(self) -> None:
        self.fast = None

    @property
    def embed_table(self) -> torch.Tensor | nn.Module:
        """What drafts embed their blocks from (engine/cpu/packed.embedding_rows): the (vocab, hidden) table, or
        under q4a8/q8a8 with a tied LM head the module that looks its rows up from the head's 8-bit codes."""
        fast = self.fast
        return fast.codes_embedding if fast is not None and fast.codes_embedding is not None else self.embed_weight

    @property
    def embed_scale(self) -> torch.Tensor | None:
        """The factor the embedding module multiplies its rows by (Gemma: sqrt(hidden_size), rounded to the
        weights' dtype as transformers does), or None: the drafter embeds its block the same way."""
        scale = getattr(self.model.get_input_embeddings(), "embed_scale", None)
        if not isinstance(scale, torch.Tensor):
            return None
        return scale.to(device=self.device, dtype=self.model.get_input_embeddings().weight.dtype)

    @property
    def logits_head(self) -> nn.Module:
        """The LM head as the current path runs it (oneDNN-packed on the CPU fast path); drafts use it too."""
        return self.fast.lm_head if self.fast is not None else self.lm_head

    @property
    def defers_head(self) -> bool:
        """Whether forward(logits=False) is there and pays (FastTarget.defers_head)."""
        return self.fast is not None and self.fast.defers_head

    def logits_of(self, normed: torch.Tensor) -> torch.Tensor:
        """The logits of rows that forward(logits=False) returned."""
        assert self.fast is not None
        return self.fast.logits_of(normed)

    def head_costs(self) -> tuple[float, ...] | None:
        """What a call of the LM head on k rows costs, by k (FastPath.head_costs)."""
        assert self.fast is not None
        return self.fast.head_costs()

    @property
    def fast_compiled(self) -> bool:
        return self.fast is not None and self.fast.compiled

    @property
    def context_limit(self) -> int | None:
        """Most positions a sequence may hold: the static cache's size, else the model's context length."""
        limits = [c for c in (self.max_positions, self.fast.context if self.fast else None) if c]
        return min(limits) if limits else None

    @property
    def config(self):
        return self.model.config

    @property
    def max_positions(self) -> int | None:
        cfg = getattr(self.config, "text_config", None) or self.config
        return getattr(cfg, "max_position_embeddings", None)

    def set_taps(self, layer_ids: list[int]) -> None:
        """Captures the outputs of these decoder layers (0-based) on forwards that ask for taps."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._taps = [], list(layer_ids)
        if self.fast is not None:
            self.fast.set_taps(self._taps)
        for layer_id in sorted(set(layer_ids)):
            self._hooks.append(self.layers[layer_id].register_forward_hook(self._make_hook(layer_id)))

    def tapped(self, layer_id: int, output: Any) -> torch.Tensor:
        """The tap of decoder layer `layer_id` from its module output: the layer's hidden states, after the
        final norm for the last layer (transformers' hidden_states[-1] is). Decoding and training data
        both tap through here (the fast path applies the same rule in its own forward)."""
        hidden = output[0] if isinstance(output, tuple) else output
        if layer_id == self.num_layers - 1 and self._final_norm is not None:
            hidden = self._final_norm(hidden)
        return hidden

    def _make_hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            if self._capturing:
                self._captured[layer_id] = self.tapped(layer_id, output)

        return hook

    def new_cache(self):
        return self.fast.new_cache() if self.fast is not None else make_cache(self.model)

    def shared_cache(self):
        """The cache decoding uses: the fast path's one static cache, else a new transformers cache (which
        grows as it goes, so a new one costs nothing)."""
        return self.fast.shared_cache() if self.fast is not None else make_cache(self.model)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, start: int, *, last_logit_only: bool = False,
                taps: bool = False, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over `ids` (1, T) at positions start..start+T-1, appending to `cache`.

        Returns logits (T, V) (or (1, V) with last_logit_only) and, with taps, the tapped layers'
        hidden states concatenated in the drafter's order, (1, T, n_taps*H). logits=False (only where
        defers_head): the final-normed rows (T, H) instead, for logits_of().
        """
        if self.fast is not None:
            return self.fast.forward(ids, cache, start, taps=taps, last_logit_only=last_logit_only, logits=logits)
        assert logits, "forward(logits=False) needs the fast path (defers_head)"
        if self.dense_freed:
            raise UnsupportedModelError(f"{self.name} runs quantized only: its dense weights were freed",
                                        hint="load it again to run it unquantized")
        if self.hybrid:
            raise UnsupportedModelError(
                f"{self.name} has linear-attention layers, whose state transformers' cache cannot roll back",
                hint="call Target.enable_fast_path(context) first (the CLI always does for these models)")
        n = ids.shape[1]
        positions = torch.arange(start, start + n, device=ids.device)[None]
        self._capturing = taps
        try:
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True,
                             logits_to_keep=1 if last_logit_only else 0, **{self._cache_kwarg: cache})
        finally:
            self._capturing = False
        hidden = None
        if taps:
            # gathered on the hot device (the drafter's), each tap moved once
            hidden = torch.cat([self._captured[i].to(self.device) for i in self._taps], dim=-1)
            self._captured.clear()
        return out.logits[0], hidden

