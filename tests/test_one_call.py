"""One C call each for a q8a8/q4a8 drafter's greedy draft (engine/cpu/c_draft.py, native/draft.c) and for the
target's forward around its C layers (c_layers.WholeForward, native/layer.c's dfq_model_forward): the drafts,
confidences, logits, taps and cache rows of the Python they replace, bit for bit, on tiny Qwen3 and Llama pairs
loaded through the real loading code; the cases left to that Python; lossless generation through them."""

from __future__ import annotations

import pytest
import torch
from support.speculation import assert_speculative_equals_plain, random_prompts
from support.weightonly import pairs, with_draft_vocab  # noqa: F401 (pairs: a fixture)

from dflash_cli.engine.cpu.c_draft import GreedyDraft
from dflash_cli.engine.cpu.c_layers import WholeForward, fuse_drafter
from dflash_cli.engine.cpu.int8act import CodesEmbedding, ShortlistHead, quantize_drafter
from dflash_cli.engine.load import load_pair


def c_pair(folders, draft_kind="q8a8"):
    """A q4a8 pair as the runtime sets it up (runtime/local.py): the drafter on the same kernels, its layers in C."""
    pair = load_pair(*folders, device="cpu", quant="q4a8")
    assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    quantize_drafter(pair.drafter, draft_kind)
    assert fuse_drafter(pair.drafter)
    return pair


def sharpen(drafter):
    """Random drafter weights attend almost uniformly and draft one id everywhere: scaled up, positions, the
    window and each row's context matter, and the drafts differ from row to row."""
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.q_norm.weight.mul_(4.0)  # in place: the C layers read the same memory
        drafter.norm.weight.mul_(8.0)


def drafts_of(pair, embed, fused: bool, window=None):
    """A run of greedy drafts as generation makes them (new context rows, none, a kept prefix, confidence asked
    or not) on a fresh cache, through the one C call or through the Python forward: what each returned, the
    confidences, and the cache's rows and length after."""
    drafter, target = pair.drafter, pair.target
    drafter.context_window = window
    ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 30, 31, 40, 17, 21, 60, 4]])
    _, taps = target.fast.forward(ids, target.fast.new_cache(), 0, taps=True, last_logit_only=False)
    calls: list[GreedyDraft] = []
    original = GreedyDraft.__call__

    def counted(self, *args):
        got = original(self, *args)
        calls.append(got)
        return got

    cache, confidence, out = drafter.new_cache(64), [], []
    head = target.logits_head
    B = drafter.block_size
    saved = drafter.greedy_call
    try:
        GreedyDraft.__call__ = counted  # type: ignore[method-assign]
        if not fused:
            drafter.greedy_call = lambda *a: None
        out.append(drafter.draft(taps[:, :6], ids[0, 6:7], 6, B, cache, embed, head, confidence=confidence))
        out.append(drafter.draft(taps[:, 6:9], ids[0, 9:10], 9, B, cache, embed, head, keep=3, confidence=confidence))
        out.append(drafter.draft(None, ids[0, 10:11], 9, B, cache, embed, head, keep=5))
        out.append(drafter.draft(taps[:, 9:13], ids[0, 13:14], 13, B, cache, embed, head, confidence=confidence))
    finally:
        GreedyDraft.__call__ = original  # type: ignore[method-assign]
        drafter.greedy_call = saved
        drafter.context_window = None
    assert all(c is not None for c in calls) and len(calls) == (4 if fused else 0)
    rows = cache.length
    keys = [k[:, :, :rows].clone() for k in cache._k]
    values = [v[:, :, :rows].clone() for v in cache._v]
    return out, confidence, keys, values, rows


@pytest.mark.parametrize("family, draft_kind, vocab, window", [
    ("qwen3", "q8a8", False, None), ("qwen3", "q8a8", True, None), ("qwen3", "q8a8", True, 4),
    ("llama", "q8a8", False, 4), ("llama", "q4a8", True, None)])
def test_the_one_call_draft_is_the_python_forwards_draft_bit_for_bit(pairs, tmp_path, family, draft_kind, vocab,
                                                                     window):
    folders = with_draft_vocab(pairs[family], tmp_path) if vocab else pairs[family]
    pair = c_pair(folders, draft_kind)
    sharpen(pair.drafter)
    target = pair.target
    # the anchor's row from the dense table (these targets' heads are untied), and from a tied head's codes
    for embed in (target.embed_table, CodesEmbedding(target.fast.lm_head)):
        fused, python = drafts_of(pair, embed, True, window), drafts_of(pair, embed, False, window)
        assert fused[4] == python[4] == 6 + 3 + 4  # rows committed
        for got, want in zip(fused[0], python[0]):
            assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)
        assert [len(d) for d in fused[0]] == [7, 3, 5, 7]
        assert fused[1] == python[1] and len(fused[1]) == 7 + 3 + 7  # confidences, where asked
        for got, want in zip(fused[2] + fused[3], python[2] + python[3]):
            assert torch.equal(got, want)
    drafted = torch.cat(fused[0])
    assert len(set(drafted.tolist())) > 1  # sharp enough to tell rows apart
    if vocab:
        assert set(drafted.tolist()) <= set(range(2, 152, 2))  # ids of the target's vocabulary, not rows of the head
    made = pair.drafter.greedy_call(target.embed_table, target.logits_head)
    assert made.head is pair.drafter.greedy_head_for(target.logits_head)
    # a shortlist over the 8-bit head; a q4a8 drafter's own 4-bit draft-vocabulary head as it is
    assert isinstance(made.head, ShortlistHead) == (draft_kind == "q8a8" or not vocab)


def test_a_row_of_nan_logits_and_an_anchor_outside_the_table_are_left_to_the_python_forward(pairs):
    pair = c_pair(pairs["qwen3"])
    drafter, target = pair.drafter, pair.target
    call = drafter.greedy_call(target.embed_table, target.logits_head)
    assert isinstance(call, GreedyDraft)
    taps = torch.randn(1, 3, drafter.fc.in_features)
    B, vocab = drafter.block_size, target.embed_table.shape[0]
    cache = drafter.new_cache(64)
    assert call(taps, torch.tensor([vocab]), 3, B, cache, B - 1, None) is None
    with pytest.raises(IndexError):  # what the Python forward says
        drafter.draft(taps, torch.tensor([vocab]), 3, B, cache, target.embed_table, target.logits_head)
    assert cache.length == 0
    assert isinstance(call.head, ShortlistHead)
    call.head.quick.d.view(-1)[0] = float("nan")  # column 0's first block scale in the 4-bit copy: a NaN logit
    assert call(taps, torch.tensor([5]), 3, B, cache, B - 1, []) is None and cache.length == 0
    confidence: list[float] = []
    got = drafter.draft(taps, torch.tensor([5]), 3, B, cache, target.embed_table, target.logits_head,
                        confidence=confidence)
    # torch's argmax picks a row's first NaN; a confidence it cannot tell is 0
    assert torch.equal(got, torch.zeros(B - 1, dtype=torch.int64)) and confidence == [0.0] * (B - 1)
    assert cache.length == 3


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_speculation_through_the_one_call_draft_stays_lossless(pairs, family):
    pair = c_pair(pairs[family])
    calls: list[object] = []
    original = GreedyDraft.__call__
    try:
        GreedyDraft.__call__ = lambda self, *a: calls.append(1) or original(self, *a)  # type: ignore[method-assign]
        assert_speculative_equals_plain(pair, random_prompts, (2, 8), max_new_tokens=24)
    finally:
        GreedyDraft.__call__ = original  # type: ignore[method-assign]
    assert calls  # its drafts came from the one call


def forwards_of(fast, through_c: bool):
    """A prompt, a decode, a verify of 5 and a prompt's last logit, each with and without taps or logits, on
    fresh caches: every result, tap and cache row, through the one C call or the Python around the stack."""
    calls: list[object] = []
    original = WholeForward.__call__
    modules = [fast._module(taps, last, logits) for taps in (True, False) for last in (True, False)
               for logits in (True, False)]
    saved = [m.whole for m in modules]
    out = []
    try:
        WholeForward.__call__ = lambda self, *a: calls.append(1) or original(self, *a)  # type: ignore[method-assign]
        for module in modules:
            assert module.whole is not None  # made for every kind of call
            if not through_c:
                module.whole = None
        for taps in (True, False):
            for logits in (True, False):
                cache = fast.new_cache()
                out.append(fast.forward(torch.tensor([[5, 9, 11, 3, 7, 2]]), cache, 0, taps=taps,
                                        last_logit_only=True, logits=logits))
                out.append(fast.forward(torch.tensor([[30]]), cache, 6, taps=taps, last_logit_only=False,
                                        logits=logits))
                out.append(fast.forward(torch.tensor([[8, 40, 17, 21, 60]]), cache, 7, taps=taps,
                                        last_logit_only=False, logits=logits))
                out.append((cache.keys[0][:, :, :12].clone(), cache.values[-1][:, :, :12].clone()))
    finally:
        WholeForward.__call__ = original  # type: ignore[method-assign]
        for module, whole in zip(modules, saved):
            module.whole = whole
    assert len(calls) == (12 if through_c else 0)
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_targets_forward_as_one_c_call_gives_the_bits_of_the_python_around_its_stack(pairs, family):
    pair = c_pair(pairs[family])
    fast = pair.target.fast
    last = len(fast._module(True, False).layers) - 1
    for embed in ("dense", "last tapped", "codes"):
        if embed == "last tapped":  # the last layer's tap is its final-normed rows, written by the call
            fast.taps = [1, last]
            fast._eager.clear()  # its modules are made again
        if embed == "codes":  # a tied head's codes as the embeddings (what a tied target's fast path makes)
            codes = CodesEmbedding(fast.lm_head)
            pair.target.model.set_input_embeddings(codes)
            fast._eager.clear()
            assert isinstance(fast._module(True, False).whole.embed, CodesEmbedding)
        got, want = forwards_of(fast, True), forwards_of(fast, False)
        for a, b in zip(got, want):
            for x, y in zip(a, b):
                assert (x is None) == (y is None)
                if x is not None:
                    assert x.shape == y.shape and torch.equal(x, y)
        # shapes as the callers read them: a prompt's last logit, every row's logits, final-normed rows
        vocab, hidden = fast.lm_head.out_features, fast.lm_head.in_features
        assert got[0][0].shape == (1, vocab) and got[2][0].shape == (5, vocab) and got[4][0].shape == (1, hidden)
        assert got[0][1].shape[1] == 6 and got[8][1] is None


def test_an_id_outside_the_table_still_raises_what_the_lookup_says(pairs):
    pair = c_pair(pairs["qwen3"])
    fast = pair.target.fast
    vocab = fast.lm_head.out_features
    with pytest.raises(IndexError):
        fast.forward(torch.tensor([[5, vocab]]), fast.new_cache(), 0, taps=False, last_logit_only=True)
