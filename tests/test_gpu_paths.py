"""What the CUDA path depends on, checked on the CPU: attention calls a fused kernel accepts, prompts read in
pieces, one cache per loaded model, and compiling only the shapes the loop runs. On a GPU
(DFLASH_TEST_DEVICE=cuda) the attention test also asks torch's own kernel-selection rules."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, TargetForwardLog, drafter_config, save_hybrid_target, save_random_drafter, target_config

from dflash_cli.engine import state as state_module
from dflash_cli.engine.drafter import DraftCache, grouped_attention
from dflash_cli.engine.errors import CacheTakenError
from dflash_cli.engine.generate import generate, stream_generate, warm_up
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.state import DecodeState, shared_draft_cache
from dflash_cli.engine.static_cache import StaticCache
from dflash_cli.train.forward import block_embeddings, training_forward


def random_prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 150) for _ in range(n)]


def load(folder_target, folder_drafter, *, fast_path: bool = True, compile_step=None, context: int = 400):
    pair = load_pair(folder_target, folder_drafter, device=DEVICE, dtype="float32")
    if fast_path:
        block = pair.drafter.block_size if pair.drafter is not None else 1
        assert pair.target.enable_fast_path(context, pad_to=block, compile_step=compile_step) is None
    return pair


# --- attention ----------------------------------------------------------------------------------------------


class AttentionCalls:
    """Records every scaled_dot_product_attention call (torch.nn.functional's, which the engine calls)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]] = []
        real = F.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            self.calls.append((q, k, v, attn_mask, enable_gqa))
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


def fused_kernel_accepts(q, k, v, mask, enable_gqa) -> bool:
    """torch's own rules on a GPU: flash for unmasked calls, memory-efficient for masked ones."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    params = SDPAParams(q, k, v, mask, 0.0, False, enable_gqa)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(can_use_flash_attention(params, True) or can_use_efficient_attention(params, True))


def test_masked_attention_never_asks_for_grouped_query_heads(tiny_models, tmp_path, monkeypatch):
    """Neither fused CUDA kernel takes a mask together with enable_gqa (flash takes no mask, memory-efficient
    no GQA), so such a call runs the math kernel with fp32 scores: GiBs at long context. The target's fast
    path and the drafter (whose causal layers are masked, in decoding and in training) fold query groups
    into rows instead."""
    cfg = target_config("qwen3")
    drafter = save_random_drafter(tmp_path / "d", drafter_config(cfg, is_causal=True), seed=2)
    pair = load(tiny_models["qwen3"], drafter)
    calls = AttentionCalls(monkeypatch)
    generate(pair.target, pair.drafter, random_prompt(20), max_new_tokens=12, stop_ids=[], block_size=8)
    ids = torch.tensor([random_prompt(40, seed=1)], device=DEVICE)
    features = torch.randn(1, 40, 3 * cfg["hidden_size"], device=DEVICE)
    anchors = torch.tensor([[3, 17]], device=DEVICE)
    training_forward(pair.drafter, features, block_embeddings(pair.drafter, ids, anchors, pair.target.embed_weight),
                     anchors)
    masked = [c for c in calls.calls if c[3] is not None]
    # the target's layers and both kinds of drafter call were seen masked
    assert {c[0].shape[2] for c in masked} >= {2 * 20, 2 * 8, 2 * 16}
    for q, k, v, mask, enable_gqa in calls.calls:
        assert mask is None or (not enable_gqa and q.shape[1] == k.shape[1] and mask.dtype == torch.bool)
        assert q.shape[1] == k.shape[1] or enable_gqa
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1  # what the fused kernels require
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            assert fused_kernel_accepts(q, k, v, mask, enable_gqa)


@pytest.mark.parametrize("mask_shape", [(5, 12), (2, 1, 5, 12), (2, 8, 5, 12), (1, 8, 5, 12), (2, 1, 1, 12),
                                        (8, 5, 12), None])
def test_folded_query_groups_equal_grouped_query_attention(mask_shape):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape) > 0.3
        mask[..., 0] = True
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25,
                                                                 enable_gqa=True)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, 0.25), reference, rtol=1e-6, atol=1e-6)


# --- prompts in pieces ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    target = save_hybrid_target(root / "target", seed=3)
    drafter = save_random_drafter(root / "drafter", drafter_config(dict(hidden_size=64, vocab_size=160,
                                                                         num_hidden_layers=4), taps=(0, 2, 3)))
    return target, drafter


@pytest.mark.parametrize("path", ["fast", "transformers", "hybrid"])
def test_a_long_prompt_is_read_in_pieces_with_the_same_result(tiny_models, hybrid_models, monkeypatch, path):
    folders = hybrid_models if path == "hybrid" else (tiny_models["qwen3"], tiny_models["qwen3-drafter"])
    pair = load(*folders, fast_path=path != "transformers")
    prompt = random_prompt(70, seed=4)

    def read(piece: int):
        monkeypatch.setattr(state_module, "PREFILL_CHUNK", piece)
        state = DecodeState(pair.target, pair.drafter)
        with TargetForwardLog(pair.target) as log:
            logits, _ = state.prefill(prompt)
        reply = generate(pair.target, pair.drafter, prompt, max_new_tokens=16, stop_ids=[]).tokens
        return logits, state.pending, log.sizes, reply

    logits, hidden, sizes, reply = read(1000)
    assert sizes == [70]
    logits_p, hidden_p, sizes_p, reply_p = read(32)
    # the transformers path (offloaded targets among them: their weights are copied in per forward) reads whole
    assert sizes_p == ([70] if path == "transformers" else [32, 32, 6])
    assert logits_p.shape == logits.shape and hidden_p.shape == hidden.shape == (1, 70, hidden.shape[-1])
    torch.testing.assert_close(logits_p, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden_p, hidden, rtol=1e-4, atol=1e-4)
    assert reply_p == reply


@pytest.mark.parametrize("path", ["fast", "hybrid"])
def test_a_prompt_interrupted_between_pieces_keeps_the_pieces_read(tiny_models, hybrid_models, monkeypatch, path):
    """Ctrl-C in the second piece of a long second turn: the state keeps the first turn and the first piece,
    the next turn reuses them, and the reply equals a fresh run's."""
    from conftest import interrupt_on_call

    folders = hybrid_models if path == "hybrid" else (tiny_models["qwen3"], None)
    pair = load(*folders)
    monkeypatch.setattr(state_module, "PREFILL_CHUNK", 32)
    first, more = random_prompt(20, seed=8), random_prompt(60, seed=9)
    state = DecodeState(pair.target, pair.drafter)
    reply = generate(pair.target, pair.drafter, first, max_new_tokens=6, stop_ids=[], state=state).tokens
    second = first + reply + more
    handle = pair.target.model.get_input_embeddings().register_forward_hook(interrupt_on_call(2))  # piece 2
    try:
        with pytest.raises(KeyboardInterrupt):
            generate(pair.target, pair.drafter, second, max_new_tokens=6, stop_ids=[], state=state)
    finally:
        handle.remove()
    state.check()
    read = state.start  # the first turn and the second turn's first piece
    assert read == len(first) + len(reply) - 1 + 32 and state.tokens == second[:read + 1]
    with TargetForwardLog(pair.target) as log:
        again = generate(pair.target, pair.drafter, second, max_new_tokens=12, stop_ids=[], state=state).tokens
    assert log.sizes[0] == len(second) - read  # only the rest is read
    fresh = DecodeState(pair.target, pair.drafter, own_caches=True)
    assert again == generate(pair.target, pair.drafter, second, max_new_tokens=12, stop_ids=[], state=fresh).tokens


# --- one cache per model ------------------------------------------------------------------------------------


def test_one_static_cache_and_one_draft_cache_per_loaded_model(tiny_models, monkeypatch):
    made = {"static": 0, "draft": 0}
    for cls, key in ((StaticCache, "static"), (DraftCache, "draft")):
        def counting(self, *args, __init=cls.__init__, __key=key, **kwargs):
            made[__key] += 1
            __init(self, *args, **kwargs)
        monkeypatch.setattr(cls, "__init__", counting)
    pair = load(tiny_models["qwen3"], tiny_models["qwen3-drafter"])
    for seed in range(3):  # API calls without a state
        generate(pair.target, pair.drafter, random_prompt(12, seed), max_new_tokens=10, stop_ids=[])
    state = DecodeState(pair.target, pair.drafter)
    generate(pair.target, pair.drafter, random_prompt(12), max_new_tokens=10, stop_ids=[], state=state)
    state.reset()  # /clear
    generate(pair.target, pair.drafter, random_prompt(12), max_new_tokens=10, stop_ids=[], state=state)
    warm_up(pair.target, pair.drafter)  # both loops, as a benchmark's warm-up runs them
    pair.target.fast.precompile(taps=True, max_block=8)
    assert made == {"static": 1, "draft": 1}


def test_a_conversation_whose_cache_was_taken_reads_its_prompt_anew(tiny_models):
    pair = load(tiny_models["qwen3"], tiny_models["qwen3-drafter"])
    first, other = random_prompt(20, 1), random_prompt(20, 2)
    fresh = generate(pair.target, pair.drafter, first, max_new_tokens=12, stop_ids=[]).tokens
    chat = DecodeState(pair.target, pair.drafter)
    assert generate(pair.target, pair.drafter, first, max_new_tokens=12, stop_ids=[], state=chat).tokens == fresh
    generate(pair.target, pair.drafter, other, max_new_tokens=12, stop_ids=[])  # another caller takes the caches
    with TargetForwardLog(pair.target) as log:
        again = generate(pair.target, pair.drafter, first, max_new_tokens=12, stop_ids=[], state=chat).tokens
    assert again == fresh and log.sizes[0] == len(first)  # read again, not reused from the other's K/V


def test_a_reply_interrupted_by_another_conversation_stops_with_a_clear_error(tiny_models):
    pair = load(tiny_models["qwen3"], tiny_models["qwen3-drafter"])
    reply = stream_generate(pair.target, pair.drafter, random_prompt(20), max_new_tokens=40, stop_ids=[])
    next(reply)
    generate(pair.target, pair.drafter, random_prompt(20, 5), max_new_tokens=5, stop_ids=[])
    with pytest.raises(CacheTakenError, match="another conversation"):
        list(reply)


# --- what gets compiled -----------------------------------------------------------------------------------------


class ShapeRecorder:
    """A compile_step that runs the module eagerly and records each call's shape: for a compiler with
    dynamic=False, every distinct (taps, ids shape, contiguity) is a graph of its own."""

    def __init__(self):
        self.calls: list[tuple[bool, tuple[int, ...], bool]] = []

    def __call__(self, module):
        def run(ids, *args):
            # shape, strides and inference-ness: a compiler with dynamic=False guards on each
            dense = ids.stride() == (ids.shape[1], 1) and ids.is_inference()
            self.calls.append((bool(getattr(module, "taps", False)), tuple(ids.shape), dense))
            return module(ids, *args)
        return run


def test_with_a_drafter_only_the_tapped_verify_sizes_are_compiled(tiny_models):
    recorder = ShapeRecorder()
    pair = load(tiny_models["qwen3"], tiny_models["qwen3-drafter"], compile_step=recorder)
    pair.target.fast.precompile(taps=True, max_block=8)
    compiled = set(recorder.calls)
    assert compiled == {(True, (1, n), True) for n in (1, 2, 4, 8)}
    recorder.calls.clear()
    generate(pair.target, pair.drafter, random_prompt(20), max_new_tokens=30, stop_ids=[])  # adaptive blocks
    for block in (1, 3, 8):
        generate(pair.target, pair.drafter, random_prompt(20), max_new_tokens=12, stop_ids=[], block_size=block)
    assert recorder.calls and set(recorder.calls) <= compiled


def test_without_a_drafter_only_the_one_token_decode_is_compiled(tiny_models):
    recorder = ShapeRecorder()
    pair = load(tiny_models["qwen3"], None, compile_step=recorder)
    pair.target.fast.precompile(taps=False, max_block=1)
    assert set(recorder.calls) == {(False, (1, 1), True)}
    recorder.calls.clear()
    generate(pair.target, None, random_prompt(20), max_new_tokens=10, stop_ids=[])
    assert set(recorder.calls) == {(False, (1, 1), True)}


def test_a_strided_block_reaches_the_compiled_forward_contiguous(tiny_models):
    recorder = ShapeRecorder()
    pair = load(tiny_models["qwen3"], tiny_models["qwen3-drafter"], compile_step=recorder)
    state = DecodeState(pair.target, pair.drafter)
    state.prefill(random_prompt(10))
    rows = torch.tensor([random_prompt(16, 3)], device=DEVICE)
    pair.target.forward(rows[:, ::2], state.target_cache, 10, taps=True)  # (1, 8), strides (16, 2)
    pair.target.forward(rows[:, 4:8], state.target_cache, 10, taps=True)  # (1, 4), strides (16, 1)
    assert recorder.calls == [(True, (1, 8), True), (True, (1, 4), True)]


def test_a_state_with_its_own_caches_decodes_alongside(tiny_models):
    pair = load(tiny_models["qwen3"], tiny_models["qwen3-drafter"])
    a, b = random_prompt(20, 1), random_prompt(20, 2)
    want_a = generate(pair.target, pair.drafter, a, max_new_tokens=20, stop_ids=[]).tokens
    want_b = generate(pair.target, pair.drafter, b, max_new_tokens=20, stop_ids=[]).tokens
    aside = DecodeState(pair.target, pair.drafter, own_caches=True)
    first = stream_generate(pair.target, pair.drafter, a, max_new_tokens=20, stop_ids=[])
    second = stream_generate(pair.target, pair.drafter, b, max_new_tokens=20, stop_ids=[], state=aside)
    got_a, got_b = [], []
    for step_a, step_b in zip(first, second):  # interleaved, round by round
        got_a += step_a.tokens
        got_b += step_b.tokens
    got_a += [t for step in first for t in step.tokens]
    got_b += [t for step in second for t in step.tokens]
    assert (got_a, got_b) == (want_a, want_b)


def test_what_runs_is_reported_in_words(tiny_models, monkeypatch):
    from dflash_cli.engine.kernels import ROW_EXACT, attention_kernel, cuda_graphs

    pair = load(tiny_models["qwen3"], tiny_models["qwen3-drafter"])
    assert pair.target.fast.attention_kernel == f"torch's fused {DEVICE} kernel"
    assert attention_kernel(torch.device("cpu"), torch.bfloat16, heads=4, kv_heads=2, head_dim=16,
                            row_exact=True) == ROW_EXACT
    assert cuda_graphs(torch.device("cpu")) is None
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", 2)
    report = cuda_graphs(torch.device("cuda"))
    assert report is not None and "2 skipped" in report and "TORCH_LOGS=cudagraphs" in report


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs DFLASH_TEST_DEVICE=cuda")
def test_bf16_compiled_forwards_record_cuda_graphs_and_a_fused_attention_kernel(tiny_models):
    from dflash_cli.engine.kernels import cuda_graphs
    from dflash_cli.runtime.local import enable_fast_path

    pair = load_pair(tiny_models["qwen3"], tiny_models["qwen3-drafter"], device=DEVICE, dtype="bfloat16")
    forward = enable_fast_path(pair.target, pair.drafter, "on", 400, bnb_quant=None)
    assert pair.target.fast_compiled and "drafter compiled" in forward, forward
    report = cuda_graphs(pair.target.device)
    assert report is not None and report.split()[0].isdigit() and int(report.split()[0]) >= 5, report
    assert " 0 skipped" in report, report  # a graph per verify size (1, 2, 4, 8) and the draft, none skipped
    assert "fused" in pair.target.fast.attention_kernel
    generate(pair.target, pair.drafter, random_prompt(20), max_new_tokens=24, stop_ids=[])


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs DFLASH_TEST_DEVICE=cuda")
def test_nf4_compiled_forwards_record_cuda_graphs(tiny_models):
    from dflash_cli.engine.compile import compiler_for
    from dflash_cli.engine.kernels import cuda_graphs

    pair = load_pair(tiny_models["qwen3"], tiny_models["qwen3-drafter"], device=DEVICE, dtype="bfloat16",
                     quant="nf4")
    assert pair.target.enable_fast_path(400, pad_to=8, compile_step=compiler_for(torch.device(DEVICE))) is None
    pair.target.fast.precompile(taps=True, max_block=8)
    assert pair.target.fast_compiled, pair.target.fast.fallback_reason
    report = cuda_graphs(pair.target.device)
    assert report is not None and " 0 skipped" in report, report
    plain = generate(pair.target, pair.drafter, random_prompt(20), max_new_tokens=24, stop_ids=[])
    assert len(plain.tokens) == 24


# --- the drafter at fixed shapes ----------------------------------------------------------------------------


def recorded_drafts(pair, prompt, static=None) -> list[torch.Tensor]:
    """The drafter's hidden states of every draft of a fixed-block greedy generation."""
    drafter, seen = pair.drafter, []
    real = type(drafter).draft_hidden

    def spy(*args, **kwargs):
        seen.append(real(drafter, *args, **kwargs).clone())
        return seen[-1]

    drafter.draft_hidden = spy
    drafter.static_draft = static
    try:
        reply = generate(pair.target, drafter, prompt, max_new_tokens=50, stop_ids=[], block_size=8).tokens
    finally:
        del drafter.draft_hidden
        drafter.static_draft = None
    return reply, seen


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_fixed_shape_drafts_equal_the_eager_drafts(tiny_models, tmp_path, kind):
    from conftest import dflash2_config

    from dflash_cli.engine.draft_graph import StaticDraft

    cfg = target_config("qwen3")
    config = drafter_config(cfg) if kind == "dflash" else dflash2_config(cfg)
    pair = load(tiny_models["qwen3"], save_random_drafter(tmp_path / kind, config, seed=3))
    prompt = random_prompt(30, seed=6)
    reply, eager = recorded_drafts(pair, prompt)
    recorder = ShapeRecorder()
    static = StaticDraft(pair.drafter, compile_step=lambda module: _recording(module, recorder))
    reply_static, fixed = recorded_drafts(pair, prompt, static)
    assert reply_static == reply and len(fixed) == len(eager) > 5
    for a, b in zip(fixed, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # every draft but the first (the whole prompt as new context) ran at one shape, as precompile's does
    static.precompile(shared_draft_cache(pair.drafter, pair.target.fast.capacity + 8),
                     pair.target.hidden_size, pair.target.device)
    assert len(recorder.calls) == len(eager) and len(set(recorder.calls)) == 1


def _recording(module, recorder):
    def run(context, *args):
        inference = all(t.is_inference() for t in (context, *args[:4]))  # a guard, as shapes are
        recorder.calls.append((tuple(context.shape), tuple(args[0].shape), tuple(args[1].shape), inference))
        return module(context, *args)
    return run


def test_compiling_the_target_compiles_the_drafter_too(tiny_models, monkeypatch):
    from dflash_cli.engine import compile as compile_module
    from dflash_cli.runtime.local import enable_fast_path

    recorder = ShapeRecorder()
    monkeypatch.setattr(compile_module, "compiler_for", lambda device: recorder)
    pair = load_pair(tiny_models["qwen3"], tiny_models["qwen3-drafter"], device=DEVICE, dtype="float32")
    plain = generate(pair.target, None, random_prompt(20), max_new_tokens=30, stop_ids=[]).tokens
    forward = enable_fast_path(pair.target, pair.drafter, "on", 400, bnb_quant=None)
    assert "drafter compiled" in forward and pair.drafter.static_draft is not None
    assert generate(pair.target, pair.drafter, random_prompt(20), max_new_tokens=30, stop_ids=[]).tokens == plain


def test_a_compiling_load_says_so_on_a_pipe_too(tmp_path, monkeypatch):
    """Compiling took minutes (a hybrid target: 217 s) under nothing but the 'Loading' spinner, and without
    a word on a pipe; the load now names the step."""
    from click.testing import CliRunner
    from conftest import save_tiny_pair

    from dflash_cli.engine import compile as compile_module
    from dflash_cli.ui.cli import cli

    target, drafter = save_tiny_pair(tmp_path)
    monkeypatch.setattr(compile_module, "compiler_for", lambda device: ShapeRecorder())
    result = CliRunner().invoke(cli, ["generate", "-m", str(target), "--draft", str(drafter), "--compile", "on",
                                      "-n", "4", "hi"])
    assert result.exit_code == 0, result.stderr
    assert "Compiling the decode and verify forwards" in result.stderr
