"""The fast path: static caches that roll back by length, compiled short forwards, and the fallback."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from support.speculation import hf_greedy, oracle_for, random_prompts

from dflash_cli.engine.compile import compiler_for, resolve_compile
from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.generate import generate, stream_generate
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.state import DecodeState


def fast_pair(tiny_models, family="qwen3", compile_step=None, on_fallback=None, context=400):
    pair = load_pair(tiny_models[family], tiny_models[f"{family}-drafter"], device=DEVICE, dtype="float32")
    reason = pair.target.enable_fast_path(context, pad_to=pair.drafter.block_size, compile_step=compile_step,
                                          on_fallback=on_fallback)
    assert reason is None
    return pair


@pytest.fixture(scope="module")
def compiled(tiny_models, tmp_path_factory):
    """The tiny Qwen3 pair with its decode and verify forwards compiled by inductor (CPU), lazily: the tests
    below use fixed block sizes, so only the shapes they run get compiled (each costs seconds here)."""
    import os

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    notes: list[str] = []
    pair = fast_pair(tiny_models, compile_step=compiler_for(torch.device(DEVICE)), on_fallback=notes.append)
    yield pair
    assert pair.target.fast_compiled and pair.target.fast._compiled, notes


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_stale_rows_past_the_committed_length_are_never_attended(tiny_models, family):
    pair = fast_pair(tiny_models, family)
    target = pair.target
    prompt = torch.tensor([[5, 9, 13, 17, 21, 25]])
    clean = target.new_cache()
    logits_clean, _ = target.forward(prompt, clean, 0)
    dirty = target.new_cache()
    # a rejected block of 8 drafts leaves its K/V behind; poison every row past the sequence too
    target.forward(torch.tensor([[7, 3, 1, 4, 1, 5, 9, 2]]), dirty, 0)
    dirty.crop(0)
    for buf in dirty.keys + dirty.values:
        buf[:, :, 8:] = 1e4
    logits, _ = target.forward(prompt, dirty, 0)
    torch.testing.assert_close(logits, logits_clean, rtol=0, atol=0)
    assert dirty.length == 6
    # a 1-token step after a rollback sees exactly the committed prefix
    target.forward(torch.tensor([[99, 98, 97]]), dirty, 6)
    dirty.crop(6)
    clean_next, _ = target.forward(torch.tensor([[31]]), clean, 6)
    dirty_next, _ = target.forward(torch.tensor([[31]]), dirty, 6)
    torch.testing.assert_close(dirty_next, clean_next, rtol=0, atol=0)


def test_the_static_cache_is_allocated_once_and_rolls_back_by_length(tiny_models):
    pair = fast_pair(tiny_models, context=300)
    state = DecodeState(pair.target, pair.drafter)
    buffers = [b.data_ptr() for b in state.target_cache.keys]
    draft_rows = None
    for _ in stream_generate(pair.target, pair.drafter, [4, 5, 6], max_new_tokens=60, stop_ids=[], state=state,
                             adaptive=False):
        state.check()
        if draft_rows is None and state.draft_cache._k[0] is not None:  # after the first draft
            draft_rows = state.draft_cache._k[0].shape[2]
    assert [b.data_ptr() for b in state.target_cache.keys] == buffers
    assert state.target_cache.capacity >= 300 and draft_rows >= 300  # the drafter's cache never grew
    assert state.draft_cache._k[0].shape[2] == draft_rows


def test_a_sequence_longer_than_the_static_cache_stops_at_its_size(tiny_models):
    pair = fast_pair(tiny_models, context=40)
    got = generate(pair.target, pair.drafter, list(range(3, 33)), max_new_tokens=100, stop_ids=[])
    assert len(got.tokens) == 10 and got.stats.finish_reason == "context"
    with pytest.raises(InvalidSettingError, match="the context holds 40"):
        generate(pair.target, pair.drafter, list(range(3, 45)), max_new_tokens=4, stop_ids=[])


@pytest.mark.parametrize("block_size", [8, 5, 3])
def test_compiled_greedy_speculation_equals_transformers_generate(compiled, block_size):
    for prompt in random_prompts(3, seed=block_size):
        expected = hf_greedy(compiled.target, prompt, 30)
        got = generate(compiled.target, compiled.drafter, prompt, max_new_tokens=30, block_size=block_size,
                       stop_ids=[], adaptive=False)
        assert got.tokens == expected
        plain = generate(compiled.target, None, prompt, max_new_tokens=30, stop_ids=[])
        assert plain.tokens == expected


def test_compiled_oracle_blocks_stops_and_cache_checks(compiled):
    prompt = [12, 34, 56, 78]
    continuation = hf_greedy(compiled.target, prompt, 60)
    oracle = oracle_for(compiled, prompt, 60, acceptance=0.7, seed=4)
    stop = continuation[21]
    state = DecodeState(compiled.target, oracle)
    tokens = []
    for step in stream_generate(compiled.target, oracle, prompt, max_new_tokens=60, stop_ids=[stop], state=state,
                                adaptive=False):
        state.check()
        tokens.extend(step.tokens)
    assert tokens == hf_greedy(compiled.target, prompt, 60, eos=stop)
    assert 0 < state.draft_cache.length


def test_compiled_chat_turns_reuse_the_cached_prefix_and_survive_a_break(compiled):
    target, drafter = compiled.target, compiled.drafter
    state = DecodeState(target, drafter)
    first = [3, 1, 4, 1, 5, 9, 2, 6]
    for i, _ in enumerate(stream_generate(target, drafter, first, max_new_tokens=40, stop_ids=[], state=state,
                                          adaptive=False)):
        if i == 2:
            break  # like Ctrl-C between steps
    state.check()
    second = state.tokens + [7, 7, 8]
    got = generate(target, drafter, second, max_new_tokens=20, stop_ids=[], state=state, adaptive=False)
    assert got.stats.prefilled_tokens < len(second)  # only the new turn was run through the target
    assert got.tokens == hf_greedy(target, second, 20)


def test_a_failing_compiler_says_so_once_and_runs_eagerly(tiny_models):
    def broken(_module):
        def run(*_args):
            raise RuntimeError("inductor exploded\nlong traceback text")
        return run

    notes: list[str] = []
    pair = fast_pair(tiny_models, compile_step=broken, on_fallback=notes.append)
    prompt = [8, 6, 7, 5, 3, 0, 9]
    got = generate(pair.target, pair.drafter, prompt, max_new_tokens=25, stop_ids=[])
    assert got.tokens == hf_greedy(pair.target, prompt, 25)
    assert notes == ["compilation failed (RuntimeError: inductor exploded); running uncompiled"]
    assert not pair.target.fast_compiled


def test_compile_choice(tiny_models, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile("auto", cpu)[0] is False
    assert resolve_compile("auto", cpu, quant="nf4")[0] is False
    assert resolve_compile("auto", cuda) == (True, "auto: CUDA graphs")
    assert resolve_compile("auto", cuda, quant="nf4") == (True, "auto: CUDA graphs (nf4 layers included)")
    compiled, why = resolve_compile("auto", cuda, quant="int8")
    assert not compiled and "host" in why
    assert resolve_compile("on", cpu)[0] is True
    monkeypatch.setattr(torch, "__version__", "2.7.1+cu126")
    compiled, why = resolve_compile("auto", cuda, quant="nf4")
    assert not compiled and "torch 2.8" in why and "2.7.1" in why
    assert resolve_compile("auto", cuda)[0] is True
    with pytest.raises(InvalidSettingError, match="unknown compile setting"):
        resolve_compile("fast", cpu)


def test_unsupported_targets_keep_the_transformers_forward(tmp_path):
    from conftest import save_target, target_config

    folder = save_target(tmp_path / "mistral", target_config(
        "llama", model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4,
        use_sliding_window=True))
    pair = load_pair(folder, None, device=DEVICE, dtype="float32")
    assert "sliding-window" in pair.target.enable_fast_path(100)
    assert pair.target.fast is None


def test_drafts_read_the_fast_paths_lm_head(tiny_models):
    pair = fast_pair(tiny_models)
    assert pair.target.logits_head is pair.target.fast.lm_head
    if pair.target.defers_head:  # the head's costs, measured once per target (25 calls), before counting
        pair.target.head_costs()
    calls = []
    handle = pair.target.logits_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        got = generate(pair.target, pair.drafter, [5, 6, 7], max_new_tokens=12, stop_ids=[], adaptive=False)
    finally:
        handle.remove()
    drafting_steps = sum(got.stats.block_rounds[1:])  # steps with a block of 2 or more slots
    assert drafting_steps >= 1
    # prefill, the prompt read into the drafter (a draft thrown away), a verify per step, a draft per block
    assert len(calls) == 2 + got.stats.steps + drafting_steps
