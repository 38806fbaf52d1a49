"""transformers' own drafter format (muse_glimmer_assistant): strict loading through a name mapping,
saving in either format, and transformers' MuseGlimmerAssistantModel loading what we write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import dflash2_config, drafter_config, random_drafter, save_target, target_config
from safetensors.torch import load_file, save_file
from support.hf_configs import DATA

from dflash_cli.engine.drafter import DrafterConfig
from dflash_cli.engine.errors import CheckpointError, InvalidSettingError
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_drafter, load_pair, save_drafter

CASES = {
    "full attention": dict(),
    # a window wider than the test's sequences: transformers' bidirectional window admits |q - k| <= window
    # where the z-lab rule (ours) admits < window, and its mask is not offset by the context in a cache-less
    # call (docs/format.md section 8)
    "sliding, bidirectional": dict(layer_types=["sliding_attention"] * 2, sliding_window=64, use_sliding_window=True,
                                   is_causal=False),
}


@pytest.fixture(scope="module", params=list(CASES))
def both(request, tmp_path_factory):
    """One random v1 drafter saved in our format and in transformers' format."""
    root = tmp_path_factory.mktemp("formats")
    model = random_drafter(drafter_config(target_config(), **CASES[request.param]), seed=3)
    return save_drafter(model, root / "ours"), save_drafter(model, root / "theirs", format="transformers")


def test_the_transformers_folder_has_their_names_and_top_level_fields(both):
    ours, theirs = both
    cfg = json.loads((theirs / "config.json").read_text())
    assert cfg["model_type"] == "muse_glimmer_assistant" and "dflash_config" not in cfg
    assert cfg["block_size"] == 8 and cfg["mask_token_id"] == 150 and cfg["target_layer_ids"] == [1, 3, 4]
    names = set(load_file(str(theirs / "model.safetensors")))
    assert {"encoder.fc.weight", "encoder.output_norm_enc.weight"} <= names and "fc.weight" not in names
    assert len(names) == len(load_file(str(ours / "model.safetensors")))


def test_transformers_loads_it_with_no_missing_keys_and_computes_what_we_compute(both):
    """transformers' own MuseGlimmerAssistantModel (no remote code) loads the folder we wrote with no missing
    or unexpected keys, and its forward pass equals ours: the mapping and the semantics are theirs."""
    from transformers import MuseGlimmerAssistantModel

    _, theirs = both
    model, info = MuseGlimmerAssistantModel.from_pretrained(str(theirs), output_loading_info=True,
                                                            dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    mine = load_drafter(theirs, device="cpu", dtype="float32")
    torch.manual_seed(5)
    T, B = 9, 8
    context, noise = torch.randn(1, T, 3 * 64), torch.randn(1, B, 64)
    with torch.no_grad():
        want = model.eval()(noise_embeds=noise, context_hidden_states=context,
                            attention_mask=torch.ones(1, T + B, dtype=torch.long)).last_hidden_state
        got = mine(context, noise, T, mine.new_cache())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_both_formats_draft_identical_tokens(both, tmp_path):
    ours, theirs = both
    cfg = target_config()
    target = save_target(tmp_path / "t", cfg, seed=1, scale=3.0)
    a = load_pair(target, ours, device="cpu", dtype="float32")
    b = load_pair(target, theirs, device="cpu", dtype="float32")
    assert b.drafter.config.source_format == "transformers" and a.target._taps == b.target._taps
    for name, tensor in a.drafter.state_dict().items():
        assert torch.equal(b.drafter.state_dict()[name], tensor), name
    anchor, hidden = torch.tensor([7]), torch.randn(1, 10, 3 * 64)
    drafts = [p.drafter.draft(hidden, anchor, 10, 8, p.drafter.new_cache(), p.target.embed_table,
                              p.target.lm_head) for p in (a, b)]
    assert torch.equal(*drafts)
    prompt = [3, 14, 15, 92, 65]
    plain = generate(a.target, None, prompt, max_new_tokens=24, stop_ids=[]).tokens
    assert generate(a.target, a.drafter, prompt, max_new_tokens=24, stop_ids=[]).tokens == plain
    assert generate(b.target, b.drafter, prompt, max_new_tokens=24, stop_ids=[]).tokens == plain


def test_published_assistant_config_reads_like_the_dflash_fixture():
    """The fixture pair (same drafter, both formats): same fields wherever the formats overlap."""
    def read(name):
        return DrafterConfig.from_dict(json.loads((DATA / name / "config.json").read_text()))

    theirs, ours = read("muse-glimmer-assistant-fixture"), read("z-lab__dflash2-muse-glimmer-fixture")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "block_size", "mask_token_id", "target_layer_ids", "layer_types",
                  "sliding_window", "is_causal"):
        assert getattr(theirs, field) == getattr(ours, field), field
    assert theirs.source_format == "transformers" and not theirs.is_dflash2


@pytest.fixture
def theirs_folder(both, tmp_path):
    return shutil.copytree(both[1], tmp_path / "theirs")


def rewrite(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("encoder.output_norm_enc.weight"), r"missing tensor 'encoder\.output_norm_enc\.weight'"),
    (lambda t: t.__setitem__("hidden_norm.weight", t.pop("encoder.output_norm_enc.weight")),
     # our name in their file is not theirs: refused, not silently accepted
     r"unexpected tensor 'hidden_norm\.weight'"),
    (lambda t: t.__setitem__("encoder.fc.weight", torch.zeros(64, 64)),
     r"'encoder\.fc\.weight' has shape \[64, 64\], the config implies \[64, 192\]"),
    (lambda t: t.__setitem__("lm_head.weight", torch.zeros(2, 2)), r"unexpected tensor 'lm_head\.weight'"),
])
def test_bad_tensors_are_named_as_the_checkpoint_names_them(theirs_folder, edit, message):
    rewrite(theirs_folder, edit)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(theirs_folder, device="cpu")


def test_a_model_prefix_on_every_name_is_read(both, theirs_folder):
    rewrite(theirs_folder, lambda t: [t.__setitem__("model." + k, t.pop(k)) for k in list(t)])
    a = load_drafter(both[0], device="cpu", dtype="float32")
    b = load_drafter(theirs_folder, device="cpu", dtype="float32")
    for name, tensor in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], tensor), name
    rewrite(theirs_folder, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        load_drafter(theirs_folder, device="cpu")


def test_round_trip_back_to_our_format(both, tmp_path):
    ours, theirs = both
    again = save_drafter(load_drafter(theirs, device="cpu", dtype="float32"), tmp_path / "again")
    assert load_file(str(again / "model.safetensors")).keys() == load_file(str(ours / "model.safetensors")).keys()
    a, b = load_drafter(ours, device="cpu", dtype="float32"), load_drafter(again, device="cpu", dtype="float32")
    assert [layer.causal for layer in a.layers] == [layer.causal for layer in b.layers]


def test_what_their_format_cannot_express_is_refused(tmp_path):
    dflash2 = random_drafter(dflash2_config(target_config()))
    with pytest.raises(InvalidSettingError, match="DFlash 2"):
        save_drafter(dflash2, tmp_path / "a", format="transformers")
    causal = random_drafter(drafter_config(target_config(), layer_types=["sliding_attention"] * 2, sliding_window=4,
                                           use_sliding_window=True))  # sliding layers causal: the z-lab rule
    with pytest.raises(InvalidSettingError, match="causal"):
        save_drafter(causal, tmp_path / "b", format="transformers")


@pytest.mark.parametrize("field", ["target_layer_ids", "mask_token_id"])
def test_a_drafter_without_its_taps_or_mask_id_is_refused_not_given_transformers_defaults(both, tmp_path, field):
    """transformers fills in Muse-Glimmer-30B's taps [1, 13, 25, 37, 49] and mask id 201818 when these are
    absent: values of one model, not this drafter's. Such a folder is refused by name, with the fix; on a
    target those taps would not even fit (layer 49 of 6), the drafter is not blamed for taps it never had."""
    folder = shutil.copytree(both[1], tmp_path / "theirs")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg[field]
    (folder / "config.json").write_text(json.dumps(cfg))
    target = save_target(tmp_path / "t", target_config(), seed=1)
    with pytest.raises(CheckpointError, match=rf"config\.json: .*names no {field}") as error:
        load_pair(target, folder, device="cpu", dtype="float32")
    assert "transformers would fill in" in error.value.hint and f'"{field}"' in error.value.hint
    with pytest.raises(CheckpointError, match=f"names no {field}"):
        DrafterConfig.from_dict(cfg)
