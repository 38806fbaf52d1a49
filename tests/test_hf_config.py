"""config.json fields read one way: the engine (DrafterConfig, the drafter module, pairing, transformers'
own configs), the memory planner and `show` agree on every tricky case."""

from __future__ import annotations

import pytest
import torch
from conftest import drafter_config, target_config

from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.errors import CheckpointError
from dflash_cli.engine.hf_config import DrafterConfig, layer_types
from dflash_cli.engine.hf_format import to_transformers_config
from dflash_cli.engine.pairing import check_pair
from dflash_cli.models.memory.plan import plan_memory
from dflash_cli.models.memory.sizes import drafter_weight_bytes, kv_cache_bytes
from dflash_cli.ui.show_cmd import config_summary

TARGET = target_config("qwen3")


def _without(cfg: dict, *keys: str) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys}


def _flat(taps=(1, 3, 4), **kw) -> dict:
    """A drafter config with no layer_types, so the sliding flags decide."""
    return _without(drafter_config(TARGET, taps=taps, **kw), "layer_types")


def _no_taps(cfg: dict) -> dict:
    cfg = dict(cfg, dflash_config={k: v for k, v in cfg["dflash_config"].items() if k != "target_layer_ids"})
    return cfg


def _top_level_block(cfg: dict) -> dict:
    dflash = {k: v for k, v in cfg["dflash_config"].items() if k != "block_size"}
    return dict(_without(cfg, "dflash_config"), dflash_config=dflash, block_size=5)


def _transformers(cfg: dict, drop=()) -> dict:
    out = to_transformers_config(DrafterConfig.from_dict(cfg))
    return _without(out, *drop)


DRAFTERS = {
    "nested block size": drafter_config(TARGET, nested_block=True, block_size=6),
    "top-level block size": _top_level_block(drafter_config(TARGET, nested_block=True)),
    "both block sizes: nested wins": dict(drafter_config(TARGET, nested_block=True, block_size=6), block_size=9),
    "no block size": _without(drafter_config(TARGET), "block_size"),
    "no taps: one per draft layer": _no_taps(drafter_config(TARGET, layers=3)),
    "sliding_window, use_sliding_window absent": _without(_flat(sliding_window=4, max_window_layers=0),
                                                          "use_sliding_window"),
    "use_sliding_window true, max_window_layers 1": _flat(sliding_window=4, use_sliding_window=True,
                                                           max_window_layers=1),
    "use_sliding_window false": _flat(sliding_window=4, use_sliding_window=False),
    "transformers format": _transformers(drafter_config(TARGET, layer_types=["full_attention"] * 2)),
    "transformers format, no block size": _transformers(
        drafter_config(TARGET, layers=6, layer_types=["full_attention"] * 6), drop=("block_size",)),
}


@pytest.mark.parametrize("case", DRAFTERS)
def test_engine_planner_and_show_read_a_drafter_alike(case):
    raw = DRAFTERS[case]
    cfg = DrafterConfig.from_dict(raw)
    with torch.device("meta"):
        module = DFlashDrafter(cfg)
    # the planner counts the parameters of the module the engine builds, fc (the number of taps) included
    counted = drafter_weight_bytes(raw, "fp32").params
    assert counted["fc"] == module.fc.weight.numel()
    assert sum(counted.values()) == sum(p.numel() for p in module.parameters())
    target = dict(TARGET, num_hidden_layers=max([TARGET["num_hidden_layers"] - 1, *(cfg.target_layer_ids or ())]) + 1)
    taps = check_pair(target, cfg)
    assert module.fc.in_features == len(taps) * cfg.hidden_size
    plan = plan_memory(target, raw, quant="fp32", context_tokens=64, available_bytes=1 << 40)
    assert plan.block_size == cfg.block_size
    shown = config_summary(target, raw)["drafter"]
    assert (shown["block_size"], shown["mask_token_id"]) == (cfg.block_size, cfg.mask_token_id)
    assert shown["target_layer_ids"] == (list(cfg.target_layer_ids) if cfg.target_layer_ids is not None else None)
    # the layer kinds the module runs are those the shared rule gives
    kinds = ["sliding_attention" if layer.window is not None else "full_attention" for layer in module.layers]
    assert kinds == list(cfg.layer_types) == layer_types(cfg.raw, qwen=True)


def test_the_tricky_cases_read_as_documented():
    read = {case: DrafterConfig.from_dict(raw) for case, raw in DRAFTERS.items()}
    assert [read[c].block_size for c in ("nested block size", "top-level block size",
                                         "both block sizes: nested wins", "no block size")] == [6, 5, 6, 16]
    assert read["no taps: one per draft layer"].target_layer_ids is None
    assert set(read["sliding_window, use_sliding_window absent"].layer_types) == {"full_attention"}
    assert read["use_sliding_window true, max_window_layers 1"].layer_types == ("full_attention", "sliding_attention")
    assert read["transformers format"].tap_layers() == [1, 3, 4]
    assert read["transformers format, no block size"].block_size == 16  # transformers' default, and ours


@pytest.mark.parametrize("field", ["target_layer_ids", "mask_token_id"])
def test_transformers_defaults_are_never_shown_or_run_as_the_checkpoints_own(field):
    """A transformers-format config without taps or mask id: transformers would fill in Muse-Glimmer-30B's
    [1, 13, 25, 37, 49] and 201818. `show` says the config names none; the engine refuses it (on this 6-layer
    target those taps would not even fit, and the pair check blamed the drafter for them)."""
    raw = _transformers(drafter_config(TARGET, layer_types=["full_attention"] * 2), drop=(field,))
    shown = config_summary(TARGET, raw)["drafter"]
    assert shown[field] is None
    assert [1, 13, 25, 37, 49] not in shown.values() and 201818 not in shown.values()
    with pytest.raises(CheckpointError, match=f"names no {field}"):
        check_pair(TARGET, DrafterConfig.from_dict(raw))


TARGETS = {
    "qwen3, use_sliding_window absent": dict(sliding_window=8, max_window_layers=2),
    "qwen3, use_sliding_window true": dict(sliding_window=8, max_window_layers=2, use_sliding_window=True),
    "qwen3, use_sliding_window false": dict(sliding_window=8, use_sliding_window=False),
    "qwen2, use_sliding_window true": dict(model_type="qwen2", sliding_window=8, max_window_layers=4,
                                           use_sliding_window=True),
}


@pytest.mark.parametrize("case", TARGETS)
def test_target_layer_types_are_transformers_own(case):
    from transformers import AutoConfig

    raw = dict(_without(TARGET, "architectures"), **TARGETS[case])
    loaded = AutoConfig.for_model(raw.pop("model_type"), **raw)
    assert layer_types(dict(raw, model_type=loaded.model_type)) == loaded.layer_types
    # the planner caps exactly the layers transformers makes sliding
    sliding = loaded.layer_types.count("sliding_attention")
    per_row = 2 * TARGET["num_key_value_heads"] * TARGET["head_dim"] * 2
    assert kv_cache_bytes(dict(raw, model_type=loaded.model_type), 100) == per_row * (
        100 * (TARGET["num_hidden_layers"] - sliding) + 8 * sliding)


def test_text_config_nesting_reads_as_flat():
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": dict(TARGET),
              "vision_config": {"hidden_size": 8}}
    cfg = DrafterConfig.from_dict(drafter_config(TARGET))
    assert check_pair(nested, cfg) == check_pair(TARGET, cfg)
    assert kv_cache_bytes(nested, 100) == kv_cache_bytes(TARGET, 100)
    assert config_summary(nested, None)["target"]["hidden_size"] == TARGET["hidden_size"]
