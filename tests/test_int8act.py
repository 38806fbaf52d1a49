"""q4a8/q8a8: the project's AVX2 kernels (engine/cpu/native/*.c) against dequantized references, bit-exact rows in
any company, the fused C decoder layer against the op-by-op forward, lossless greedy speculative decoding on
tiny Qwen3 and Llama targets, the per-CPU choice, and what happens when the kernels cannot be built."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.speculation import assert_speculative_equals_plain, random_prompts
from support.weightonly import linear, pairs, q4_1_bytes, with_draft_vocab  # noqa: F401 (pairs: a fixture)

from dflash_cli.engine.cpu import native
from dflash_cli.engine.cpu.c_draft import GreedyDraft
from dflash_cli.engine.cpu.c_layers import fuse_drafter
from dflash_cli.engine.cpu.int8act import (
    Q4A8Linear,
    Q8A8Linear,
    ShortlistHead,
    quantize_act_rows,
    quantize_drafter,
    quantize_q4_1,
)
from dflash_cli.engine.cpu.layout import pack_q4, pack_q8, unpack_q4, unpack_q8
from dflash_cli.engine.cpu.weightonly import Q4Codes, quantize_linears
from dflash_cli.engine.dtypes import KV_CACHE_ENV
from dflash_cli.engine.errors import InvalidSettingError, UnsupportedModelError
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.sampling import greedy_ids
from dflash_cli.models.smollm2_convert import read_q4_1_blocks

pytestmark = pytest.mark.skipif(native.available_without_building() is not None,
                                reason=f"no AVX2 kernels here: {native.available_without_building()}")


@pytest.mark.parametrize("kind", ["q4a8", "q8a8"])
@pytest.mark.parametrize("out_features, bias", [(96, False), (64, True), (40, False), (13, True)])
def test_the_kernels_equal_the_matmul_of_their_dequantized_weights(kind, out_features, bias):
    lin = linear(out_features, 128, seed=out_features, bias=bias)
    layer = quantize_linears([lin], kind)
    assert layer is not None
    x = torch.randn(11, 128)
    # what the integer dot products multiply: each row's 8-bit codes times its block scales
    reference = quantize_act_rows(x) @ layer.dequantize().T + (lin.bias if bias else 0)
    torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-5)
    # and close to the fp32 layer (4 bits cost more than 8)
    with torch.no_grad():
        error = float((layer(x) - lin(x)).norm() / lin(x).norm())
    assert error < (0.15 if kind == "q4a8" else 0.02)


@pytest.mark.parametrize("kind", ["q4a8", "q8a8"])
def test_a_row_alone_equals_the_same_row_among_sixteen_bit_for_bit(kind):
    layer = quantize_linears([linear(3 * 64, 96, seed=3)], kind)
    assert layer is not None
    x = torch.randn(16, 96) * 3
    together = layer(x)
    for n in range(1, 17):
        assert torch.equal(layer(x[:n].contiguous()), together[:n])
    for r in range(16):
        assert torch.equal(layer(x[r:r + 1].contiguous())[0], together[r])


@pytest.mark.parametrize("kind", ["q4a8", "q8a8"])
def test_columns_shared_out_guided_or_statically_give_the_same_bits(kind):
    """Calls of several rows share the columns out guided (a thread that runs slower takes fewer), one row
    statically: which thread computes a column must change nothing in it, on any number of threads."""
    lib = native.library().lib
    layer = quantize_linears([linear(8 * 40, 96, seed=5)], kind)  # 40 groups of 8 columns
    assert layer is not None
    x = torch.randn(16, 96) * 3
    threads, default = torch.get_num_threads(), lib.dfq_guided_min_rows()
    got = []
    try:
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            for guided_from in (0, 1, 2, 17):  # never, always, the default, never for these calls
                lib.dfq_set_guided_min_rows(guided_from)
                assert lib.dfq_guided_min_rows() == guided_from
                got.append([layer(x[:m].contiguous()) for m in (1, 2, 8, 16)])
    finally:
        torch.set_num_threads(threads)
        lib.dfq_set_guided_min_rows(default)
    for calls in got[1:]:
        for a, b in zip(got[0], calls):
            assert torch.equal(a, b)


def test_the_kernel_layouts_round_trip():
    codes = torch.randint(0, 16, (24, 96), dtype=torch.int32)
    assert torch.equal(unpack_q4(pack_q4(codes)).to(torch.int32), codes)
    signed = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    assert torch.equal(unpack_q8(pack_q8(signed)), signed)


def test_gguf_q4_1_blocks_keep_their_codes_d_and_m_exactly():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(16, 64))
    d = rng.uniform(0.001, 0.01, size=(16, 2)).astype(np.float16)
    m = rng.uniform(-0.1, 0.0, size=(16, 2)).astype(np.float16)
    q, dd, mm = read_q4_1_blocks(q4_1_bytes(codes, d, m))
    layer = Q4A8Linear(Q4Codes.from_q4_1(q, dd, mm), [16], None)
    expected = (torch.from_numpy(codes).float().reshape(16, 2, 32) * torch.from_numpy(d.astype(np.float32))[..., None]
                + torch.from_numpy(m.astype(np.float32))[..., None]).reshape(16, 64)
    assert torch.equal(layer.dequantize(), expected)


def test_the_rope_table_gives_each_positions_rows_as_the_rotary_does():
    """The C layers' rotary tables (c_layers.RopeTable): rows of a table of every position so far, grown by
    doubling, equal to the rotary's own for those positions; a dynamic rotary (whose tables depend on the
    call's longest position) makes each call's rows itself."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash_cli.engine.cpu.c_layers import RopeTable

    def reference(rotary, lo, end):
        cos, sin = rotary(torch.empty(0), torch.arange(lo, end)[None])
        return cos, torch.cat([-sin[..., :8], sin[..., 8:]], dim=-1)

    shape = dict(head_dim=16, hidden_size=64, num_attention_heads=4, max_position_embeddings=1024)
    rotary = Qwen3RotaryEmbedding(Qwen3Config(**shape))
    table = RopeTable(rotary)
    for lo, end, size in ((3, 9, 256), (250, 300, 512), (0, 1, 512), (1000, 1040, 1040)):
        got = table.rows(lo, end)
        assert table.cos is not None and table.cos.shape[1] == size and got[0].shape == (1, end - lo, 16)
        for g, w in zip(got, reference(rotary, lo, end)):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    dynamic = Qwen3RotaryEmbedding(Qwen3Config(**shape, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    table = RopeTable(dynamic)
    got = table.rows(2000, 2004)  # past max_position_embeddings: the dynamic frequencies of this call
    assert table.cos is None
    for g, w in zip(got, reference(Qwen3RotaryEmbedding(Qwen3Config(**shape, rope_scaling={
            "rope_type": "dynamic", "factor": 2.0})), 2000, 2004)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_the_c_rms_norm_is_the_drafters_rms_norm():
    """The drafter's norms around its C layers (native.rms_norm): the module's function, rows in any shape."""
    from dflash_cli.engine.drafter import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(2, 3, 64) * 5
    x[0, 0] = 0.0  # eps alone under the root
    got = native.rms_norm(native.library().lib, x, norm.weight.detach(), norm.eps)
    torch.testing.assert_close(got, norm(x).detach(), rtol=1e-6, atol=1e-6)
    assert native.rms_norm(native.library().lib, torch.randn(2, 12), torch.ones(12), 1e-5) is None  # 12 % 8


@pytest.mark.parametrize("hd", [32, 64, 96, 128])  # the 8-vector passes, the remainder, the hd instances
def test_attention_in_c_is_softmax_attention_with_exact_rows(hd):
    torch.manual_seed(0)
    kv, heads, capacity = 2, 6, 300
    keys, values = torch.randn(2, 1, kv, capacity, hd)
    lib = native.library().lib

    def reference(q, positions):
        rows = []
        for t, p in enumerate(positions.tolist()):
            qq = q[0, t].reshape(kv, heads // kv, hd)
            scores = qq @ keys[0, :, :p + 1].transpose(-1, -2) * hd**-0.5
            rows.append((torch.softmax(scores, -1) @ values[0, :, :p + 1]).reshape(-1))
        return torch.stack(rows)[None]

    for n, end in ((1, 1), (5, 40), (16, 299)):
        positions = torch.arange(end - n, end)
        q = torch.randn(1, n, heads + kv, hd)[:, :, :heads]  # a strided view, as the projection gives
        got = native.attention(lib, q, keys, values, positions, None, hd**-0.5)
        torch.testing.assert_close(got, reference(q, positions), rtol=1e-5, atol=1e-5)
        for t in range(n):
            alone = native.attention(lib, q[:, t:t + 1], keys, values, positions[t:t + 1], None, hd**-0.5)
            assert torch.equal(alone[0, 0], got[0, t])


@pytest.mark.parametrize("out, top", [(300, 16), (5, 16), (29, 3)])  # padded groups; fewer rows than the shortlist
def test_a_shortlist_head_scores_each_rows_best_again_with_the_8_bit_codes(out, top):
    """A draft head's 4-bit copy scores every row; its `top` best per row carry the 8-bit head's own bits, the
    others the copy's, and the greedy draft is the 8-bit head's."""
    torch.manual_seed(0)
    exact = Q8A8Linear(torch.randn(out, 96), [out], torch.randn(out))
    head = ShortlistHead(exact, top=top)
    x = torch.randn(7, 96)
    got, want, quick = head(x), exact(x), head.quick(x)
    assert got.shape == want.shape == (7, out)
    shortlist = quick.topk(min(top, out), dim=-1).indices
    again = torch.zeros_like(got, dtype=torch.bool).scatter_(1, shortlist, True)
    assert torch.equal(got[again], want[again])
    assert torch.equal(got[~again], quick[~again])
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(head(x[2:3])[0], got[2])  # a row alone as among others


def test_a_4_bit_copy_of_8_bit_codes_is_quantize_q4_1_of_their_weight():
    """Q4A8Linear.copy_of (C, a block at a time) gives the codes and scales torch's quantize_q4_1 gives the 8-bit
    weight's values: the same bits, padded rows included."""
    torch.manual_seed(1)
    weight = torch.randn(45, 64)
    weight[3, :32] = 0.25  # a block of one value: d = 0
    exact = Q8A8Linear(weight, [45], torch.randn(45))
    whole = Q4A8Linear(quantize_q4_1(exact.dequantize()), [45], exact.bias[:45])
    copy = Q4A8Linear.copy_of(exact)
    assert (copy.out_features, copy.padded, copy.in_features) == (45, 48, 64)
    for name in ("codes", "d", "m", "bias"):
        assert torch.equal(getattr(copy, name), getattr(whole, name)), name
    x = torch.randn(3, 64)
    assert torch.equal(copy(x), whole(x))


def a8_pair(pairs, family, kind, draft_kind="q8a8"):
    pair = load_pair(*pairs[family], device="cpu", quant=kind)
    assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    fast = pair.target.fast
    assert fast.weights == kind and fast.dtype == torch.float32 and fast.row_exact
    assert isinstance(fast.lm_head, Q8A8Linear)
    assert all(isinstance(p["qkv"], Q4A8Linear if kind == "q4a8" else Q8A8Linear) for p in fast.projections)
    assert quantize_drafter(pair.drafter, draft_kind) > 0  # as the runtime does: the drafter on the same kernels
    made = Q4A8Linear if draft_kind == "q4a8" else Q8A8Linear
    assert all(isinstance(layer.mlp.down_proj, made) for layer in pair.drafter.layers)
    assert fuse_drafter(pair.drafter)  # and its layers one C call each
    return pair


def test_a_q4a8_drafter_keeps_speculation_lossless_with_a_padded_draft_vocabulary_head(pairs, tmp_path):
    """DFLASH_DRAFT_QUANT=q4a8 (int8act.draft_quant): 4-bit drafter layers, fused into C calls, and a
    draft-vocabulary head whose 75 rows are padded to 80 for the kernel; the output stays the target's."""
    pair = a8_pair({"qwen3": with_draft_vocab(pairs["qwen3"], tmp_path)}, "qwen3", "q4a8", draft_kind="q4a8")
    head = pair.drafter.draft_head(pair.target.fast.lm_head)
    assert isinstance(head, Q4A8Linear) and (head.out_features, head.padded) == (75, 80)
    x = torch.randn(3, head.in_features)
    reference = quantize_act_rows(x) @ head.dequantize().T
    torch.testing.assert_close(head(x), reference, rtol=1e-5, atol=1e-5)
    assert_speculative_equals_plain(pair, random_prompts, (2, 8), max_new_tokens=20)


def test_the_drafter_is_q8a8_unless_dflash_draft_quant_says_q4a8(monkeypatch):
    from dflash_cli.engine.cpu.int8act import DRAFT_QUANT_ENV, draft_quant

    monkeypatch.delenv(DRAFT_QUANT_ENV, raising=False)
    assert draft_quant() == ("q8a8", "the default")
    monkeypatch.setenv(DRAFT_QUANT_ENV, "Q4A8")
    assert draft_quant() == ("q4a8", f"set by {DRAFT_QUANT_ENV}")
    monkeypatch.setenv(DRAFT_QUANT_ENV, "q2")  # not a format: the default
    assert draft_quant()[0] == "q8a8"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["q4a8", "q8a8"])
def test_greedy_speculative_equals_greedy_plain_decoding_on_the_c_layers(pairs, family, kind):
    pair = a8_pair(pairs, family, kind)
    assert pair.target.fast._module(True, False).fused is not None  # every layer one C call
    assert_speculative_equals_plain(pair, random_prompts, (2, 4, 8), max_new_tokens=30)
    # greedy drafts beside these C layers read the target's head (no draft vocabulary) through a shortlist (that
    # drafts do use it: test_a_q4a8_runtime_makes_its_drafters_shortlist_at_load_and_says_so)
    assert isinstance(pair.drafter.greedy_head_for(pair.target.logits_head), ShortlistHead)


def test_the_dense_weights_are_freed_once_quantized_and_a_second_fast_path_refuses(pairs):
    from dflash_cli.engine.target import decoder_layers

    model_bytes = None
    for quant in (None, "q4a8"):
        pair = load_pair(*pairs["qwen3"], device="cpu", quant=quant)
        layers = decoder_layers(pair.target.model)
        dense = sum(m.weight.numel() * 4 for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
        if quant is None:
            model_bytes = dense
            continue
        assert dense == model_bytes
        assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
        head = pair.target.model.get_output_embeddings()
        # every decoder linear (q|k|v, o, gate|up, down) and the untied LM head, now 8-bit
        assert pair.target.fast.freed_bytes == dense + head.out_features * head.in_features * 4
        assert all(m.weight.numel() == 0 for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
        assert pair.target.model.get_input_embeddings().weight.numel() > 0  # what still runs dense stays
        prompt = random_prompts(1, seed=3)[0]
        assert len(generate(pair.target, pair.drafter, prompt, max_new_tokens=12, stop_ids=[]).tokens) == 12
        pair.target.disable_fast_path()
        assert "freed" in pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size)
        with pytest.raises(UnsupportedModelError, match="dense weights were freed"):
            generate(pair.target, None, prompt, max_new_tokens=2)


def test_an_untied_head_is_freed_and_a_draft_vocabulary_takes_its_rows_from_the_codes(pairs, tmp_path):
    from safetensors.torch import load_file, save_file

    target_dir, drafter_dir = pairs["qwen3"]
    vocab_ids = torch.arange(2, 150, 2)  # sorted, as a checkpoint's draft vocabulary is
    tensors = load_file(str(drafter_dir / "model.safetensors"))
    tensors["draft_vocab"] = vocab_ids
    folder = tmp_path / "drafter"
    folder.mkdir()
    for name in ("config.json",):
        (folder / name).write_bytes((drafter_dir / name).read_bytes())
    save_file(tensors, str(folder / "model.safetensors"))
    dense_head = load_pair(target_dir, None, device="cpu").target.lm_head.weight.detach()
    pair = load_pair(target_dir, folder, device="cpu", quant="q4a8")
    assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    head = pair.target.fast.lm_head
    assert head.source is None and pair.target.lm_head.weight.numel() == 0  # the fp32 head is gone
    quantize_drafter(pair.drafter)
    from_codes = pair.drafter.draft_head(head)
    # made from the codes' rows (re-quantizing them is not always exact: a block whose fp16 scale rounded up
    # has no code of 127, so its scale comes out smaller the second time)
    expected = Q8A8Linear(head.dequantize_rows(vocab_ids), [len(vocab_ids)], None)
    x = torch.randn(5, dense_head.shape[1])
    assert torch.equal(from_codes(x), expected(x))
    rows = dense_head[vocab_ids]  # and those are the dense rows, to within two roundings to 8-bit codes
    assert (from_codes.dequantize() - rows).abs().max() <= 2 * rows.abs().max() / 127
    assert pair.drafter.draft_head(head) is from_codes  # made once
    greedy = pair.drafter.greedy_head(from_codes)  # greedy drafts score the copy first, then its shortlist
    assert isinstance(greedy, ShortlistHead) and greedy.exact is from_codes
    assert pair.drafter.greedy_head(from_codes) is greedy
    assert_speculative_equals_plain(pair, random_prompts, (4, 8), max_new_tokens=20)


def test_a_tied_heads_codes_become_the_embeddings_and_the_dense_table_is_freed(tmp_path):
    from conftest import drafter_config, save_random_drafter, save_target, target_config

    from dflash_cli.engine.cpu.int8act import CodesEmbedding, quantize_q8_0

    cfg = target_config("qwen3", tie_word_embeddings=True)
    target_dir = save_target(tmp_path / "target", cfg, seed=1, scale=3.0)
    drafter_dir = save_random_drafter(tmp_path / "drafter", drafter_config(cfg), seed=2)
    dense = load_pair(target_dir, None, device="cpu", dtype=torch.float32).target.embed_weight.detach().clone()
    pair = load_pair(target_dir, drafter_dir, device="cpu", quant="q4a8")
    assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    embeddings = pair.target.model.get_input_embeddings()
    assert isinstance(embeddings, CodesEmbedding) and pair.target.embed_table is embeddings
    # the one (vocab, hidden) table, tied to the head, is gone: the head's 8-bit codes serve both
    assert pair.target.embed_weight.numel() == 0 and pair.target.lm_head.weight.numel() == 0
    assert pair.target.fast.lm_head.source is None
    codes, d = quantize_q8_0(dense)
    reference = (codes.float().reshape(len(dense), -1, 32) * d[..., None]).reshape(dense.shape)
    ids = torch.tensor([[0, 5, cfg["vocab_size"] - 1], [7, 7, 3]])
    looked_up = embeddings(ids)
    assert looked_up.shape == (2, 3, cfg["hidden_size"]) and torch.equal(looked_up, reference[ids])
    assert (looked_up - dense[ids]).abs().max() <= dense.abs().max() / 254 * 1.01  # half a code step
    for outside in ([cfg["vocab_size"]], [3, -1]):
        with pytest.raises(IndexError):  # as nn.Embedding: never a read past the codes
            embeddings(torch.tensor(outside))
    quantize_drafter(pair.drafter)
    assert_speculative_equals_plain(pair, random_prompts, (4, 8), max_new_tokens=20)


@pytest.mark.parametrize("family, last_tapped", [("qwen3", False), ("llama", False), ("qwen3", True)])
def test_the_c_layer_computes_what_the_op_by_op_forward_does(pairs, family, last_tapped, monkeypatch):
    monkeypatch.setenv(KV_CACHE_ENV, "f32")  # the op-by-op forward's cache is fp32: the same cache for both
    pair = a8_pair(pairs, family, "q4a8")
    fast = pair.target.fast
    ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 30, 31, 40]])
    results = []
    module = fast._module(True, False)
    kept_taps = module.taps
    if last_tapped:  # a drafter that taps the last layer reads it after the final norm, as transformers gives it
        module.taps = [1, len(module.layers) - 1]
    for fused in (True, False):
        kept = module.fused
        if not fused:
            module.fused = None  # the same linears and C attention, the rest as torch ops
        cache = fast.new_cache()
        # a prompt of 10 rows, then one decoding step (the taps of both are the drafter's context)
        results.append([fast.forward(ids, cache, 0, taps=True, last_logit_only=False),
                        fast.forward(ids[:, :1], cache, 10, taps=True, last_logit_only=False)])
        module.fused = kept
    module.taps = kept_taps
    for (logits, taps), (ref_logits, ref_taps) in zip(*results):
        # both quantize activations to 8 bits: a last-bit difference of a norm may move a code, no more
        torch.testing.assert_close(taps, ref_taps, rtol=0.02, atol=0.02 * float(ref_taps.abs().max()))
        torch.testing.assert_close(logits, ref_logits, rtol=0.02, atol=0.02 * float(ref_logits.abs().max()))


def test_the_final_norm_beside_the_c_layers_is_one_c_call(pairs, monkeypatch):
    """torch's RMSNorm on a decode's one row cost ~70 us of a ~3.5 ms decode of the demo (its thread pool waking);
    beside the C layers the final norm is the C norm: each forward calls it once, for the module's function."""
    pair = a8_pair(pairs, "qwen3", "q4a8")
    fast = pair.target.fast
    module = fast._module(True, False)
    calls = []
    real = native.rms_norm

    def counted(*args):
        calls.append(args[1].shape)
        return real(*args)

    monkeypatch.setattr(native, "rms_norm", counted)
    monkeypatch.setattr(module, "whole", None)  # the Python around the stack (tests/test_one_call.py: none at all)
    cache = fast.new_cache()
    fast.forward(torch.tensor([[5, 9, 11]]), cache, 0, taps=True, last_logit_only=False)
    fast.forward(torch.tensor([[7]]), cache, 3, taps=True, last_logit_only=False)
    assert len(calls) == 2
    x = torch.randn(3, module.norm.weight.shape[0])
    with torch.inference_mode():
        got = module.final_norm(x)
    want = torch.nn.functional.rms_norm(x, [x.shape[1]], module.norm.weight, module.norm.variance_epsilon)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], module.final_norm(x[1:2])[0])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_row_of_the_c_layers_has_the_same_bits_in_a_call_of_any_length(pairs, family):
    """What keeps a verify lossless: each token of a call of many (a prompt, a verify) gives the bits it gives
    decoded alone, through every C layer, its attention's runs of tokens included (4 threads: several runs
    per key/value group)."""
    pair = a8_pair(pairs, family, "q4a8")
    fast = pair.target.fast
    ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 30, 31, 40, 17, 4, 21]])
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        together = fast.forward(ids, fast.new_cache(), 0, taps=True, last_logit_only=False)
        cache = fast.new_cache()
        alone = [fast.forward(ids[:, t:t + 1], cache, t, taps=True, last_logit_only=False)
                 for t in range(ids.shape[1])]
    finally:
        torch.set_num_threads(threads)
    logits, taps = together  # logits (tokens, vocab), taps (1, tokens, width)
    assert torch.equal(logits, torch.cat([a[0] for a in alone]))
    assert torch.equal(taps, torch.cat([a[1] for a in alone], 1))


def test_the_drafters_c_layers_give_the_same_bits_on_any_number_of_threads(pairs):
    """Its attention takes the block's queries in runs, more of them with more threads: no row may change."""
    pair = a8_pair(pairs, "qwen3", "q4a8")
    fast = pair.target.fast
    ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 30, 31, 40, 17]])
    _, taps = fast.forward(ids, fast.new_cache(), 0, taps=True, last_logit_only=False)
    block = torch.randn(1, pair.drafter.block_size, pair.drafter.config.hidden_size,
                        generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    drafted = []
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            drafted.append(pair.drafter(taps, block, taps.shape[1], pair.drafter.new_cache(64)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*drafted)


@pytest.mark.parametrize("window, draft_kind", [(None, "q8a8"), (3, "q8a8"), (None, "q4a8")])
def test_the_drafters_c_layers_compute_what_its_modules_do(pairs, window, draft_kind):
    """Drafts need not be exact, but the C drafter layer must be the same function as the modules, with a
    context window (--draft-window) too; the window changes what the drafter sees."""
    pair = a8_pair(pairs, "qwen3", "q4a8", draft_kind)
    drafter = pair.drafter
    torch.manual_seed(0)
    taps = torch.randn(1, 6, drafter.fc.in_features)
    block = torch.randn(1, drafter.block_size, drafter.config.hidden_size)
    with torch.no_grad():  # sharp attention (random weights attend almost uniformly): positions must matter
        for layer in drafter.layers:
            layer.self_attn.q_norm.weight.mul_(4.0)  # in place: the C layers read the same memory
    results = []
    native_layers = drafter.native_layers
    try:
        for layers, context_window in ((native_layers, window), (None, window), (None, None)):
            drafter.native_layers, drafter.context_window = layers, context_window
            cache = drafter.new_cache(64)
            first = drafter(taps[:, :4], block, 4, cache)  # a first block after 4 context rows
            second = drafter(taps[:, 4:], block, 6, cache)  # then 2 more, over the committed ones
            results.append((first, second))
    finally:
        drafter.native_layers, drafter.context_window = native_layers, None
    assert not torch.equal(results[0][0], results[1][0])  # two implementations ran: not the same bits
    for got, want in zip(results[0], results[1]):
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * float(want.abs().max()))
    if window is not None:  # 4 and 6 context rows, 3 seen: not what the whole context gives
        for got, whole in zip(results[1], results[2]):
            assert (got - whole).abs().max() > 0.05 * float(whole.abs().max())


def test_kernels_build_once_into_the_cache_and_a_damaged_library_is_built_again(tmp_path, monkeypatch):
    heard: list[str] = []
    try:
        monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "first"))
        native.reset_for_tests()
        built = native.library(heard.append)
        assert built is not None and built.seconds > 0 and built.path.is_relative_to(tmp_path / "first")
        assert heard and "once" in heard[0]
        native.reset_for_tests()
        again = native.library(heard.append)
        assert again is not None and again.seconds == 0 and len(heard) == 1  # loaded, not built
        whole = built.path.read_bytes()
        foreign = next(Path(line.split()[-1]) for line in Path("/proc/self/maps").read_text().splitlines()
                       if "/libm.so" in line or "/libm-" in line)  # the C math library this process runs
        # where the library belongs (a new cache each time, so that nothing has that path loaded): random
        # bytes; the library cut short, with its manifest (a full disk: opening it would be a SIGBUS); a
        # library that is not ours (it lacks our symbols); each is built again, never opened
        for n, damage in enumerate([b"not a library", whole[:len(whole) // 2], foreign.read_bytes()]):
            monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / f"damaged{n}"))
            damaged = tmp_path / f"damaged{n}" / built.path.relative_to(tmp_path / "first")
            damaged.parent.mkdir(parents=True)
            damaged.write_bytes(damage)
            if n == 1:
                native.manifest_path(damaged).write_bytes(native.manifest_path(built.path).read_bytes())
            native.reset_for_tests()
            rebuilt = native.library()
            assert rebuilt is not None and rebuilt.seconds > 0 and rebuilt.path == damaged, native.unavailable()
            assert native.is_intact(damaged) and damaged.read_bytes() != damage
            layer = quantize_linears([linear(16, 32, seed=0)], "q8a8")
            assert layer is not None and layer(torch.randn(2, 32)).shape == (2, 16)
    finally:
        native.reset_for_tests()


def test_without_a_compiler_auto_falls_back_and_an_explicit_choice_says_why(tmp_path, monkeypatch, tiny_target_dir):
    from dflash_cli.engine.device import cpu_auto_quant
    from dflash_cli.runtime.local import load_runtime

    target = tiny_target_dir
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    monkeypatch.delenv("CC", raising=False)
    try:
        native.reset_for_tests()
        assert "no C compiler" in native.available_without_building()
        chosen, why = cpu_auto_quant("AVX2", False)
        assert chosen is None and "no C compiler" in why
        notices: list[str] = []
        runtime = load_runtime(target, None, quant="q4a8", device="cpu", quant_auto=True, on_notice=notices.append)
        assert runtime.quant is None and any("q4a8 is not available" in n for n in notices)
        assert "q4a8" not in runtime.forward
        with pytest.raises(InvalidSettingError, match="needs this project's AVX2 kernels: no C compiler"):
            load_runtime(target, None, quant="q4a8", device="cpu")
    finally:
        native.reset_for_tests()



def test_a_q4a8_runtime_makes_its_drafters_shortlist_at_load_and_says_so(tmp_path):
    """The 4-bit copy of the head greedy drafts read first is made while the model loads (0.4 s for a
    Qwen3-1.7B-shaped head), not in the first reply's first draft, where the adaptive controller would time it."""
    from conftest import save_tiny_pair

    from dflash_cli.engine.generate import generate as run
    from dflash_cli.runtime.local import load_runtime

    target, drafter = save_tiny_pair(tmp_path)
    runtime = load_runtime(target, drafter, quant="q4a8", device="cpu")
    assert "greedy drafts through a 4-bit copy of its head, each greedy draft one C call" in runtime.forward
    made = runtime.drafter.greedy_head_for(runtime.target.logits_head)
    assert isinstance(made, ShortlistHead)
    call = runtime.drafter._greedy_call[-1]  # the one C call a greedy draft makes (tests/test_one_call.py), made too
    assert isinstance(call, GreedyDraft) and call.head is made
    drafts: list[GreedyDraft] = []
    original = GreedyDraft.__call__
    try:
        GreedyDraft.__call__ = lambda self, *a: drafts.append(self) or original(self, *a)  # type: ignore[method-assign]
        run(runtime.target, runtime.drafter, [5, 9, 11, 3], max_new_tokens=12, block_size=4, stop_ids=[])
    finally:
        GreedyDraft.__call__ = original  # type: ignore[method-assign]
    assert drafts and all(d is call for d in drafts)  # the ones made at load drafted


def test_the_cli_runs_q4a8_and_says_what_ran(tiny_target_dir):
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    ok = CliRunner().invoke(cli, ["generate", "-m", str(tiny_target_dir), "--quant", "q4a8", "-v", "-n", "6",
                                  "--no-chat-template", "hello"])
    assert ok.exit_code == 0, ok.stderr
    assert "q4a8 weights" in ok.stderr and "the whole forward one C call" in ok.stderr
    assert " q4a8 ·" in ok.stderr and "float32" in ok.stderr  # the load line: fp32 around the kernels


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
def test_a_greedy_verify_runs_the_lm_head_only_up_to_the_first_rejected_draft(pairs, acceptance):
    """On the CPU fast path the verify's LM head stops at the first rejected draft (speculative.greedy_prefix):
    an oracle drafting 7 tokens that are all wrong gets the head on at most 2 rows per verify; all right, on
    every row; and the replies stay the plain greedy ones."""
    from dflash_cli.engine.oracle import OracleDrafter

    pair = a8_pair(pairs, "qwen3", "q4a8")
    assert pair.target.defers_head
    prompt = [5, 9, 11, 3, 7, 2, 8]
    plain = generate(pair.target, None, prompt, max_new_tokens=24, stop_ids=[]).tokens
    oracle = OracleDrafter(pair.drafter, prompt + plain + [0] * 20, acceptance=acceptance, seed=1, vocab_size=160)
    head_rows: list[int] = []
    finish = pair.target.logits_of

    def counted(normed):  # the real head, with the rows it was given counted
        head_rows.append(normed.shape[0])
        return finish(normed)

    pair.target.logits_of = counted
    pair.target.head_costs = lambda: None  # a call costing two rows beyond its own (measured, it varies by machine)
    try:
        got = generate(pair.target, oracle, prompt, max_new_tokens=24, block_size=8, stop_ids=[])
    finally:
        del pair.target.logits_of, pair.target.head_costs
    assert got.tokens == plain
    verifies = got.stats.steps
    if acceptance == 0.0:  # 2 rows while the estimate of accepted drafts is near 1, then 1
        assert got.stats.accepted == 0 and max(head_rows) <= 3 and sum(head_rows) < 2 * verifies
    elif acceptance == 1.0:  # every verified slot's row once
        assert got.stats.accepted > 0 and sum(head_rows) == got.stats.accepted + verifies
    else:
        assert sum(head_rows) < 8 * verifies


def test_greedy_ids_take_the_first_maximum_as_torch_does():
    """The C argmax behind greedy decoding, drafting and verifying: torch.argmax's index on every row, ties
    to the first, vector tails and short rows, -inf rows; a NaN row goes to torch (which picks the NaN)."""
    assert native.library() is not None and native.loaded() is not None
    generator = torch.Generator().manual_seed(3)
    for n in (1, 5, 8, 13, 64, 49157):
        x = torch.randn(6, n, generator=generator)
        top = x.max(-1, keepdim=True).values
        x[1, n // 2:] = top[1]  # ties from the middle on: the first of them
        x[2] = torch.where(torch.arange(n) % 3 == 2, top[2], x[2])  # ties in every vector lane
        x[3] = -torch.inf
        got = greedy_ids(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1)), n
        assert torch.equal(greedy_ids(x[:, : max(1, n - 1)]), x[:, : max(1, n - 1)].argmax(-1))  # strided rows
    x = torch.randn(3, 100, generator=generator)
    x[1, 40] = torch.nan
    assert native.argmax_rows(native.loaded().lib, x) is None
    assert torch.equal(greedy_ids(x), x.argmax(-1)) and int(greedy_ids(x)[1]) == 40


def test_the_targets_head_call_cost_is_measured_once(pairs):
    target = a8_pair(pairs, "qwen3", "q4a8").target
    assert target.defers_head
    calls = []
    logits_of = target.fast.logits_of
    target.fast.logits_of = lambda normed: calls.append(normed.shape[0]) or logits_of(normed)
    costs = target.head_costs()
    assert len(costs) == 9 and costs[0] == 0.0 and all(c > 0 for c in costs[1:])
    assert sorted(calls) == sorted([1] + [k for k in range(1, 9) for _ in range(3)])  # a warm-up, then 3 each
    assert target.head_costs() is costs and len(calls) == 25  # kept


def test_the_c_layers_cache_is_fp16_when_asked_and_close_to_fp32(pairs, monkeypatch):
    """With DFLASH_KV_CACHE=f16 a target whose every layer is one C call keeps its K/V in fp16 (half the bytes
    attention reads at long context), by default in fp32; the logits stay close, and greedy speculative
    decoding on the fp16 cache still equals greedy plain decoding on it (a decode and a verify read the same
    rows)."""
    from dflash_cli.engine.oracle import OracleDrafter

    monkeypatch.setenv(KV_CACHE_ENV, "f16")
    pair = a8_pair(pairs, "qwen3", "q4a8")
    fast = pair.target.fast
    ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 30, 31, 40, 41, 42]])
    half = fast.new_cache()
    assert half.keys[0].dtype == torch.float16 and fast.shared_cache().keys[0].dtype == torch.float16
    assert fast.new_cache(batch=2).keys[0].dtype == torch.float16  # the batched generator's too
    monkeypatch.delenv(KV_CACHE_ENV)
    full = fast.new_cache()
    assert full.keys[0].dtype == torch.float32
    got, _ = fast.forward(ids, half, 0, taps=False, last_logit_only=False)
    want, _ = fast.forward(ids, full, 0, taps=False, last_logit_only=False)
    assert not torch.equal(got, want)  # fp16 rows were read
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))
    k_half, k_full = half.keys[0][0, :, :12].float(), full.keys[0][0, :, :12]  # the first layer: same inputs
    assert torch.equal(k_half, k_full.half().float())  # the cached rows: the fp32 ones rounded
    monkeypatch.setenv(KV_CACHE_ENV, "f16")
    prompt = [5, 9, 11, 3, 7, 2, 8]
    plain = generate(pair.target, None, prompt, max_new_tokens=24, stop_ids=[]).tokens
    oracle = OracleDrafter(pair.drafter, prompt + plain + [0] * 20, acceptance=0.7, seed=1, vocab_size=160)
    spec = generate(pair.target, oracle, prompt, max_new_tokens=24, block_size=8, stop_ids=[])
    assert pair.target.fast.shared_cache().keys[0].dtype == torch.float16
    assert spec.tokens == plain and spec.stats.accepted > 0
