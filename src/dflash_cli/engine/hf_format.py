"""transformers' own DFlash drafter format (`model_type: muse_glimmer_assistant`) and its mapping to ours.

The layers are the same as a v1 drafter's. The differences, read from transformers'
`MuseGlimmerAssistantModel` (5.24): `block_size`, `mask_token_id` and `target_layer_ids` sit at the top
level of config.json; the context projection lives under `encoder` (`encoder.fc`, and the norm we call
`hidden_norm` is `encoder.output_norm_enc`); every layer is bidirectional inside the block (sliding
layers too); RoPE theta defaults to 500000. engine/hf_config.py reads such a config; this module writes one
and maps tensor names. Tensors are matched by name from the checkpoint's own
safetensors header, after dropping a `model.` prefix that every name carries (a wrapped save).
"""

from __future__ import annotations

from typing import Any

from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.hf_config import HF_ARCHITECTURE, HF_MODEL_TYPE

# our name -> transformers' name; every other tensor has the same name in both formats
RENAMED = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
_OURS = {theirs: ours for ours, theirs in RENAMED.items()}


def to_transformers_config(cfg) -> dict[str, Any]:
    """The muse_glimmer_assistant config.json of a v1 drafter (a DrafterConfig)."""
    if cfg.is_dflash2:
        raise InvalidSettingError("a DFlash 2 drafter cannot be written in transformers' format",
                                  hint="transformers' MuseGlimmerAssistantModel has no convolutions or selector: "
                                       "save it in the DFlash format")
    bidirectional = cfg.is_causal is False or (cfg.is_causal is None and "sliding_attention" not in cfg.layer_types)
    if not bidirectional or cfg.attention_bias or cfg.input_embedding_scale != 1.0 or cfg.output_multiplier != 1.0 \
            or cfg.final_logit_softcapping:
        raise InvalidSettingError("this drafter uses settings transformers' format cannot express "
                                  "(causal layers, attention bias or logit scaling)",
                                  hint="save it in the DFlash format")
    drop = {"architectures", "model_type", "auto_map", "dflash_config", "is_causal", "attention_bias",
            "use_sliding_window", "max_window_layers", "num_target_layers", "block_size"}
    out = {k: v for k, v in cfg.raw.items() if k not in drop}
    out.update(architectures=[HF_ARCHITECTURE], model_type=HF_MODEL_TYPE, block_size=cfg.block_size,
               mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.tap_layers(),
               layer_types=list(cfg.layer_types), head_dim=cfg.head_dim,
               num_key_value_heads=cfg.num_key_value_heads)
    if cfg.sliding_window is None:
        out.pop("sliding_window", None)
    if not out.get("rope_parameters"):
        theta = cfg.raw.get("rope_theta")
        scaling = cfg.raw.get("rope_scaling") or {}
        out.pop("rope_theta", None), out.pop("rope_scaling", None)
        out["rope_parameters"] = {"rope_type": scaling.get("rope_type", "default"),
                                  "rope_theta": float(theta) if theta is not None else 10000.0,
                                  **{k: v for k, v in scaling.items() if k not in ("rope_type", "type")}}
    return out


def checkpoint_names(keys: list[str]) -> tuple[str, dict[str, str | None]]:
    """From a transformers-format checkpoint's tensor names: the prefix they share and {their name: ours}.

    Names transformers does not use (our spellings of the renamed tensors) map to None; other unknown
    names map to themselves; either way the strict load reports them by name.
    """
    prefix = "model." if keys and all(k.startswith("model.") for k in keys) else ""
    mapping: dict[str, str | None] = {}
    for key in keys:
        name = key[len(prefix):]
        mapping[key] = None if name in RENAMED else _OURS.get(name, name)
    return prefix, mapping


def their_name(ours: str, prefix: str = "") -> str:
    return prefix + RENAMED.get(ours, ours)


def to_transformers_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    return {their_name(k): v for k, v in state.items()}
