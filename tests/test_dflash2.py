"""DFlash 2 drafters: convolutions and selector against the equations, strict loading, lossless decoding."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import (
    dflash2_config,
    random_drafter,
    repeating_dflash2_drafter,
    save_random_drafter,
    save_target,
    target_config,
)
from safetensors.torch import load_file, save_file
from support.hf_configs import DATA

from dflash_cli.engine.dflash2 import CandidateSelector, DFlash2Drafter, DynamicConv
from dflash_cli.engine.drafter import DrafterConfig, block_mask
from dflash_cli.engine.errors import CheckpointError, IncompatiblePairError
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_drafter, load_pair, save_drafter
from dflash_cli.engine.sampling import Sampler

FIXTURE = DATA / "z-lab__dflash2-muse-glimmer-fixture"


# ---------------------------------------------------------------- the equations, written out

def reference_conv(x, dyn, base, group):
    """out[t, c] = sum_o (base[o, c] + dyn[t, o, c // G]) * x[t - o, c], x[t < 0] = 0 (one block, no batch)."""
    B, H = x.shape
    K = base.shape[0]
    out = torch.zeros(B, H, dtype=torch.float64)
    for t in range(B):
        for o in range(K):
            if t - o < 0:
                continue
            for c in range(H):
                out[t, c] += (base[o, c] + dyn[t, o, c // group]) * x[t - o, c]
    return out


def reference_prepare(conv, x):
    """d = kernel_projection(x) read as (2, K, H/G) per position; conv with d[0] and base[0], keep d[1]."""
    K, G = conv.kernel, conv.group
    n_groups = x.shape[-1] // G
    proj = (conv.kernel_projection.weight.double() @ x.double().T).T  # (B, 2*K*n_groups)
    d = torch.zeros(x.shape[0], 2, K, n_groups, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(2):
            for o in range(K):
                for g in range(n_groups):
                    d[t, s, o, g] = proj[t, (s * K + o) * n_groups + g]
    base = conv.base_kernel.double()
    return reference_conv(x.double(), d[:, 0], base[0], G), d[:, 1]


def reference_walk(sel, logits, hidden, anchor, temperature=0.0, noise=None):
    """The selector's left-to-right walk with explicit sums; sampling takes argmax(log q_j + noise[p][cand_j])."""
    k = sel.top_k
    pred, succ = sel.predecessor_codebook.double(), sel.successor_codebook.double()
    hp = (sel.hidden_projection.weight.double() @ hidden.double().T).T  # (P, R)
    prev, out = int(anchor), []
    for p in range(logits.shape[0]):
        unary, cand = logits[p].double().topk(k)
        scores = []
        for j in range(k):
            pair = sum(pred[prev, r] * hp[p, r] * succ[cand[j], r] for r in range(hp.shape[1]))
            scores.append(unary[j] + pair)
        scores = torch.stack(scores)
        if temperature > 0:
            log_q = torch.log_softmax(scores / temperature, 0)
            scores = log_q + noise[p][cand].double()
        prev = int(cand[int(scores.argmax())])
        out.append(prev)
    return out


@pytest.mark.parametrize("kernel", [2, 3])
def test_convolution_matches_the_equations(kernel):
    torch.manual_seed(0)
    conv = DynamicConv(64, kernel, 16)
    with torch.no_grad():
        conv.base_kernel.uniform_(-1, 1)
        x, y = torch.randn(1, 7, 64), torch.randn(1, 7, 64)
        got, dyn = conv.prepare(x)
        finished = conv.finish(y, dyn)
    want, want_dyn = reference_prepare(conv, x[0])
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(finished[0].double(),
                               reference_conv(y[0].double(), want_dyn, conv.base_kernel[1].double(), 16),
                               rtol=1e-5, atol=1e-5)


def test_selector_walk_matches_the_equations():
    torch.manual_seed(1)
    V, H, R, k, P = 512, 64, 8, 6, 7
    sel = CandidateSelector(H, V, R, k)
    with torch.no_grad():
        sel.predecessor_codebook.normal_()
        sel.successor_codebook.normal_()
    for trial in range(5):
        logits, hidden = torch.randn(P, V) * 2, torch.randn(P, H)
        anchor = torch.tensor([trial * 37 % V])
        got = sel.walk(logits, hidden, anchor, start=10)
        assert got.tolist() == reference_walk(sel, logits, hidden, anchor[0])
        sampler = Sampler(temperature=0.7, seed=trial)
        noise = sampler.gumbel(11, P, V, torch.device("cpu"))
        got = sel.walk(logits, hidden, anchor, start=10, sampler=sampler)
        assert got.tolist() == reference_walk(sel, logits, hidden, anchor[0], 0.7, noise)


def test_sampled_walk_draws_from_the_selector_distribution():
    """Over seeds, the first draft follows q = softmax(score / T) over the k candidates (and nothing else)."""
    torch.manual_seed(2)
    V, H, R, k = 64, 16, 4, 5
    sel = CandidateSelector(H, V, R, k)
    with torch.no_grad():
        sel.predecessor_codebook.normal_()
        sel.successor_codebook.normal_()
    logits, hidden, anchor, T = torch.randn(1, V), torch.randn(1, H), torch.tensor([3]), 1.3
    unary, cand = logits[0].double().topk(k)
    hp = sel.hidden_projection.weight.double() @ hidden[0].double()
    pair = (sel.predecessor_codebook.double()[3] * hp * sel.successor_codebook.double()[cand]).sum(-1)
    q = torch.softmax((unary + pair) / T, 0)
    n = 3000
    counts = Counter(sel.walk(logits, hidden, anchor, 0, Sampler(temperature=T, seed=s)).item() for s in range(n))
    assert set(counts) <= set(cand.tolist())
    observed = torch.tensor([counts[int(c)] for c in cand], dtype=torch.float64)
    stat = ((observed - n * q) ** 2 / (n * q)).sum()
    p_value = torch.special.gammaincc(torch.tensor((k - 1) / 2, dtype=torch.float64), stat / 2).item()
    assert p_value > 1e-3


def test_layers_wrap_each_sublayer_in_its_convolution():
    """A whole DFlash 2 forward against v1 attention/MLP modules composed with the reference convolution."""
    cfg = dflash2_config(target_config(), layers=2, taps=(1, 3))
    model = random_drafter(cfg, seed=3).double()
    model.init_rotary(torch.device("cpu"))
    torch.manual_seed(4)
    T, B = 9, 6
    context, block = torch.randn(1, T, 128, dtype=torch.float64), torch.randn(1, B, 64, dtype=torch.float64)
    with torch.no_grad():
        got = model(context, block, T, model.new_cache())[0]
        ctx = model.hidden_norm(model.fc(context))
        cos, sin = model.rotary(block, torch.arange(T + B)[None])
        h, cache = block, model.new_cache()
        mask = block_mask(T, B, T + B, causal=False, window=6, device=torch.device("cpu"))  # test_drafter checks it
        for layer in model.layers:
            x, dyn = reference_prepare(layer.attention_conv, layer.input_layernorm(h)[0])
            y = layer.self_attn(x[None], ctx, cos, sin, cache, layer.index, mask)[0]
            h = h + reference_conv(y, dyn, layer.attention_conv.base_kernel[1], 16)[None]
            x, dyn = reference_prepare(layer.mlp_conv, layer.post_attention_layernorm(h)[0])
            h = h + reference_conv(layer.mlp(x), dyn, layer.mlp_conv.base_kernel[1], 16)[None]
        want = model.norm(h)[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_draft_logits_are_scaled_then_softcapped():
    cfg = DrafterConfig.from_dict(dflash2_config(target_config()))
    model = DFlash2Drafter(cfg)
    x = torch.tensor([-100.0, -1.0, 0.0, 3.0, 100.0])
    expected = torch.tanh(x * 0.5 / 20.0) * 20.0
    torch.testing.assert_close(model.postprocess_logits(x), expected)


# ---------------------------------------------------------------- the published shapes, strict loading

def test_module_tensors_are_exactly_the_published_header():
    """The real fixture's config, built on the meta device: same names (codebooks without .weight), same shapes."""
    header = json.loads((FIXTURE / "safetensors-header.json").read_text())
    header.pop("__metadata__", None)
    cfg = DrafterConfig.from_dict(json.loads((FIXTURE / "config.json").read_text()))
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 256, 16)
    assert cfg.final_logit_softcapping == 20.0 and cfg.is_causal is False and cfg.block_size == 16
    with torch.device("meta"):
        model = DFlash2Drafter(cfg)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == {k: v["shape"] for k, v in header.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dflash2")
    return save_random_drafter(root / "drafter", dflash2_config(target_config()), seed=5)


def edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_loads_strictly_and_round_trips(saved):
    drafter = load_drafter(saved, device="cpu", dtype="float32")
    assert isinstance(drafter, DFlash2Drafter)
    tensors = load_file(str(saved / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in tensors
    assert set(tensors) == set(drafter.state_dict())
    for name, tensor in tensors.items():
        assert torch.equal(drafter.state_dict()[name], tensor), name


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("candidate_selector.successor_codebook"),
     r"missing tensor 'candidate_selector\.successor_codebook'"),
    (lambda t: t.__setitem__("candidate_selector.predecessor_codebook.weight",
                             t.pop("candidate_selector.predecessor_codebook")),
     r"unexpected tensor 'candidate_selector\.predecessor_codebook\.weight'"),
    (lambda t: t.__setitem__("layers.1.mlp_conv.kernel_projection.weight", torch.zeros(8, 64)),
     r"'layers\.1\.mlp_conv\.kernel_projection\.weight' has shape \[8, 64\], the config implies \[16, 64\]"),
    (lambda t: t.pop("layers.0.attention_conv.base_kernel"),
     r"missing tensor 'layers\.0\.attention_conv\.base_kernel'"),
    (lambda t: t.__setitem__("lm_head.weight", torch.zeros(2, 2)), r"unexpected tensor 'lm_head\.weight'"),
])
def test_bad_tensors_are_named(saved, tmp_path, edit, message):
    folder = edited(saved, tmp_path / "d", edit)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(folder, device="cpu")


def test_missing_dflash2_field_is_named(saved, tmp_path):
    folder = shutil.copytree(saved, tmp_path / "d")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["dflash_config"]["selector_top_k"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="selector_top_k"):
        load_drafter(folder, device="cpu")


def test_codebooks_must_cover_the_target_vocabulary(tmp_path):
    cfg = target_config()
    target = save_target(tmp_path / "t", cfg)
    drafter = save_random_drafter(tmp_path / "d", dflash2_config(cfg, vocab_size=cfg["vocab_size"] + 8))
    with pytest.raises(IncompatiblePairError, match="codebooks for 168 tokens"):
        load_pair(target, drafter, device="cpu", dtype="float32")


# ---------------------------------------------------------------- decoding

SMALL_VOCAB = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target whose greedy output repeats tokens, and a random DFlash 2 drafter whose selector
    codebooks say "repeat the previous token" (pred = I, succ = 10 I; the sign of hp decides per slot),
    so drafts are often right and the loop's accept, partial-accept and reject paths all run."""
    root = tmp_path_factory.mktemp("dflash2-pair")
    cfg = target_config(vocab_size=SMALL_VOCAB)
    target = save_target(root / "t", cfg, seed=1, scale=3.0)
    dcfg = dflash2_config(cfg, top_k=SMALL_VOCAB)
    dcfg["dflash_config"].update(mask_token_id=SMALL_VOCAB - 1, selector_rank=SMALL_VOCAB)
    model = repeating_dflash2_drafter(dcfg, SMALL_VOCAB, seed=2, weight=10)
    return load_pair(target, save_drafter(model, root / "d"), device="cpu", dtype="float32")


@pytest.fixture(params=["transformers forward", "fast path"])
def either_path(request, pair):
    if request.param == "fast path":
        assert pair.target.enable_fast_path(128, pad_to=pair.drafter.block_size) is None
    yield pair
    pair.target.disable_fast_path()


PROMPTS = [[3, 5, 7], [1, 2, 3, 4, 5, 6, 7, 1, 2], [6], [4, 4, 4, 4, 0, 2]]


def test_greedy_is_token_identical_to_plain_decoding(either_path):
    pair = either_path
    accepted, partial = 0, 0
    for prompt in PROMPTS:
        plain = generate(pair.target, None, prompt, max_new_tokens=40, stop_ids=[]).tokens
        for block in (8, 5, 2):
            out = generate(pair.target, pair.drafter, prompt, max_new_tokens=40, block_size=block, stop_ids=[])
            assert out.tokens == plain, (prompt, block)
            accepted += out.stats.accepted
            partial += sum(out.stats.committed_histogram[2:block])
        out = generate(pair.target, pair.drafter, prompt, max_new_tokens=40, stop_ids=[plain[17]])
        assert out.tokens == plain[: plain.index(plain[17]) + 1]  # a stop inside a block
    assert accepted > 20 and partial > 5  # drafts were accepted, blocks were cut short


def test_sampled_runs_equal_plain_decoding_with_the_same_seed(pair):
    kwargs = dict(max_new_tokens=40, stop_ids=[], temperature=1.0, top_p=0.95)
    accepted = 0
    for seed in range(4):
        plain = generate(pair.target, None, PROMPTS[1], seed=seed, **kwargs).tokens
        out = generate(pair.target, pair.drafter, PROMPTS[1], seed=seed, adaptive=False, **kwargs)
        assert out.tokens == plain
        accepted += out.stats.accepted
    assert accepted > 0


def test_published_config_scaled_down_loads_pairs_and_decodes_losslessly(tmp_path):
    """The fixture's config (52-layer target, 202,048-token vocabulary, 5 bidirectional sliding layers,
    softcap, output multiplier) at hidden size 64, against a dense stand-in target of that depth and vocabulary."""
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               sliding_window=6)
    cfg["dflash_config"]["selector_rank"] = 8
    drafter = save_random_drafter(tmp_path / "d", cfg, seed=7)
    target_cfg = target_config(vocab_size=202048, num_hidden_layers=52, hidden_size=64, head_dim=16)
    target = save_target(tmp_path / "t", target_cfg, seed=8, scale=3.0)
    pair = load_pair(target, drafter, device="cpu", dtype="float32")
    assert isinstance(pair.drafter, DFlash2Drafter) and pair.target._taps == [1, 13, 25, 37, 49]
    assert pair.drafter.block_size == 16 and pair.drafter.mask_token_id == 201818
    assert all(not layer.causal and layer.window == 6 for layer in pair.drafter.layers)
    prompt = list(range(200, 230))
    plain = generate(pair.target, None, prompt, max_new_tokens=24, stop_ids=[]).tokens
    for block in (16, 5):
        got = generate(pair.target, pair.drafter, prompt, max_new_tokens=24, block_size=block, stop_ids=[])
        assert got.tokens == plain and got.stats.drafted > 0
