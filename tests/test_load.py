"""Loading drafters and targets from folders: strictness, clear errors, real published configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import drafter_config, save_random_drafter, save_target, target_config
from safetensors.torch import load_file, save_file
from support.hf_configs import DATA

from dflash_cli.engine.errors import CheckpointError, IncompatiblePairError, UnsupportedModelError
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_drafter, load_pair, load_target


def copy_drafter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_loads_strictly_and_round_trips(tiny_models):
    drafter = load_drafter(tiny_models["qwen3-drafter"], device="cpu", dtype="float32")
    saved = load_file(str(tiny_models["qwen3-drafter"] / "model.safetensors"))
    assert set(saved) == set(drafter.state_dict())
    for name, tensor in saved.items():
        assert torch.equal(drafter.state_dict()[name], tensor), name


def test_missing_tensor_is_named(tiny_models, tmp_path):
    folder = copy_drafter(tiny_models["qwen3-drafter"], tmp_path / "d")
    rewrite_tensors(folder, lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.self_attn\.k_norm\.weight'"):
        load_drafter(folder, device="cpu")


def test_unexpected_tensor_is_named(tiny_models, tmp_path):
    folder = copy_drafter(tiny_models["qwen3-drafter"], tmp_path / "d")
    rewrite_tensors(folder, lambda t: t.__setitem__("embed_tokens.weight", torch.zeros(4, 4)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'embed_tokens\.weight'"):
        load_drafter(folder, device="cpu")


def test_wrong_shape_is_named_with_both_shapes(tiny_models, tmp_path):
    folder = copy_drafter(tiny_models["qwen3-drafter"], tmp_path / "d")
    rewrite_tensors(folder, lambda t: t.__setitem__("fc.weight", torch.zeros(64, 64)))
    with pytest.raises(CheckpointError, match=r"'fc\.weight' has shape \[64, 64\], the config implies \[64, 192\]"):
        load_drafter(folder, device="cpu")


def test_attention_bias_needs_bias_tensors(tmp_path):
    cfg = drafter_config(target_config(), attention_bias=True)
    folder = save_random_drafter(tmp_path / "d", cfg)
    drafter = load_drafter(folder, device="cpu", dtype="float32")
    assert drafter.layers[0].self_attn.q_proj.bias is not None
    rewrite_tensors(folder, lambda t: t.pop("layers.0.self_attn.v_proj.bias"))
    with pytest.raises(CheckpointError, match="v_proj.bias"):
        load_drafter(folder, device="cpu")


def test_truncated_safetensors_is_a_clear_error(tiny_models, tmp_path):
    folder = copy_drafter(tiny_models["qwen3-drafter"], tmp_path / "d")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as err:
        load_drafter(folder, device="cpu")
    assert "truncated" in err.value.hint


def test_pickle_only_folders_are_refused(tiny_models, tmp_path):
    folder = copy_drafter(tiny_models["qwen3-drafter"], tmp_path / "d")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded, ever")
    with pytest.raises(CheckpointError, match=r"only pickle weights \(pytorch_model\.bin\)"):
        load_drafter(folder, device="cpu")
    target = tmp_path / "t"
    shutil.copytree(tiny_models["qwen3"], target)
    (target / "model.safetensors").unlink()
    (target / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="only pickle weights"):
        load_target(target, device="cpu")


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "nowhere", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_drafter(tmp_path / "empty", device="cpu")


def test_a_truncated_target_is_one_checkpoint_error(tiny_models, tmp_path):
    import shutil

    from dflash_cli.engine.load import load_target

    folder = tmp_path / "truncated"
    shutil.copytree(tiny_models["llama"], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="a weights file is damaged") as err:
        load_target(folder, device="cpu")
    assert "truncated" in err.value.hint


@pytest.mark.parametrize("link, message", [("/nonexistent/blob", "links to /nonexistent/blob, which does not exist"),
                                           ("/dev/zero", "is not a regular file")])
def test_weights_that_link_nowhere_or_to_a_device_are_named(tiny_models, tmp_path, link, message):
    import shutil

    from dflash_cli.engine.load import load_target

    folder = tmp_path / "linked"
    shutil.copytree(tiny_models["llama"], folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(link)
    with pytest.raises(CheckpointError, match=message):  # was "no file named model.safetensors"
        load_target(folder, device="cpu")


@pytest.mark.parametrize("value", ["eight", 0, 1, True, 8.5])
def test_a_block_size_that_is_not_a_block_is_one_checkpoint_error(tmp_path, value):
    import json

    cfg = drafter_config(target_config())
    folder = save_random_drafter(tmp_path / "d", cfg)
    raw = json.loads((folder / "config.json").read_text())
    raw.setdefault("dflash_config", {})["block_size"] = value
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"block_size must be an integer of at least 2.*not {value!r}"):
        load_drafter(folder, device="cpu")


def test_hidden_size_of_another_model_names_both(tiny_models, tmp_path):
    cfg = drafter_config(target_config(hidden_size=96))
    folder = save_random_drafter(tmp_path / "wide", cfg)
    with pytest.raises(IncompatiblePairError) as err:
        load_pair(tiny_models["qwen3"], folder, device="cpu")
    message = str(err.value)
    assert "hidden size 96" in message and "the target 64" in message
    assert str(folder) in message and str(tiny_models["qwen3"]) in message


def test_tapped_layer_missing_from_target(tiny_models, tmp_path):
    folder = save_random_drafter(tmp_path / "deep", drafter_config(target_config(), taps=(1, 3, 9),
                                                                   num_target_layers=None))
    with pytest.raises(IncompatiblePairError, match=r"taps target layers \[1, 3, 9\], but the target has 6 layers"):
        load_pair(tiny_models["qwen3"], folder, device="cpu")


def test_mask_id_outside_target_vocabulary(tiny_models, tmp_path):
    cfg = drafter_config(target_config())
    cfg["dflash_config"]["mask_token_id"] = 151669
    folder = save_random_drafter(tmp_path / "mask", cfg)
    with pytest.raises(IncompatiblePairError,
                       match=r"mask token id 151669 is outside the target's embedding matrix \(160 rows\)"):
        load_pair(tiny_models["qwen3"], folder, device="cpu")


def test_hybrids_other_than_qwen3_5_are_refused_before_loading_weights(tmp_path):
    # Qwen3.5's and Qwen3-Next's Gated DeltaNet state rolls back (tests/test_hybrid.py, test_qwen3_next.py);
    # another family's (Kimi Linear's KDA) does not yet
    folder = tmp_path / "kimi-linear"
    folder.mkdir()
    config = json.loads((DATA / "Qwen__Qwen3.5-4B" / "config.json").read_text())
    config["text_config"]["model_type"] = "kimi_linear"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="linear_attention layers"):
        load_target(folder, device="cpu")


def scaled(config: dict, **dims) -> dict:
    out = dict(config)
    out.update(dims)
    return out


def test_published_qwen3_4b_drafter_config_decodes_losslessly(tmp_path):
    """z-lab/Qwen3-4B-DFlash-b16's config at reduced width, against a reduced Qwen3-4B (36 layers)."""
    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    target_cfg = scaled(json.loads((DATA / "Qwen__Qwen3-4B" / "config.json").read_text()), **small,
                        torch_dtype="float32")
    target = save_target(tmp_path / "target", target_cfg, seed=3, scale=3.0)
    drafter_cfg = scaled(json.loads((DATA / "z-lab__Qwen3-4B-DFlash-b16" / "config.json").read_text()), **small)
    drafter = save_random_drafter(tmp_path / "drafter", drafter_cfg)
    pair = load_pair(target, drafter, device="cpu", dtype="float32")
    assert pair.drafter.block_size == 16 and pair.drafter.mask_token_id == 151669
    assert pair.target._taps == [1, 9, 17, 25, 33]
    prompt = [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198]
    ids = torch.tensor([prompt])
    expected = pair.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                          do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
    for block in (16, 7):
        got = generate(pair.target, pair.drafter, prompt, max_new_tokens=24, block_size=block, stop_ids=[])
        assert got.tokens == expected


def test_published_qwen35_drafter_config_loads_and_drafts(tmp_path):
    """z-lab/Qwen3.5-4B-DFlash: 5 sliding-window layers + 1 full, 8 taps, nested block size, rope_parameters."""
    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    drafter_cfg = scaled(json.loads((DATA / "z-lab__Qwen3.5-4B-DFlash" / "config.json").read_text()), **small,
                         sliding_window=6)
    drafter = save_random_drafter(tmp_path / "drafter", drafter_cfg)
    loaded = load_drafter(drafter, device="cpu", dtype="float32")
    assert [layer.causal for layer in loaded.layers] == [True] * 5 + [False]
    assert [layer.window for layer in loaded.layers] == [6] * 5 + [None]
    assert loaded.block_size == 16 and loaded.mask_token_id == 248077
    # Its real target has linear-attention layers; a dense stand-in of the same shape shows it drafts.
    target_cfg = target_config(vocab_size=248320, num_hidden_layers=32, hidden_size=64, head_dim=16)
    target = save_target(tmp_path / "target", target_cfg, seed=4, scale=3.0)
    pair = load_pair(target, drafter, device="cpu", dtype="float32")
    assert pair.target._taps == [1, 5, 9, 13, 17, 21, 25, 29]
    prompt = list(range(100, 130))
    ids = torch.tensor([prompt])
    expected = pair.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                          do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
    got = generate(pair.target, pair.drafter, prompt, max_new_tokens=20, stop_ids=[])
    assert got.tokens == expected and got.stats.drafted > 0


def test_unknown_drafter_architectures_are_refused_by_name(tiny_models, tmp_path):
    folder = copy_drafter(tiny_models["qwen3-drafter"], tmp_path / "d3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["DFlash3DraftModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="DFlash3DraftModel"):
        load_drafter(folder, device="cpu")


def test_loading_a_target_leaves_the_logging_levels_as_it_found_them(tiny_models):
    import logging

    from transformers.utils import logging as hf_logging

    accelerate_log = logging.getLogger("accelerate.big_modeling")
    accelerate_log.setLevel(logging.INFO)
    verbosity = hf_logging.get_verbosity()
    try:
        load_target(tiny_models["qwen3"], device="cpu", dtype="float32")
        assert accelerate_log.level == logging.INFO and hf_logging.get_verbosity() == verbosity
    finally:
        accelerate_log.setLevel(logging.NOTSET)
