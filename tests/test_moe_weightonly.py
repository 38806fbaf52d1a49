"""Mixture-of-experts targets under --quant q4/q8 (engine/moe.py): every expert 4/8-bit through the real
loading path, each token's output the same bits in a block verify as in a 1-token decode, greedy speculative
output equal to greedy plain output of the same quantized target, and the 4-bit experts close to the 16-bit.

Tiny random targets scaled down from the published configs, saved as the checkpoints are: Qwen3-MoE
(Qwen3-Coder-30B-A3B: 8 experts, top 3, one dense-MLP layer), Gemma 4's 26B-A4B (4 experts, top 2, beside
its MLP), Qwen3.5-MoE and Qwen3-Next (hybrids with a shared expert); the builders are the other tests'.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import HF_CONFIGS, VOCAB, drafter_config, read_json, save_random_drafter, save_target
from support.gemma_models import gemma_drafter_config, save_gemma_target
from support.hybrid_models import save_family
from support.speculation import assert_speculative_equals_plain, hf_greedy
from torch import nn

from dflash_cli.engine.cpu.weightonly import Q4Linear, Q8Linear, quantize_q4
from dflash_cli.engine.fast_layers import fast_path_unsupported
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair, load_target
from dflash_cli.engine.moe import WeightOnlyExperts, each_row, quantize_experts
from dflash_cli.engine.oracle import OracleDrafter

LINEAR = {"q4": Q4Linear, "q8": Q8Linear}


def qwen3_moe_config(**overrides) -> dict:
    """Qwen3-Coder-30B-A3B's published config scaled down: 4 layers (the third a dense MLP), 8 experts of
    32 channels, top 3."""
    cfg = read_json(HF_CONFIGS / "Qwen__Qwen3-Coder-30B-A3B-Instruct" / "config.json")
    cfg.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
               num_hidden_layers=4, mlp_only_layers=[2], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_window_layers=4, vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, torch_dtype="float32")
    cfg.update(overrides)
    return cfg


def save_moe_family(name: str, root: Path) -> tuple[Path, Path | None]:
    """(target, drafter) folders of a tiny MoE family; "wide": one Qwen3-MoE layer with Qwen3-30B-A3B's hidden
    and expert sizes (2048, 768), where 16-bit experts round some rows by their company (no drafter)."""
    if name == "wide":
        cfg = qwen3_moe_config(hidden_size=2048, moe_intermediate_size=768, num_experts=4, num_experts_per_tok=2,
                               num_hidden_layers=1, mlp_only_layers=[])
        return save_target(root / "target", cfg, seed=3), None
    if name == "qwen3_moe":
        cfg = qwen3_moe_config()
        return (save_target(root / "target", cfg, seed=3, scale=3.0),
                save_random_drafter(root / "drafter", drafter_config(cfg, taps=(0, 2, 3)), seed=2))
    if name == "gemma4":
        return (save_gemma_target(root / "target", "moe", seed=3),
                save_random_drafter(root / "drafter", gemma_drafter_config(block_size=8), seed=2))
    return save_family(name, root)  # qwen3_5_moe, qwen3_next


FAMILIES = ("qwen3_moe", "gemma4", "qwen3_5_moe", "qwen3_next")
SHARED_EXPERT = {"qwen3_5_moe", "qwen3_next"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, tuple[Path, Path | None]] = {}

    def get(name: str) -> tuple[Path, Path | None]:
        if name not in made:
            made[name] = save_moe_family(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


def load(folders, name: str, quant: str | None, dtype: str = "bfloat16"):
    pair = load_pair(*folders(name), device="cpu", dtype=dtype, quant=quant)
    assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    return pair


def owners(model: nn.Module) -> list[nn.Module]:
    """The modules holding a mixture's experts (Qwen's sparse MoE blocks, Gemma 4's decoder layers)."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def held_bytes(layer: nn.Module) -> int:
    """The bytes a q4/q8 layer's kernels read: its codes and scales."""
    return sum(t.numel() * t.element_size() for t in vars(layer).values() if isinstance(t, torch.Tensor))


def prompts(n: int, seed: int, shortest: int = 10, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)  # longer than Gemma's sliding window (8)
    return [[rng.randrange(3, 140) for _ in range(rng.randrange(shortest, longest))] for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_every_expert_is_quantized_on_the_q4_loading_path(folders, family, kind):
    pair = load_pair(*folders(family), device="cpu", dtype="bfloat16", quant=kind)
    model = pair.target.model
    layers = owners(model)
    assert layers and all(m.experts.gate_up_proj.dim() == 3 for m in layers)  # transformers' fused experts
    before = param_bytes(model)
    dense = sum(m.experts.gate_up_proj.nbytes + m.experts.down_proj.nbytes for m in layers)
    assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    fast = pair.target.fast
    assert fast.quantized_experts == len(layers)
    for m in layers:
        experts = m.experts
        assert isinstance(experts, WeightOnlyExperts) and experts.kind == kind
        assert len(experts.gate_up) == len(experts.down) == experts.num_experts > 2
        assert all(type(layer) is LINEAR[kind] for layer in [*experts.gate_up, *experts.down])
    assert not [name for name, _ in model.named_parameters() if ".experts." in name]  # no 16-bit expert left
    assert param_bytes(model) == before - dense - fast.freed_bytes  # freed, and the dense linears quantized too
    codes = sum(held_bytes(layer) for m in layers for layer in [*m.experts.gate_up, *m.experts.down])
    assert codes < dense * (0.35 if kind == "q4" else 0.6)  # 4/8 bits and their scales, against 16
    if family in SHARED_EXPERT:  # the shared expert as the dense MLPs: gate|up and down
        moe = [p for p in fast.projections if "shared_gate_up" in p]
        assert len(moe) == len(layers)
        assert all(type(p["shared_gate_up"]) is LINEAR[kind] and type(p["shared_down"]) is LINEAR[kind] for p in moe)
    # quantizing again finds them done; the dense linears the fast path quantized are freed too, so a second
    # fast path or transformers' forward refuses rather than computes with nothing
    assert quantize_experts(model, kind) == len(layers)
    assert fast.freed_bytes > 0 and fast_path_unsupported(model).startswith("its dense weights were freed")
    if not pair.target.hybrid:
        with torch.inference_mode(), pytest.raises(RuntimeError):
            model(torch.tensor([[5, 6, 7]]))


@pytest.mark.parametrize("family, kind", [(f, "q4") for f in FAMILIES] + [("qwen3_moe", "q8"), ("wide", "q4"),
                                                                       ("wide", "q8")])
def test_a_block_forward_gives_each_row_the_bits_of_its_1_token_forward(folders, family, kind):
    """Logits of an 8-token block against 1-token forwards at the same positions, bit for bit. On the wide
    target, 16-bit experts (transformers' modules, the rest q4) failed this on an AVX-512 machine."""
    target = load_target(folders(family)[0], device="cpu", dtype="bfloat16", quant=kind)
    assert target.enable_fast_path(400, pad_to=8) is None
    fast = target.fast
    assert fast.row_exact and fast.quantized_experts > 0
    cache = fast.new_cache()
    for prompt in prompts(2, seed=5):
        cache.crop(0)
        fast.forward(torch.tensor([prompt]), cache, 0, taps=False, last_logit_only=True)
        start = len(prompt)
        block = torch.tensor([prompts(1, seed=start, shortest=8, longest=9)[0]])
        together, _ = fast.forward(block, cache, start, taps=True, last_logit_only=False)
        for i in range(block.shape[1]):
            cache.crop(start + i)
            alone, _ = fast.forward(block[:, i:i + 1], cache, start + i, taps=True, last_logit_only=False)
            assert torch.equal(alone[0], together[i]), (family, i)


def test_a_verify_routes_each_token_on_its_own_and_a_prompt_all_at_once(folders):
    pair = load(folders, "qwen3_moe", "q4")
    seen: list[int] = []
    hooks = [m.gate.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
             for m in owners(pair.target.model)]
    try:
        fast = pair.target.fast
        cache = fast.new_cache()
        fast.forward(torch.arange(3, 103)[None], cache, 0, taps=False, last_logit_only=True)
        assert seen == [100] * 3  # a prompt (over 64 tokens): all its rows at once, in each of 3 MoE layers
        seen.clear()
        fast.forward(torch.tensor([[5, 6, 7, 8, 9]]), cache, 100, taps=True, last_logit_only=False)
        assert seen == [1] * 15  # a verify: each token alone (a 16-bit matmul may round by row count)
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("family, kind", [(f, "q4") for f in FAMILIES] + [("qwen3_moe", "q8")])
def test_greedy_speculative_equals_greedy_plain_decoding_of_the_same_quantized_target(folders, family, kind):
    assert_speculative_equals_plain(load(folders, family, kind), prompts, (3, 8), max_new_tokens=24)


def experts_module(hidden: int, inter: int, experts: int, seed: int = 0) -> nn.Module:
    """transformers' Qwen3-MoE experts with random bf16 weights."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**qwen3_moe_config(hidden_size=hidden, moe_intermediate_size=inter,
                                                  num_experts=experts))
    cfg._experts_implementation = "eager"
    module = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.05)
        module.down_proj.normal_(0, 0.05)
    return module.to(torch.bfloat16)


def routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).softmax(-1).to(torch.bfloat16)
    return index, weights


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_quantized_experts_are_close_to_the_16bit_ones_and_row_exact(kind):
    hidden, inter, n_experts, k, tokens = 256, 128, 16, 4, 16
    dense = experts_module(hidden, inter, n_experts)
    quantized = WeightOnlyExperts.quantize(dense, kind)
    assert quantized is not None
    torch.manual_seed(1)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    index, weights = routing(tokens, n_experts, k, seed=2)
    with torch.inference_mode():
        together = quantized(x, index, weights)
        for t in range(tokens):  # each token alone: the same bits
            assert torch.equal(quantized(x[t:t + 1], index[t:t + 1], weights[t:t + 1]), together[t:t + 1])
        # the same experts from their dequantized weights, in fp32: within the bf16 roundings of the kernels
        first = [kernel_weight(quantized.gate_up[e], dense.gate_up_proj[e]) for e in range(n_experts)]
        second = [kernel_weight(quantized.down[e], dense.down_proj[e]) for e in range(n_experts)]
        reference = torch.zeros(tokens, hidden)
        for t in range(tokens):
            for j in range(k):
                e = int(index[t, j])
                gate, up = (x[t:t + 1].float() @ first[e].T).chunk(2, -1)
                act = (dense.act_fn(gate) * up).to(torch.bfloat16).float()  # the kernels read bf16
                reference[t] += float(weights[t, j]) * (act @ second[e].T)[0]
        torch.testing.assert_close(together.float(), reference, rtol=0.02, atol=2e-3)
        # and the 16-bit experts themselves, within what 4 (8) bits cost
        original = dense(x, index, weights).float()
    error = (together.float() - original).norm() / original.norm()
    assert error < (0.2 if kind == "q4" else 0.03), error  # measured 0.145 and 0.013: random gaussian weights


def kernel_weight(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The (out, in) fp32 weight a q4/q8 layer made of `weight` computes with."""
    if isinstance(layer, Q4Linear):  # quantize_q4 is deterministic: the layer's own codes, scales and zeros
        return quantize_q4(weight).dequantize()
    assert isinstance(layer, Q8Linear)
    return layer.weight_int8.float() * layer.scales.float()[:, None]


def test_each_row_calls_one_row_at_a_time_and_keeps_tuples():
    calls: list[int] = []

    def router(rows: torch.Tensor):
        calls.append(rows.shape[0])
        return rows * 2, rows.sum(-1, keepdim=True)

    rows = torch.arange(12.0).reshape(4, 3)
    doubled, sums = each_row(router, rows)
    assert calls == [1, 1, 1, 1]
    assert torch.equal(doubled, rows * 2) and torch.equal(sums, rows.sum(-1, keepdim=True))


def test_what_q4_cannot_take_stays_16bit():
    assert WeightOnlyExperts.quantize(experts_module(48, 32, 4), "q4") is None  # 48 inputs: not groups of 32
    assert WeightOnlyExperts.quantize(experts_module(64, 24, 4), "q4") is None  # down's 24 inputs
    assert WeightOnlyExperts.quantize(experts_module(48, 24, 4), "q8") is not None  # per row: any width
    assert WeightOnlyExperts.quantize(nn.Linear(4, 4), "q4") is None


def test_experts_q4_cannot_take_become_q8_and_keep_rows_exact():
    """48 inputs are not groups of 32: under q4 such experts become q8 (any width), not 16-bit, so a token's
    output is still the same bits whatever else is in the call."""
    from dflash_cli.engine.moe import WeightOnlyExperts, quantize_experts

    owner = nn.Module()
    owner.experts = experts_module(48, 32, 4, seed=2)
    assert quantize_experts(owner, "q4") == 1
    assert isinstance(owner.experts, WeightOnlyExperts) and owner.experts.kind == "q8"
    torch.manual_seed(0)
    x = torch.randn(12, 48, dtype=torch.bfloat16)
    index = torch.randint(0, 4, (12, 2))
    weights = torch.rand(12, 2)
    together = owner.experts(x, index, weights)
    alone = torch.cat([owner.experts(x[i:i + 1], index[i:i + 1], weights[i:i + 1]) for i in range(12)])
    assert torch.equal(together, alone)


def test_the_planner_counts_the_16_bit_load_peak_and_notes_the_experts_once_loaded():
    """Loading holds the experts at 16 bits before the fast path quantizes them (a checkpoint of one tensor per
    expert is merged into new tensors), so the memory check counts that peak; the note gives the 4/8-bit size
    they keep once loaded, only for the model types whose experts the fast path quantizes."""
    from dflash_cli.models.memory.sizes import target_weight_bytes

    config = read_json(HF_CONFIGS / "Qwen__Qwen3-Coder-30B-A3B-Instruct" / "config.json")
    e, inter, h, layers = 128, 768, 2048, 48
    weights = layers * e * 3 * inter * h
    rows = layers * e * (2 * inter + h)  # gate|up rows and down rows: q8 keeps a bf16 scale per row
    for quant, codes in (("q4", weights // 2 + 4 * (weights // 32)), ("q8", weights + 2 * rows)):
        estimate = target_weight_bytes(config, quant)
        assert estimate.components["experts"] == 2 * weights
        assert f"{quant} keeps them in {codes / 2**30:.1f} GiB once loaded" in " ".join(estimate.notes)
    other = dict(config, model_type="qwen2_moe")  # a mixture the fast path leaves to transformers
    assert "experts stay 16-bit under q4" in " ".join(target_weight_bytes(other, "q4").notes)
    assert target_weight_bytes(config, "bf16").components["experts"] == 2 * weights


def test_qwen3_moe_on_the_fast_path_equals_transformers_in_fp32(folders):
    """Qwen3-MoE takes the fast path (its experts as transformers' module): fp32 greedy speculation equals
    transformers' own greedy generate."""
    pair = load(folders, "qwen3_moe", None, dtype="float32")
    assert pair.target.fast.quantized_experts == 0
    for prompt in prompts(3, seed=7):
        reference = hf_greedy(pair.target, prompt, 24)
        oracle = OracleDrafter(pair.drafter, prompt + reference + [0] * 20, acceptance=0.8, seed=1,
                               vocab_size=VOCAB)
        assert generate(pair.target, oracle, prompt, max_new_tokens=24, stop_ids=[]).tokens == reference
        assert generate(pair.target, None, prompt, max_new_tokens=24, stop_ids=[]).tokens == reference
