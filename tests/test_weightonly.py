"""Weight-only q4/q8 targets on the CPU: the kernels against the dequantized weights, the GGUF Q4_1 import,
lossless speculative decoding of a quantized target, the per-CPU choice, and bf16 weights on the fast path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VOCAB
from support.speculation import assert_speculative_equals_plain, random_prompts
from support.weightonly import linear, pairs, q4_1_bytes  # noqa: F401 (pairs: a fixture)
from torch import nn

from dflash_cli.engine.cpu.weightonly import (
    Q4_CODES_FILE,
    Q4Codes,
    Q4Linear,
    Q8Linear,
    quantize_linears,
    quantize_q4,
    read_q4_codes,
    write_q4_codes,
)
from dflash_cli.engine.device import cpu_auto_quant
from dflash_cli.engine.errors import CheckpointError, InvalidSettingError
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_drafter, load_pair
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.state import DecodeState
from dflash_cli.models.smollm2_convert import read_q4_1_blocks


def bf16_rows(n: int, width: int) -> torch.Tensor:
    return torch.randn(n, width).to(torch.bfloat16).float()  # exactly representable in bf16


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_q4_linear_equals_the_matmul_of_its_dequantized_weight(rows):
    m = linear(96, 128, seed=0)
    layer = quantize_linears([m], "q4")
    assert isinstance(layer, Q4Linear)
    codes = quantize_q4(m.weight)
    x = bf16_rows(rows, 128)
    expected = x @ codes.dequantize().T  # scale and zero are bf16-rounded in the codes already
    torch.testing.assert_close(layer(x), expected, rtol=1e-2, atol=2e-2)  # the output is rounded to bf16
    # and the 4-bit weight is close to the dense one: min/max groups of 32 lose little
    err = (codes.dequantize() - m.weight).abs().max()
    assert err <= (m.weight.abs().max() * 2 / 15) / 2 + 1e-3


def test_q8_linear_equals_the_matmul_of_its_dequantized_weight():
    m = linear(70, 96, seed=1, bias=True)
    layer = quantize_linears([m], "q8")
    assert isinstance(layer, Q8Linear)
    w = layer.weight_int8.float() * layer.scales.float()[:, None]
    x = bf16_rows(5, 96)
    torch.testing.assert_close(layer(x), x @ w.T + m.bias.detach(), rtol=1e-2, atol=2e-2)
    assert (w - m.weight).abs().max() <= m.weight.abs().max() / 127


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_fused_linears_split_back_into_each_linears_output(kind):
    parts = [linear(64, 64, seed=2), linear(32, 64, seed=3), linear(32, 64, seed=4)]
    fused = quantize_linears(parts, kind)
    x = bf16_rows(4, 64)
    outs = fused(x)
    assert isinstance(outs, tuple) and [o.shape[-1] for o in outs] == [64, 32, 32]
    for part, out in zip(parts, outs):
        alone = quantize_linears([part], kind)
        assert torch.equal(out, alone(x))  # fusing changes nothing but the number of calls


def test_a_block_and_single_rows_give_bit_identical_outputs():
    """What keeps speculative decoding of a q4/q8 target lossless: each row is computed on its own."""
    for kind in ("q4", "q8"):
        layer = quantize_linears([linear(160, 64, seed=5)], kind)
        x = torch.randn(16, 64)
        whole = layer(x)
        assert torch.equal(whole, torch.cat([layer(x[i:i + 1]) for i in range(16)]))


def test_constant_groups_survive_4_bits():
    w = torch.cat([torch.full((16, 32), 0.02), torch.full((16, 32), -3.5), torch.zeros(16, 32)], dim=1)
    back = quantize_q4(w).dequantize()
    torch.testing.assert_close(back, w, rtol=2**-8, atol=1e-6)


def test_the_planner_counts_the_8bit_lm_head_copy_and_no_dense_copy_of_layers_loaded_by_layer():
    from support.hf_configs import cfg

    from dflash_cli.models.memory.sizes import target_weight_bytes

    tied, untied = cfg("HuggingFaceTB__SmolLM2-135M-Instruct"), cfg("Qwen__Qwen3-8B")
    for config in (tied, untied):
        bf16, q4 = target_weight_bytes(config, "bf16"), target_weight_bytes(config, "q4")
        head_rows = config["vocab_size"] * config["hidden_size"]
        assert q4.components["lm_head"] - bf16.components["lm_head"] == head_rows  # one byte per weight
        # loaded layer by layer (engine/layerwise.py): the codes and one layer's 16-bit linears, no dense copy
        layers = config["num_hidden_layers"]
        one_layer = bf16.components["layers_linear"] // layers
        assert one_layer < q4.components["layers_linear"] < bf16.components["layers_linear"] / 2 + one_layer
    moe = cfg("Qwen__Qwen3-Coder-30B-A3B-Instruct")  # loads whole: the 16-bit attention linears stay beside the codes
    bf16, q4 = target_weight_bytes(moe, "bf16"), target_weight_bytes(moe, "q4")
    assert q4.components["layers_linear"] > bf16.components["layers_linear"]


def test_the_planner_loads_by_layer_the_families_the_loader_does():
    from dflash_cli.engine.fast_layers import FAMILIES
    from dflash_cli.models.memory.sizes import LAYERWISE_TYPES

    assert LAYERWISE_TYPES == FAMILIES


def test_what_cannot_be_quantized_stays_as_it_is():
    assert quantize_linears([linear(16, 48, seed=6)], "q4") is None  # 48 input channels: not groups of 32
    assert quantize_linears([linear(8, 64, seed=6)], "q4") is None  # 8 outputs: the kernel packs 16 at a time
    assert quantize_linears([nn.Identity()], "q4") is None
    assert quantize_linears([linear(8, 48, seed=6)], "q8") is not None  # per channel: any width


def test_gguf_q4_1_blocks_keep_their_codes_and_values(tmp_path):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(16, 64))
    d = rng.uniform(0.001, 0.02, size=(16, 2)).astype(np.float16)
    m = rng.uniform(-0.1, 0.0, size=(16, 2)).astype(np.float16)
    q, d_read, m_read = read_q4_1_blocks(q4_1_bytes(codes, d, m))
    assert np.array_equal(q.numpy(), codes)
    expected = codes.reshape(16, 2, 32) * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]
    as_kernel = Q4Codes.from_q4_1(q, d_read, m_read)
    np.testing.assert_allclose(as_kernel.dequantize().numpy(), expected.reshape(16, 64), rtol=1e-6, atol=1e-7)
    # the file round trip keeps the codes; the layer rounds (scale, zero) to bf16, at most half a bf16 ulp
    write_q4_codes(tmp_path / Q4_CODES_FILE, {"model.layers.0.mlp.up_proj": (q, d_read, m_read)})
    back = read_q4_codes(tmp_path / Q4_CODES_FILE)["model.layers.0.mlp.up_proj"]
    assert torch.equal(back.codes, q)
    layer = Q4Linear(back, [16], None)
    x = bf16_rows(2, 64)
    got, exact = layer(x), x @ torch.from_numpy(expected.reshape(16, 64)).float().T
    assert (got - exact).abs().max() <= exact.abs().max() * 2**-7 + 1e-3


def test_a_damaged_codes_file_is_a_checkpoint_error(tmp_path):
    path = tmp_path / Q4_CODES_FILE
    path.write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        read_q4_codes(path)
    from safetensors.torch import save_file

    save_file({"a.codes": torch.zeros(4, 16, dtype=torch.uint8), "a.d": torch.zeros(4, 2, dtype=torch.float16),
               "a.m": torch.zeros(4, 2, dtype=torch.float16)}, str(path))
    with pytest.raises(CheckpointError, match="damaged"):
        read_q4_codes(path)  # 16 bytes are 32 codes: one group, not two


def quantized_pair(pairs, family, kind, dtype="bfloat16", context=400):
    pair = load_pair(*pairs[family], device="cpu", dtype=dtype, quant=kind)
    assert pair.target.enable_fast_path(context, pad_to=pair.drafter.block_size) is None
    assert pair.target.fast.weights == kind
    head = pair.target.fast.lm_head
    assert isinstance(head, Q8Linear)  # under q4 too: 4-bit groups cost an LM head too much
    assert all(isinstance(p["qkv"], Q4Linear if kind == "q4" else Q8Linear) for p in pair.target.fast.projections)
    return pair


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_greedy_speculative_equals_greedy_plain_decoding_of_the_same_quantized_target(pairs, family, kind):
    pair = quantized_pair(pairs, family, kind)
    assert pair.target.fast.row_exact and pair.target.fast.dtype == torch.bfloat16
    assert_speculative_equals_plain(pair, random_prompts, (2, 4, 8), max_new_tokens=30)


def test_a_stop_inside_a_block_and_a_second_turn_match_plain_decoding(pairs):
    pair = quantized_pair(pairs, "llama", "q4")
    prompt = [5, 6, 7, 8]
    plain = generate(pair.target, None, prompt, max_new_tokens=24, stop_ids=[]).tokens
    stop = plain[9]
    expected = plain[:plain.index(stop) + 1]
    oracle = OracleDrafter(pair.drafter, prompt + plain + [0] * 20, acceptance=1.0, seed=0, vocab_size=VOCAB)
    got = generate(pair.target, oracle, prompt, max_new_tokens=24, block_size=8, stop_ids=[stop])
    assert got.tokens == expected
    # chat-turn reuse: the second turn continues on the kept caches and equals a fresh plain run
    state = DecodeState(pair.target, pair.drafter)
    first = generate(pair.target, pair.drafter, prompt, max_new_tokens=12, stop_ids=[], state=state)
    turn2 = state.tokens + [9, 10, 11]
    second = generate(pair.target, pair.drafter, turn2, max_new_tokens=12, stop_ids=[], state=state)
    assert second.stats.prefilled_tokens == 4  # the reply's last token (not yet in the cache) and the 3 new
    assert first.tokens + [9, 10, 11] + second.tokens == \
        (prompt + generate(pair.target, None, prompt, max_new_tokens=12, stop_ids=[]).tokens + [9, 10, 11]
         + generate(pair.target, None, turn2, max_new_tokens=12, stop_ids=[]).tokens)[len(prompt):]


def test_row_exact_attention_gives_each_row_the_same_bits_in_any_company():
    from dflash_cli.engine.fast_layers import row_exact_attention

    torch.manual_seed(0)
    kv, group, hd, window = 2, 3, 64, 256
    keys, values = torch.randn(2, 1, kv, window, hd).to(torch.bfloat16)
    slots = torch.arange(window)
    for n, end in ((8, 40), (16, 200), (4, 256)):
        positions = torch.arange(end - n, end)
        q = torch.randn(1, kv, group, n, hd).to(torch.bfloat16)
        mask = (slots[None] <= positions[:, None]).repeat(group, 1)[None, None]
        together = row_exact_attention(q.reshape(1, kv, group * n, hd), keys, values, ~mask, hd**-0.5)
        together = together.reshape(1, kv, group, n, hd)
        for i in range(n):
            alone = row_exact_attention(q[:, :, :, i], keys, values,
                                        (slots[None] > positions[i:i + 1, None]).repeat(group, 1)[None, None],
                                        hd**-0.5)
            assert torch.equal(alone, together[:, :, :, i])
        reference = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(1, kv, group * n, hd).float(), keys.float(), values.float(), attn_mask=mask, scale=hd**-0.5)
        torch.testing.assert_close(together.reshape(reference.shape).float(), reference, rtol=0.05, atol=0.02)


def test_bf16_weights_run_the_fast_path_losslessly_on_any_cpu(pairs):
    """bf16 weights are packed by oneDNN where the CPU computes bf16 natively and stay F.linear elsewhere;
    either way (CI runs whichever this machine has) the fast path runs them, and on these shapes the
    speculative output equals plain decoding (oneDNN rounds some larger bf16 shapes by row count: the
    engine says so, docs/engine.md)."""
    pair = load_pair(*pairs["qwen3"], device="cpu", dtype="bfloat16")
    assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    for prompt in random_prompts(3, seed=11):
        plain = generate(pair.target, None, prompt, max_new_tokens=24, stop_ids=[]).tokens
        oracle = OracleDrafter(pair.drafter, prompt + plain + [0] * 20, acceptance=0.8, seed=1, vocab_size=VOCAB)
        assert generate(pair.target, oracle, prompt, max_new_tokens=24, stop_ids=[]).tokens == plain


NO_CC = "no C compiler (cc or gcc) on the PATH"


@pytest.mark.parametrize("capability, fast_bf16, native_missing, timings, expected", [
    ("AVX512", True, None, {"q4a8": 5.0, "q4": 9.0}, "q4a8"), ("AVX512", True, None, {"q4a8": 9.0, "q4": 5.0}, "q4"),
    ("AVX2", True, NO_CC, None, "q4"), ("AVX512", False, None, None, "q4a8"), ("AVX2", False, None, None, "q4a8"),
    ("AVX2", False, NO_CC, None, None), ("DEFAULT", False, None, None, None), ("DEFAULT", True, None, None, None),
    ("NO AVX", False, None, None, None),
])
def test_auto_quant_on_a_cpu_measures_where_two_formats_can_run(tmp_path, monkeypatch, capability, fast_bf16,
                                                               native_missing, timings, expected):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    measured: list[int] = []

    def measure():
        measured.append(1)
        return dict(timings)

    for _ in range(2):
        chosen, why = cpu_auto_quant(capability, fast_bf16, native_missing, measure=measure)
        assert chosen == expected
        assert capability in why
        assert ("without native bf16" in why) == (capability in ("AVX512", "AVX2") and not fast_bf16)
        assert ("measured fastest" in why) == (timings is not None)
    assert len(measured) == (timings is not None)  # once per CPU: then read from the cache folder


def test_the_measurement_runs_both_formats_for_real_and_is_kept(tmp_path, monkeypatch):
    from dflash_cli.engine.cpu import choice, native

    if native.available_without_building() is not None:
        pytest.skip(f"no q4a8 kernels here: {native.available_without_building()}")
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    timings = choice.measured_formats(lambda: choice.measure_formats(repeats=1))
    assert set(timings) == set(choice.CANDIDATES) and all(t > 0 for t in timings.values())
    assert choice.measured_formats(lambda: {}) == timings  # kept
    choice.measurement_file().write_text("{not json")  # damaged: measured again, never an error
    assert choice.measured_formats(lambda: {"q4": 1.0}) == {"q4": 1.0}


def test_weight_only_targets_compute_in_bf16_unless_told_otherwise():
    from dflash_cli.engine.device import pick_dtype

    cpu = torch.device("cpu")
    for quant in ("q4", "q8"):
        assert pick_dtype(None, cpu, quant) == torch.bfloat16 == pick_dtype("auto", cpu, quant)
        assert pick_dtype("float32", cpu, quant) == torch.float32
    assert pick_dtype(None, cpu, "nf4") == pick_dtype(None, cpu)


def test_auto_quant_in_the_preflight_picks_the_cpus_format(monkeypatch):
    from support.hf_configs import cfg

    from dflash_cli.engine import device
    from dflash_cli.engine.cpu import choice, native
    from dflash_cli.models.memory.preflight import MemoryBudget, preflight_memory

    budget = MemoryBudget(64 * 2**30, 4096, "bf16", "system memory", "cpu")
    smol = cfg("HuggingFaceTB__SmolLM2-135M-Instruct")
    monkeypatch.setattr(device, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(choice, "measure_formats", lambda: {"q4a8": 2.0, "q4": 1.0})
    monkeypatch.setattr(native, "available_without_building", lambda: None)
    assert preflight_memory(smol, None, "auto", budget, "smol") == "q4"
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(native, "available_without_building", lambda: None)
    assert preflight_memory(smol, None, "auto", budget, "smol") == "q4a8"
    monkeypatch.setattr(native, "available_without_building", lambda: "no C compiler (cc or gcc) on the PATH")
    assert preflight_memory(smol, None, "auto", budget, "smol") == "none"
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(device, "cpu_capability", lambda: "DEFAULT")
    assert preflight_memory(smol, None, "auto", budget, "smol") == "none"


def test_weight_only_quantization_is_refused_where_it_cannot_run(pairs):
    with pytest.raises(InvalidSettingError, match="drafter stays 16/32-bit"):
        load_drafter(pairs["qwen3"][1], device="cpu", quant="q4")
    with pytest.raises(InvalidSettingError, match="runs on one CPU"):
        load_pair(*pairs["qwen3"], device="cpu", dtype="float32", quant="q4", layer_devices=["cpu"] * 6)


def test_the_cli_runs_q4_and_refuses_it_without_the_fast_path(tiny_target_dir):
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    ok = CliRunner().invoke(cli, ["generate", "-m", str(tiny_target_dir), "--quant", "q4", "-v", "-n", "6",
                                  "--no-chat-template", "hello"])
    assert ok.exit_code == 0, ok.stderr
    assert "q4 weights" in ok.stderr and " q4 ·" in ok.stderr  # --verbose's forward line and the load line
    refused = CliRunner().invoke(cli, ["generate", "-m", str(tiny_target_dir), "--quant", "q4", "--compile", "off",
                                       "-n", "6", "--no-chat-template", "hello"])
    assert refused.exit_code != 0
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert "--quant q4 runs on the fast path" in lines[0] and "Traceback" not in refused.stderr


def test_auto_falls_back_to_unquantized_where_q4_cannot_run(tiny_target_dir, monkeypatch):
    """--quant auto (the built-in models' default) never fails for a format the user did not ask for."""
    from click.testing import CliRunner

    from dflash_cli.engine import device
    from dflash_cli.engine.cpu import choice
    from dflash_cli.models.memory import preflight
    from dflash_cli.ui.cli import cli

    monkeypatch.setattr(device, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(choice, "measure_formats", lambda: {"q4": 1.0, "q4a8": 2.0})  # q4 measured faster
    args = ["generate", "-m", str(tiny_target_dir), "--quant", "auto", "-n", "6", "--no-chat-template", "hello"]
    picked = CliRunner().invoke(cli, args)
    assert picked.exit_code == 0, picked.stderr
    assert "--quant auto: q4" in picked.stderr and " q4 ·" in picked.stderr
    off = CliRunner().invoke(cli, args + ["--compile", "off"])
    assert off.exit_code == 0, off.stderr
    assert "--quant auto: q4 runs on the fast path, which --compile off turns off; running unquantized" in off.stderr
    assert off.stdout.strip()
    monkeypatch.setattr(preflight, "placement_budget", lambda *a, **k: None)  # free memory unknown (macOS, Windows)
    unknown = CliRunner().invoke(cli, args)
    assert unknown.exit_code == 0, unknown.stderr
    assert " q4 ·" not in unknown.stderr
