"""The one reader of `config.json` fields that more than one part of the project needs: a target's language
model part and layer types, and a drafter's block size, taps, mask id and layer types, in the z-lab (v1,
DFlash 2) and transformers (`muse_glimmer_assistant`) formats (docs/format.md sections 2, 7 and 8).

The engine (`DrafterConfig`, pairing), the memory planner (`models/memory/sizes.py`) and `show` all read through
here, so no torch: the planner runs before any weights, or torch, are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_cli.engine.errors import CheckpointError, InvalidSettingError, UnsupportedModelError

DEFAULT_BLOCK_SIZE = 16
ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# transformers' configs whose layer types follow use_sliding_window and max_window_layers
_QWEN_SLIDING = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}

# transformers' own drafter format, read from MuseGlimmerAssistantConfig (transformers 5.24)
HF_MODEL_TYPE = "muse_glimmer_assistant"
HF_ARCHITECTURE = "MuseGlimmerAssistantModel"
_HF_TOP_LEVEL = ("block_size", "mask_token_id", "target_layer_ids")
_HF_DEFAULT_THETA = 500000.0  # MuseGlimmerAssistantConfig.default_theta
# What MuseGlimmerAssistantConfig fills in when these fields are absent: Muse-Glimmer-30B's values, wrong for a
# drafter of any other target (its taps, its vocabulary). Never used: a config without them is refused.
_HF_DEFAULT_TAPS = [1, 13, 25, 37, 49]
_HF_DEFAULT_MASK_ID = 201818
# the fields a transformers-format drafter must name itself, and what its config.json should then say
_HF_REQUIRED = {
    "target_layer_ids": ('the target layers it was trained to read ("target_layer_ids": [...])', _HF_DEFAULT_TAPS),
    "mask_token_id": ('the mask token id it was trained with ("mask_token_id": N)', _HF_DEFAULT_MASK_ID),
}

# The fast path reads a prompt in pieces of at most this many tokens (DecodeState.prefill), so its attention mask
# and MLP intermediates stay this size however long the prompt; the memory planner (models/memory/sizes.py)
# counts one piece.
PREFILL_CHUNK = 512

# --device-map's strategies (accelerate's names; auto = balanced): engine/placement.py checks the value,
# models/memory/split.py plans by it
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "sequential")
#: --device-map's choices: none (one device) or a strategy
DEVICE_MAP_CHOICES = ("none", *DEVICE_MAP_STRATEGIES)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal configs nest it under text_config)."""
    return config.get("text_config") or config


def layer_types(cfg: dict[str, Any], *, qwen: bool = False) -> list[str]:
    """Per-layer attention kind, as transformers derives it when the config lists none.

    Qwen2/Qwen3 configs (and drafters, `qwen=True`: their layers are Qwen3 layers): sliding from layer
    `max_window_layers` on when `use_sliding_window` (default false) and `sliding_window` are set. Other
    families (Mistral): every layer slides when `sliding_window` is set, unless `use_sliding_window` is false.
    """
    types = cfg.get("layer_types")
    if types is not None:
        return list(types)
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if qwen or cfg.get("model_type") in _QWEN_SLIDING:
        sliding = window is not None and bool(cfg.get("use_sliding_window", False))
        first = cfg.get("max_window_layers", n)
        return ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(n)]
    sliding = window is not None and cfg.get("use_sliding_window", True) is not False
    return ["sliding_attention" if sliding else "full_attention"] * n


def fallback_taps(num_draft_layers: int, num_target_layers: int) -> list[int]:
    """Layer ids the reference code taps when a config names none (docs/format.md section 2)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def is_transformers_config(raw: dict[str, Any]) -> bool:
    return raw.get("model_type") == HF_MODEL_TYPE or HF_ARCHITECTURE in (raw.get("architectures") or [])


def from_transformers_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A muse_glimmer_assistant config.json as the equivalent config in our (z-lab) format.

    Taps and mask id are carried only when the config names them: transformers' defaults for them are one
    model's (Muse-Glimmer-30B), so an absent one stays absent (None to every reader, refused by
    DrafterConfig.from_dict) instead of being shown or run as if the checkpoint said it."""
    ours = {k: v for k, v in raw.items() if k not in _HF_TOP_LEVEL}
    ours.update(architectures=["DFlashDraftModel"], model_type="qwen3", is_causal=False, attention_bias=False)
    dflash: dict[str, Any] = {"block_size": raw.get("block_size", DEFAULT_BLOCK_SIZE)}  # 16: also the z-lab default
    if raw.get("mask_token_id") is not None:
        dflash["mask_token_id"] = raw["mask_token_id"]
    if raw.get("target_layer_ids") is not None:
        dflash["target_layer_ids"] = list(raw["target_layer_ids"])
    ours["dflash_config"] = dflash
    if not raw.get("rope_parameters") and raw.get("rope_theta") is None:
        ours["rope_parameters"] = {"rope_type": "default", "rope_theta": _HF_DEFAULT_THETA}
    ours.setdefault("layer_types", ["sliding_attention"] * int(raw.get("num_hidden_layers", 5)))
    return ours


def drafter_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """A drafter's config.json in the z-lab format, whichever format it was written in."""
    return from_transformers_config(raw) if is_transformers_config(raw) else raw


def _dflash(raw: dict[str, Any]) -> dict[str, Any]:
    return drafter_dict(raw).get("dflash_config") or {}


def drafter_block_size(raw: dict[str, Any]) -> int:
    """B, anchor slot included: dflash_config.block_size, else a top-level block_size (older drafters), else 16."""
    return int(_dflash(raw).get("block_size", drafter_dict(raw).get("block_size", DEFAULT_BLOCK_SIZE)))


def drafter_mask_token_id(raw: dict[str, Any]) -> int | None:
    mask_id = _dflash(raw).get("mask_token_id", drafter_dict(raw).get("mask_token_id"))
    return None if mask_id is None else int(mask_id)


def drafter_taps(raw: dict[str, Any]) -> list[int] | None:
    """The configured target_layer_ids, or None (the fallback then depends on the target's depth)."""
    taps = _dflash(raw).get("target_layer_ids")
    return None if taps is None else [int(t) for t in taps]


def drafter_tap_count(raw: dict[str, Any]) -> int:
    """How many tapped layers `fc` concatenates: the configured taps, else one per draft layer."""
    taps = drafter_taps(raw)
    return len(taps) if taps is not None else int(drafter_dict(raw)["num_hidden_layers"])


def is_dflash2(raw: dict[str, Any]) -> bool:
    return "DFlash2DraftModel" in (drafter_dict(raw).get("architectures") or [])


@dataclass(frozen=True)
class DrafterConfig:
    """The fields of a drafter's config.json that the engine uses, read strictly."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    block_size: int
    mask_token_id: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    is_causal: bool | None
    num_target_layers: int | None
    target_layer_ids: tuple[int, ...] | None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    draft_window: int | None = None  # dflash_config.draft_window: the context window the drafter drafts best with
    architecture: str = "DFlashDraftModel"
    # DFlash 2 only (docs/format.md section 7): conv kernel K, conv group G, selector rank R and top-k
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    source_format: str = "dflash"  # "dflash" (z-lab) or "transformers" (muse_glimmer_assistant)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        source_format = "transformers" if is_transformers_config(raw) else "dflash"
        if source_format == "transformers":
            _check_transformers_fields(raw, source)
        raw = drafter_dict(raw)
        architectures = raw.get("architectures") or ["DFlashDraftModel"]
        if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {architectures} is not a DFlash drafter this version can run",
                hint="supported: DFlashDraftModel and DFlash2DraftModel (z-lab DFlash checkpoints) and "
                     "muse_glimmer_assistant (transformers' DFlash format)",
            )
        dflash = raw.get("dflash_config") or {}
        dflash2 = _dflash2_fields(raw, dflash, source) if architectures[0] == "DFlash2DraftModel" else {}

        def need(key: str) -> int:
            value = raw.get(key)
            if value is None:
                raise CheckpointError(f"{source}: required field {key!r} is missing")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{source}: field {key!r} must be a positive integer, not {value!r}")
            return value

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        n_layers = int(need("num_hidden_layers"))
        mask_id = drafter_mask_token_id(raw)
        if mask_id is None:
            raise CheckpointError(f"{source}: dflash_config.mask_token_id is missing")
        window = raw.get("sliding_window")
        types = layer_types(raw, qwen=True)
        if len(types) != n_layers:
            raise CheckpointError(f"{source}: layer_types has {len(types)} entries for {n_layers} layers")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModelError(f"{source}: unsupported drafter layer types {sorted(unknown)}")
        if "sliding_attention" in types and window is None:
            raise CheckpointError(f"{source}: sliding_attention layers need a sliding_window")
        taps = drafter_taps(raw)
        block = _dflash(raw).get("block_size", drafter_dict(raw).get("block_size", DEFAULT_BLOCK_SIZE))
        if isinstance(block, bool) or not isinstance(block, int) or block < 2:
            raise CheckpointError(f"{source}: block_size must be an integer of at least 2 (an anchor and a draft), "
                                  f"not {block!r}")
        softcap = dflash.get("final_logit_softcapping", raw.get("final_logit_softcapping"))
        draft_window = dflash.get("draft_window")
        if draft_window is not None and (isinstance(draft_window, bool) or not isinstance(draft_window, int)
                                         or draft_window < 1):
            raise CheckpointError(f"{source}: dflash_config.draft_window must be a positive integer, "
                                  f"not {draft_window!r}")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            hidden_act=str(raw.get("hidden_act", "silu")),
            attention_bias=bool(raw.get("attention_bias", False)),
            block_size=block,
            mask_token_id=mask_id,
            layer_types=tuple(types),
            sliding_window=int(window) if window is not None else None,
            is_causal=raw.get("is_causal"),
            num_target_layers=raw.get("num_target_layers"),
            target_layer_ids=tuple(taps) if taps is not None else None,
            input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
            output_multiplier=float(dflash.get("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            draft_window=draft_window,
            architecture=architectures[0],
            source_format=source_format,
            raw=dict(raw),
            **dflash2,
        )

    def tap_layers(self, num_target_layers: int | None = None) -> list[int]:
        """The target layers to tap: the config's list, else the reference fallback for the target's depth."""
        if self.target_layer_ids is not None:
            return list(self.target_layer_ids)
        depth = self.num_target_layers or num_target_layers
        if depth is None:
            raise CheckpointError("drafter config names no target_layer_ids and no num_target_layers")
        return fallback_taps(self.num_hidden_layers, int(depth))


def _check_transformers_fields(raw: dict[str, Any], source: str) -> None:
    """A transformers-format drafter must name its taps and mask id: transformers' defaults are another
    model's (Muse-Glimmer-30B's)."""
    for key, (fix, default) in _HF_REQUIRED.items():
        if raw.get(key) is None:
            raise CheckpointError(
                f"{source}: this transformers-format drafter ({HF_MODEL_TYPE}) names no {key}",
                hint=f"transformers would fill in {default}, Muse-Glimmer-30B's value, not necessarily "
                     f"this drafter's: add {fix} to its config.json")


def _dflash2_fields(raw: dict[str, Any], dflash: dict[str, Any], source: str) -> dict[str, int]:
    """A DFlash 2 drafter's conv and selector fields, checked."""
    absent = [k for k in DFLASH2_FIELDS if dflash.get(k) is None]
    if absent:
        raise CheckpointError(f"{source}: a DFlash 2 drafter needs dflash_config.{absent[0]}")
    fields = {k: int(dflash[k]) for k in DFLASH2_FIELDS}
    if raw.get("vocab_size") is None:
        raise CheckpointError(f"{source}: a DFlash 2 drafter needs vocab_size (its selector's codebooks)")
    if int(raw.get("hidden_size") or 0) % fields["conv_group_size"]:
        raise CheckpointError(f"{source}: hidden_size {raw.get('hidden_size')} is not a multiple of "
                              f"conv_group_size {fields['conv_group_size']}")
    return fields


def check_block_size(block_size: int | None, trained: int | None) -> None:
    """The block-size rule (also checked from the drafter's config before a download): 1..`trained`, the
    drafter's trained size; without a drafter (`trained` None) only 1, or None for the default."""
    if block_size is None or block_size == 1 or (trained is not None and 1 <= block_size <= trained):
        return
    if trained is None:
        raise InvalidSettingError("a block size needs a drafter", hint="drop --block-size or add --draft")
    raise InvalidSettingError(f"block size {block_size} is outside 1..{trained} (this drafter's trained block size)",
                              hint=f"use --block-size 1..{trained}, or leave it out for {trained}")
