"""A target in a CPU integer format loaded one decoder layer at a time (engine/layerwise.py): the same model
as a whole load, lossless, and never more than one layer's full-precision weights in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import HF_CONFIGS, VOCAB, drafter_config, read_json, save_random_drafter, target_config
from support.speculation import assert_speculative_equals_plain, random_prompts
from torch import nn

from dflash_cli.engine import layerwise
from dflash_cli.engine.cpu.int8act import INT8_ACT_QUANTS, CodesEmbedding
from dflash_cli.engine.errors import CheckpointError
from dflash_cli.engine.load import load_pair, load_target
from dflash_cli.engine.target import decoder_layers


def save_in(folder: Path, config: dict, dtype: torch.dtype, seed: int = 1) -> Path:
    """A random target saved in `dtype` (real checkpoints are mostly bf16, loaded here in fp32 or bf16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    model.to(dtype).save_pretrained(folder)
    return folder


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for layer in decoder_layers(model) for m in layer.modules() if isinstance(m, nn.Linear)]


def first_logits(pair, prompt: list[int]) -> torch.Tensor:
    target = pair.target
    logits, _ = target.forward(torch.tensor([prompt]), target.fast.new_cache(), 0)
    return logits


def record_drafts(pair, prompt: list[int]) -> list[torch.Tensor]:
    """The drafter's logits of every round of a greedy speculative generation."""
    from dflash_cli.engine.generate import generate

    seen, postprocess = [], pair.drafter.postprocess_logits

    def recording(logits):
        seen.append(logits.clone())
        return postprocess(logits)

    pair.drafter.postprocess_logits = recording
    try:
        generate(pair.target, pair.drafter, prompt, max_new_tokens=16, block_size=4, stop_ids=[])
    finally:
        del pair.drafter.postprocess_logits
    return seen


CASES = [("qwen3", True, torch.bfloat16, "q4a8"), ("llama", False, torch.float32, "q8a8"),
         ("qwen3", False, torch.float32, "q8"), ("llama", True, torch.bfloat16, "q4"),
         ("qwen2", True, torch.bfloat16, "q8a8")]  # Qwen2: q/k/v biases


def config_of(family: str, tied: bool) -> dict:
    if family == "qwen2":  # Llama's shape with Qwen2's attention biases
        return target_config("llama", model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                             use_sliding_window=False, tie_word_embeddings=tied)
    return target_config(family, tie_word_embeddings=tied)


@pytest.mark.parametrize("family,tied,saved,kind", CASES)
def test_layer_by_layer_runs_the_whole_loads_model_and_stays_lossless(tmp_path, family, tied, saved, kind):
    cfg = config_of(family, tied)
    folder = save_in(tmp_path / "target", cfg, saved)
    drafter = save_random_drafter(tmp_path / "drafter", drafter_config(cfg), seed=2)
    whole = load_pair(folder, drafter, device="cpu", quant=kind)
    by_layer = load_pair(folder, drafter, device="cpu", quant=kind, by_layer=True)
    assert whole.target.quantized_layers is None
    assert by_layer.target.quantized_layers is not None and by_layer.target.dense_freed
    for pair in (whole, by_layer):
        assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    assert by_layer.target.fast.quantized_as_loaded and not whole.target.fast.quantized_as_loaded
    assert "layer by layer" in by_layer.target.fast.weight_form
    model = by_layer.target.model
    if tied and kind in INT8_ACT_QUANTS:  # the tied head's 8-bit codes took the dense table's place
        assert isinstance(model.get_input_embeddings(), CodesEmbedding)
        assert whole.target.embed_weight.numel() == by_layer.target.embed_weight.numel() == 0
    else:
        assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    # a float32 target keeps 16-bit embeddings as saved (half the memory, the same values widened)
    kept = saved == torch.bfloat16 and by_layer.target.fast.dtype == torch.float32
    # both free the same weights; a tied table freed as 16-bit frees half the bytes of its fp32 copy
    narrower = cfg["vocab_size"] * cfg["hidden_size"] * 2 if kept and tied and kind in INT8_ACT_QUANTS else 0
    assert whole.target.fast.freed_bytes - by_layer.target.fast.freed_bytes == narrower
    assert by_layer.target.fast.freed_bytes > 0
    assert model.generation_config.eos_token_id == whole.target.model.generation_config.eos_token_id == 2
    assert by_layer.target.embed_weight.dtype == (saved if kept else by_layer.target.fast.dtype)
    assert whole.target.embed_weight.dtype == whole.target.fast.dtype == by_layer.target.fast.dtype
    for prompt in random_prompts(3, seed=5):
        assert torch.equal(first_logits(by_layer, prompt), first_logits(whole, prompt))
    # a draft vocabulary's head, made from the LM head's rows, in the drafter's dtype either way
    rows = torch.randn(3, cfg["hidden_size"], dtype=whole.target.fast.dtype)
    heads = []
    for pair in (whole, by_layer):
        pair.drafter.draft_vocab = torch.arange(3, VOCAB, 2)
        heads.append(pair.drafter.draft_head(pair.target.logits_head)(rows))
    assert heads[0].dtype == rows.dtype and torch.equal(heads[0], heads[1])
    drafts = [record_drafts(pair, random_prompts(1, seed=7)[0]) for pair in (whole, by_layer)]
    assert len(drafts[0]) > 1 and all(torch.equal(a, b) for a, b in zip(*drafts, strict=True))
    assert_speculative_equals_plain(by_layer, random_prompts, (4,), max_new_tokens=20)


def test_no_more_than_one_layer_is_held_in_full_precision_while_loading(tmp_path, monkeypatch):
    cfg = target_config("qwen3")
    folder = save_in(tmp_path / "target", cfg, torch.bfloat16)
    dense_per_call: list[int] = []
    made = layerwise.layer_projections

    def counting(layer, *args, **kwargs):
        model_layers = decoder_layers(loading[0])
        dense_per_call.append(sum(any(m.weight.numel() and m.weight.device.type != "meta"
                                      for m in other.modules() if isinstance(m, nn.Linear))
                                  for other in model_layers))
        return made(layer, *args, **kwargs)

    loading: list[nn.Module] = []
    empty = layerwise._empty_model
    monkeypatch.setattr(layerwise, "_empty_model", lambda *a: loading.append(empty(*a)) or loading[-1])
    monkeypatch.setattr(layerwise, "layer_projections", counting)
    target = load_target(folder, device="cpu", quant="q4a8", by_layer=True)
    assert dense_per_call == [1] * cfg["num_hidden_layers"]  # each layer quantized before the next is read
    assert all(m.weight.numel() == 0 for m in linears(target.model))
    dense = sum(m.in_features * m.out_features * 4 for m in linears(target.model))
    assert target.quantized_layers.freed_bytes == dense


def qwen3_moe_config() -> dict:
    cfg = read_json(HF_CONFIGS / "Qwen__Qwen3-Coder-30B-A3B-Instruct" / "config.json")
    cfg.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
               num_hidden_layers=4, mlp_only_layers=[2], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_window_layers=4, vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, torch_dtype="float32")
    return cfg


def test_checkpoints_it_cannot_take_tensor_for_tensor_load_whole_and_still_run(tmp_path):
    from safetensors.torch import load_file, save_file

    moe = save_in(tmp_path / "moe", qwen3_moe_config(), torch.float32)  # a family outside the dense ones
    renamed = save_in(tmp_path / "renamed", target_config("qwen3"), torch.float32)
    weights = load_file(str(renamed / "model.safetensors"))
    weights["model.layers.0.mlp.down_proj.weight.orig"] = weights.pop("model.layers.0.mlp.down_proj.weight")
    save_file(weights, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    for folder in (moe, renamed):
        target = load_target(folder, device="cpu", quant="q8", by_layer=True)
        assert target.quantized_layers is None
        assert target.enable_fast_path(64) is None
        logits, _ = target.forward(torch.tensor([[3, 4, 5]]), target.fast.new_cache(), 0)
        assert torch.isfinite(logits).all()


def test_a_truncated_weights_file_is_a_checkpoint_error(tmp_path):
    folder = save_in(tmp_path / "target", target_config("qwen3"), torch.float32)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="damaged|truncated|not a readable"):
        load_target(folder, device="cpu", quant="q4a8", by_layer=True)
