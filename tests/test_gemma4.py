"""Gemma 4 targets (the 31B dense and the 26B-A4B mixture of experts) on the engine and its fast path.

Tiny random models scaled down from the published configs (shared/data/hf-configs: google's 26B-A4B file and
NVIDIA's same-shape stand-in for the 31B), vision tower included and saved as the multimodal checkpoints are,
so the loader takes their language model alone. Both have sliding-window layers (a window of 8, shorter than
every prompt) and global layers with their own shapes (fewer, wider K/V heads, values from the key
projection, proportional partial rotary), sandwich norms, layer scalars and soft-capped logits; norms and
scalars are random so that one applied in the wrong place shows. The drafters have the published layout
(4 sliding layers + 1 full). In fp32, greedy speculation must equal transformers' own greedy generate token
for token, on the fast path (full-length buffers, and a sliding-window ring) and on transformers' path.
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
from conftest import HF_CONFIGS, VOCAB, TargetForwardLog, drafter_config, read_json, save_random_drafter
from support.gemma_models import LAYERS, PUBLISHED, WINDOW, gemma_config, gemma_drafter_config, save_gemma_target
from support.speculation import hf_greedy

from dflash_cli.engine.fast import FastPath
from dflash_cli.engine.fast_layers import fast_path_unsupported
from dflash_cli.engine.generate import generate, stream_generate
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.state import DecodeState


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    target = save_gemma_target(root / "target", request.param, seed=3)
    drafter = save_random_drafter(root / "drafter", gemma_drafter_config(), seed=2)
    pair = load_pair(target, drafter, device="cpu", dtype="float32")
    assert pair.target.enable_fast_path(400, pad_to=16) is None
    assert pair.target.fast.ring is None  # a short context: full-length buffers
    return pair


def prompts(n, seed, shortest=WINDOW + 2, longest=60):
    rng = random.Random(seed)
    return [[rng.randrange(3, 140) for _ in range(rng.randrange(shortest, longest))] for _ in range(n)]


def oracle(pair, prompt, acceptance, seed=1, n=60):
    return OracleDrafter(pair.drafter, prompt + hf_greedy(pair.target, prompt, n), acceptance=acceptance,
                         seed=seed, vocab_size=VOCAB)


@contextlib.contextmanager
def transformers_path(pair):
    """The pair with the fast path switched off (transformers' forward and cache), then on again."""
    fast, pair.target.fast = pair.target.fast, None
    try:
        yield pair
    finally:
        pair.target.fast = fast


def on_path(pair, path: str):
    return transformers_path(pair) if path == "transformers" else contextlib.nullcontext(pair)


def test_the_multimodal_checkpoint_loads_its_text_model_only(pair):
    model = pair.target.model
    assert type(model).__name__ == "Gemma4ForCausalLM" and model.config.model_type == "gemma4_text"
    assert not any("vision" in name for name, _ in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings
    assert pair.target.num_layers == len(LAYERS) and pair.target._taps == [1, 2, 4]
    # the drafter embeds its block as the target's embedding module does: rows times sqrt(hidden)
    assert float(pair.drafter.embed_scale) == math.sqrt(64)
    ids = torch.tensor([3, 4, pair.drafter.mask_token_id])
    torch.testing.assert_close(model.get_input_embeddings()(ids),
                               pair.target.embed_weight[ids] * pair.drafter.embed_scale, rtol=0, atol=0)


def test_fast_forward_equals_transformers_forward(pair):
    """Logits (soft-capped) and tapped states of a prompt longer than the window, then of a block after it,
    against transformers' forward over the whole sequence (hidden_states[l + 1]; the last after the final
    norm)."""
    target = pair.target
    seq = prompts(1, seed=5, shortest=40, longest=41)[0]
    state = DecodeState(target, None, own_caches=True)
    with torch.inference_mode():
        first, taps1 = target.fast.forward(torch.tensor([seq[:30]]), state.target_cache, 0, taps=True,
                                           last_logit_only=False)
        second, taps2 = target.fast.forward(torch.tensor([seq[30:]]), state.target_cache, 30, taps=True,
                                            last_logit_only=False)
        ref = target.model(torch.tensor([seq]), output_hidden_states=True)
    torch.testing.assert_close(torch.cat([first, second]), ref.logits[0], rtol=1e-4, atol=1e-4)
    assert ref.logits.abs().max() < 10.0  # capped (the cap is 10 here)
    want = torch.cat([ref.hidden_states[i + 1] for i in target._taps], dim=-1)
    torch.testing.assert_close(torch.cat([taps1, taps2], dim=1), want, rtol=1e-4, atol=1e-4)
    with transformers_path(pair):  # its hooks tap the same states
        _, hooked = target.forward(torch.tensor([seq]), target.new_cache(), 0, taps=True)
    torch.testing.assert_close(hooked, want, rtol=1e-5, atol=1e-5)
    # the first and the last layer (a global one; transformers' last hidden state is after the final norm)
    target.fast.set_taps([0, len(LAYERS) - 1])
    try:
        with torch.inference_mode():
            _, ends = target.fast.forward(torch.tensor([seq]), state.target_cache, 0, taps=True,
                                          last_logit_only=True)
    finally:
        target.fast.set_taps(target._taps)
    want = torch.cat([ref.hidden_states[1], ref.hidden_states[len(LAYERS)]], dim=-1)
    torch.testing.assert_close(ends, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [3, 8, 16])
def test_greedy_speculation_equals_transformers_generate(pair, block_size):
    for prompt in prompts(2, seed=3):  # the same prompts at every block size: their references are computed once
        reference = hf_greedy(pair.target, prompt, 30)
        assert generate(pair.target, None, prompt, max_new_tokens=30, stop_ids=[]).tokens == reference
        got = generate(pair.target, pair.drafter, prompt, max_new_tokens=30, stop_ids=[], block_size=block_size,
                       adaptive=False)
        assert got.tokens == reference
        for acceptance in (0.5, 0.8):  # partial acceptances: every step rolls the caches back
            got = generate(pair.target, oracle(pair, prompt, acceptance), prompt, max_new_tokens=30, stop_ids=[],
                           block_size=block_size, adaptive=False)
            assert got.tokens == reference
            assert 1.2 < got.stats.acceptance_length < block_size


def test_state_invariants_after_every_step(pair):
    prompt = prompts(1, seed=7)[0]
    drafter = oracle(pair, prompt, 0.7, seed=4)
    state = DecodeState(pair.target, drafter)
    accepted, tokens = [], []
    for step in stream_generate(pair.target, drafter, prompt, max_new_tokens=40, stop_ids=[], block_size=8,
                                state=state, adaptive=False):
        state.check()
        accepted.append(step.accepted)
        tokens.extend(step.tokens)
    assert tokens == hf_greedy(pair.target, prompt, 40)
    assert any(0 < a < 7 for a in accepted)  # some steps rejected part of their block


@pytest.mark.parametrize("path", ["fast", "transformers"])
def test_stop_token_inside_an_accepted_block(pair, path):
    prompt = prompts(1, seed=11)[0]
    reference = hf_greedy(pair.target, prompt, 40)
    stop = next(t for i, t in enumerate(reference) if i >= 10 and t not in reference[:i])
    drafter = oracle(pair, prompt, 1.0)
    with on_path(pair, path):
        state = DecodeState(pair.target, drafter)
        got = generate(pair.target, drafter, prompt, max_new_tokens=40, stop_ids=[stop], block_size=16,
                       state=state, adaptive=False)
        assert got.tokens == reference[: reference.index(stop) + 1]
        assert got.stats.steps < len(got.tokens)  # the stop fell inside a block of several tokens
        state.check()
        more = generate(pair.target, drafter, state.tokens, max_new_tokens=10, stop_ids=[], state=state,
                        block_size=16)
        state.check()
        assert got.tokens + more.tokens == hf_greedy(pair.target, prompt, len(got.tokens) + 10)


@pytest.mark.parametrize("path", ["fast", "transformers"])
def test_chat_turns_reuse_the_state(pair, path):
    turn1 = prompts(1, seed=13)[0]
    with on_path(pair, path):
        state = DecodeState(pair.target, pair.drafter)
        first = generate(pair.target, pair.drafter, turn1, max_new_tokens=15, stop_ids=[], state=state)
        turn2 = turn1 + first.tokens + [33, 44, 55]
        turn3 = turn1[:3] + [99] + turn1[4:]  # an edited history
        reference2, reference3 = hf_greedy(pair.target, turn2, 15), hf_greedy(pair.target, turn3, 8)
        with TargetForwardLog(pair.target) as log:
            second = generate(pair.target, pair.drafter, turn2, max_new_tokens=15, stop_ids=[], state=state)
            state.check()
            assert log.take()[0] == 4  # the new tokens and the last reply token: the caches were reused
            assert second.tokens == reference2
            third = generate(pair.target, pair.drafter, turn3, max_new_tokens=8, stop_ids=[], state=state)
            state.check()
            # back to the edit (the fast path's buffers hold every position); transformers' own cache keeps only
            # the last window of a sliding layer, so it reads from the edit or from the start, as the block sizes
            # the controller chose left that window, never from past the edit
            read = log.take()[0]
            assert read == len(turn3) - 3 if path == "fast" else read in (len(turn3) - 3, len(turn3))
            assert third.tokens == reference3


def test_greedy_speculation_on_the_transformers_path(pair):
    with transformers_path(pair):
        for prompt in prompts(2, seed=17):
            reference = hf_greedy(pair.target, prompt, 30)
            assert generate(pair.target, None, prompt, max_new_tokens=30, stop_ids=[]).tokens == reference
            for block_size in (4, 16):
                got = generate(pair.target, oracle(pair, prompt, 0.6), prompt, max_new_tokens=30, stop_ids=[],
                               block_size=block_size, adaptive=False)
                assert got.tokens == reference and got.stats.acceptance_length > 1.2


def test_a_sliding_window_ring(pair):
    """A context longer than window + 2 * slack keeps the sliding layers' K/V in a ring of that many rows
    (slack 16 here, so 40 rows; 512 by default): prompts read in 16-token pieces, replies wrapping around
    the ring several times, rollbacks, and chat turns that go back within the slack or, further, read
    their prompt anew."""
    target = pair.target
    full = target.fast
    target.fast = FastPath(target.model, 400, pad_to=16, slack=16)
    target.fast.set_taps(target._taps)
    try:
        assert target.fast.ring == (WINDOW + 32, WINDOW)
        cache = target.fast.new_cache()
        rows = [k.shape[2] for k in cache.keys]
        assert rows == [40, 40, full.capacity, 40, 40, full.capacity]  # global layers keep full length
        assert [tuple(k.shape[1:2]) + tuple(k.shape[3:]) for k in cache.keys][1:3] == [(2, 16), (1, 32)]
        prompt = prompts(1, seed=19, shortest=70, longest=71)[0]
        reference = hf_greedy(target, prompt, 60)
        assert generate(target, None, prompt, max_new_tokens=60, stop_ids=[]).tokens == reference
        for acceptance, block_size in ((0.6, 16), (0.8, 5)):
            drafter = oracle(pair, prompt, acceptance, seed=block_size)
            state = DecodeState(target, drafter)
            tokens = []
            for step in stream_generate(target, drafter, prompt, max_new_tokens=60, stop_ids=[],
                                        block_size=block_size, state=state, adaptive=False):
                state.check()
                tokens.extend(step.tokens)
            assert tokens == reference and step.stats.acceptance_length > 1.5
        state = DecodeState(target, pair.drafter)
        first = generate(target, pair.drafter, prompt, max_new_tokens=60, stop_ids=[], state=state)
        assert first.tokens == reference
        turn2 = prompt + reference + [33, 44]
        turn3 = prompt[:60] + [99]  # 70 positions back: further than the ring reaches
        reference2, reference3 = hf_greedy(target, turn2, 10), hf_greedy(target, turn3, 10)
        with TargetForwardLog(target) as log:
            again = generate(target, pair.drafter, turn2, max_new_tokens=10, stop_ids=[], state=state)
            assert log.take()[0] == 3 and again.tokens == reference2
            # regenerate: back to the prompt's last token, within the slack
            again = generate(target, pair.drafter, turn2, max_new_tokens=10, stop_ids=[], state=state)
            assert log.take()[0] == 1 and again.tokens == reference2
            third = generate(target, pair.drafter, turn3, max_new_tokens=10, stop_ids=[], state=state)
            assert log.take()[:4] == [16, 16, 16, 13] and third.tokens == reference3  # read again, in pieces
            state.check()
    finally:
        target.fast = full


def test_layers_on_two_devices(pair, monkeypatch):
    """Simulated (as test_device_map.py): layers 3-5 on a second CPU 'device', a ring too. Each device gets
    the per-call masks (one per layer kind), rotary tables and ring rows once; output unchanged."""
    import dflash_cli.engine.fast as fast

    second = torch.device("cpu", 1)
    target = pair.target
    on_second = {id(layer) for layer in target.layers[3:]}
    real_layer_device = fast.layer_device
    monkeypatch.setattr(fast, "layer_device",
                        lambda layer: second if id(layer) in on_second else real_layer_device(layer))
    full = target.fast
    target.fast = FastPath(target.model, 400, pad_to=8, slack=16)
    target.fast.set_taps(target._taps)
    try:
        assert target.fast.devices == [torch.device("cpu")] * 3 + [second] * 3 and target.fast.ring
        prompt = prompts(1, seed=29, shortest=50, longest=51)[0]
        reference = hf_greedy(target, prompt, 40)
        got = generate(target, oracle(pair, prompt, 0.6, seed=5), prompt, max_new_tokens=40, stop_ids=[],
                       block_size=8, adaptive=False)
        assert got.tokens == reference and got.stats.acceptance_length > 1.3
    finally:
        target.fast = full


def test_published_pairs_check_from_configs_only():
    from dflash_cli.engine.drafter import DrafterConfig
    from dflash_cli.engine.pairing import check_pair, check_target_config

    # the drafters' fields as SOURCES.md ("New pairs") lists them
    drafters = {"moe": dict(hidden_size=2816, intermediate_size=5632, num_attention_heads=32,
                            target_layer_ids=[1, 6, 11, 17, 22, 27], num_target_layers=30),
                "dense": dict(hidden_size=5376, intermediate_size=10752, num_attention_heads=64,
                              target_layer_ids=[1, 12, 23, 35, 46, 57], num_target_layers=60)}
    for kind, d in drafters.items():
        target = read_json(HF_CONFIGS / PUBLISHED[kind] / "config.json")
        check_target_config(target, PUBLISHED[kind])
        raw = drafter_config(dict(hidden_size=d["hidden_size"], vocab_size=262144,
                                  num_hidden_layers=d["num_target_layers"]), layers=5, block_size=16,
                             taps=d["target_layer_ids"], intermediate_size=d["intermediate_size"],
                             num_attention_heads=d["num_attention_heads"], num_key_value_heads=8, head_dim=128,
                             layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
                             use_sliding_window=True, final_logit_softcapping=30.0)
        raw["dflash_config"]["mask_token_id"] = 4
        assert check_pair(target, DrafterConfig.from_dict(raw)) == d["target_layer_ids"]


def test_gemma_extras_the_fast_path_does_not_run(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    text = gemma_config("dense")["text_config"]
    for extra, reason in ((dict(hidden_size_per_layer_input=8), "per-layer input"),
                          (dict(num_kv_shared_layers=3), "reuse another layer"),
                          (dict(use_bidirectional_attention="all"), "bidirectional")):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**dict(text, **extra)))
        assert reason in (fast_path_unsupported(model) or "")

def test_compiled_greedy_speculation_with_a_ring(tmp_path, tmp_path_factory):
    """The short forwards compiled by inductor (CPU, fullgraph: the MoE target's router and experts, the
    per-layer masks and rotary tables, the ring's slot map written inside the graph), the sliding layers in
    a ring (slack 16) that the reply wraps around. The reply ends on a stop token, never on the length
    limit, so every verify is a full block of 8 and one shape is compiled (each costs tens of seconds
    here); greedy output equals transformers' own greedy generate."""
    import os

    from dflash_cli.engine.compile import compiler_for

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    pair = load_pair(save_gemma_target(tmp_path / "target", "moe", seed=3),
                     save_random_drafter(tmp_path / "drafter", gemma_drafter_config(block_size=8), seed=2),
                     device="cpu", dtype="float32")
    notes: list[str] = []
    target = pair.target
    target.fast = FastPath(target.model, 400, pad_to=8, slack=16, compile_step=compiler_for(torch.device("cpu")),
                           on_fallback=notes.append)
    target.fast.set_taps(target._taps)
    assert target.fast.ring == (WINDOW + 32, WINDOW)
    prompt = prompts(1, seed=23, shortest=45, longest=46)[0]
    reference = hf_greedy(target, prompt, 60)
    # a stop token whose first occurrence leaves at least a full block of budget at every step before it
    end = next(i for i in range(52, 19, -1) if reference[i] not in reference[:i])
    got = generate(target, oracle(pair, prompt, 0.6, seed=3), prompt, max_new_tokens=60,
                   stop_ids=[reference[end]], block_size=8, adaptive=False)
    assert got.tokens == reference[: end + 1]
    assert 1.3 < got.stats.acceptance_length < 8  # partial acceptances rolled the caches back
    assert notes == [] and target.fast_compiled and list(target.fast._compiled) == [True]


def test_training_embeds_a_block_as_decoding_does():
    """A Gemma drafter trained here must see its block embedded as decoding embeds it (times the target's
    sqrt(hidden) scale), or what it learns does not match what it is given."""
    import torch.nn.functional as F
    from conftest import MASK_ID, random_drafter, target_config

    from dflash_cli.train.forward import block_embeddings

    drafter = random_drafter(drafter_config(target_config("qwen3")))
    embed = torch.randn(VOCAB, drafter.config.hidden_size)
    drafter.embed_scale = torch.tensor(8.0)
    ids = torch.arange(5, 25)[None]
    got = block_embeddings(drafter, ids, torch.tensor([[3]]), embed)[0]  # the block anchored at position 3
    want = F.embedding(torch.tensor([8] + [MASK_ID] * (drafter.block_size - 1)), embed) * 8.0
    torch.testing.assert_close(got, want)


def test_a_trained_drafter_caps_its_logits_as_its_target_does(pair):
    """`train` writes the target's logit soft-cap into the drafter's config: decoding then caps the drafts'
    logits, and training's loss head reads the same config field."""
    from conftest import MASK_ID, target_config
    from transformers import AutoConfig

    from dflash_cli.engine.hf_config import DrafterConfig
    from dflash_cli.train.shape import drafter_config as trained_config

    raw = trained_config(pair.target.model.config, layers=1, block_size=8, taps=[1, 3], mask_id=MASK_ID,
                         vocab_rows=VOCAB)
    assert DrafterConfig.from_dict(raw).final_logit_softcapping == 10.0  # gemma_config's cap
    qwen = trained_config(AutoConfig.for_model(**target_config("qwen3")), layers=1, block_size=8, taps=[1],
                          mask_id=MASK_ID, vocab_rows=VOCAB)
    assert DrafterConfig.from_dict(qwen).final_logit_softcapping is None


def test_train_distils_a_drafter_for_a_gemma_target(tmp_path):
    """`train` end to end on a tiny Gemma 4 (its data on transformers' generate, a distilled fit): the drafter
    it writes carries the soft-cap, loads beside its target and decodes losslessly."""
    from conftest import save_tiny_tokenizer

    from dflash_cli.train.api import train_drafter

    target = save_gemma_target(tmp_path / "target", "dense", seed=3)
    save_tiny_tokenizer(target)
    questions = [f"tell me about {w}" for w in "cats rain tea".split()]
    result = train_drafter(target, tmp_path / "drafter", prompts=questions, layers=1, block_size=4, steps=3,
                           batch=2, anchors=4, max_new_tokens=24, eval_every=3, distill=0.5, distill_topk=4,
                           device="cpu", dtype="float32")
    raw = read_json(result.folder / "config.json")
    assert raw["final_logit_softcapping"] == 10.0
    pair = load_pair(target, result.folder, device="cpu", dtype="float32")
    prompt = prompts(1, seed=5)[0]
    got = generate(pair.target, pair.drafter, prompt, max_new_tokens=20, stop_ids=[]).tokens
    assert got == hf_greedy(pair.target, prompt, 20)


def test_the_memory_planner_counts_the_ring_the_engine_allocates(pair):
    """Long contexts: global layers hold every row, sliding layers a ring of window + 2 * 512 rows."""
    from dflash_cli.models.memory.sizes import kv_cache_bytes

    fast = FastPath(pair.target.model, 2048, pad_to=16)
    assert fast.ring is not None
    cache = fast.new_cache()
    allocated = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert kv_cache_bytes(pair.target.model.config.to_dict(), fast.capacity, dtype_bytes=4) == allocated
