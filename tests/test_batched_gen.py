"""The batched generator of training data (train/batched.py): the same answers and features as decoding each
prompt alone, the same shards as transformers' generate, resume, fallback and the format it runs in."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_target, save_tiny_tokenizer, target_config

from dflash_cli.engine.load import load_target
from dflash_cli.train.batched import GenFormat, choose_format, generate_batched, unsupported
from dflash_cli.train.data import build_dataset, generate_batch, load_dataset, read_index

TAPS = [4, 1, 5]  # unsorted, the last layer (after the final norm) included
# different lengths; the last three share a prefix with the first (copied from it, not computed again)
PROMPTS = [[5, 9, 14, 3, 22, 7], [11, 4, 30], list(range(3, 40)), [7] * 20, [100, 101], [60, 61, 62, 63, 64],
           [12], [90, 80, 70, 60, 50, 40, 30, 20], [5, 9, 14, 3, 40, 41, 42], [5, 9, 14, 3, 22, 7], [5, 9]]
TEXTS = [f"prompt {i}: tell me about {w}" for i, w in enumerate("cats dogs rain sun code math tea wind ice".split())]


def single_sequence(target, prompt: list[int], max_new: int, stops: set[int], k: int):
    """Greedy decoding of one prompt on the fast path, one token per forward, as `generate` decodes:
    (ids, tapped features of every fed token, top-k ids, top-k log-probs)."""
    cache = target.new_cache()
    logits, hidden = target.forward(torch.tensor([prompt]), cache, 0, taps=True, last_logit_only=True)
    ids, feats, top_ids, top_logp = list(prompt), [hidden[0]], [], []
    while True:
        scores = torch.log_softmax(logits[-1].float(), dim=-1)
        top = scores.topk(k)
        top_ids.append(top.indices)
        top_logp.append(top.values)
        ids.append(int(scores.argmax()))
        if ids[-1] in stops or len(ids) - len(prompt) == max_new:
            return ids, torch.cat(feats), torch.stack(top_ids), torch.stack(top_logp)
        logits, hidden = target.forward(torch.tensor([[ids[-1]]]), cache, len(ids) - 1, taps=True)
        feats.append(hidden[0])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_answers_equal_decoding_each_prompt_alone_in_fp32(tiny_models, family):
    target = load_target(tiny_models[family], device="cpu", dtype="float32")
    free = generate_batched(target, PROMPTS, TAPS, max_new_tokens=12, width=3)
    # a stop id that ends some answers early (the token most often reached halfway)
    halfway = [int(e.ids[e.prompt_len + 5]) for e in free]
    stops = {max(set(halfway), key=halfway.count), 2}
    # 3 rows for 11 prompts: rows finish at different steps, take new prompts and move into holes
    examples = generate_batched(target, PROMPTS, TAPS, max_new_tokens=12, stop_ids=sorted(stops), topk=5, width=3)
    lengths = [len(e.ids) - e.prompt_len for e in examples]
    assert min(lengths) < 12 and max(lengths) == 12, lengths
    target.set_taps(TAPS)
    assert target.enable_fast_path(64) is None
    for prompt, e in zip(PROMPTS, examples):
        ids, feats, top_ids, top_logp = single_sequence(target, prompt, 12, stops, 5)
        assert e.ids.tolist() == ids and e.prompt_len == len(prompt)
        assert e.features.dtype == torch.bfloat16 and e.features.shape == feats.shape == (len(ids) - 1, 3 * 64)
        torch.testing.assert_close(e.features.float(), feats.to(torch.bfloat16).float(), atol=2e-2, rtol=1e-2)
        assert e.top_ids is not None and e.top_logp is not None
        assert e.top_ids.dtype == torch.int32 and e.top_logp.dtype == torch.float16
        assert torch.equal(e.top_ids.long(), top_ids)
        torch.testing.assert_close(e.top_logp.float(), top_logp, atol=2e-3, rtol=1e-3)


def test_batched_answers_equal_transformers_generate_in_fp32(tiny_models):
    """Today's generator (left-padded transformers generate with hooks) stores the same examples."""
    target = load_target(tiny_models["qwen3"], device="cpu", dtype="float32")
    ours = generate_batched(target, PROMPTS, TAPS, max_new_tokens=10, stop_ids=[2, 17], topk=4, width=4)
    theirs = generate_batch(target, PROMPTS, TAPS, max_new_tokens=10, stop_ids=[2, 17], pad_id=0, topk=4)
    for a, b in zip(ours, theirs):
        assert a.ids.tolist() == b.ids.tolist() and a.prompt_len == b.prompt_len
        torch.testing.assert_close(a.features.float(), b.features.float(), atol=2e-2, rtol=1e-2)
        assert a.top_ids is not None and b.top_ids is not None and torch.equal(a.top_ids, b.top_ids)
        torch.testing.assert_close(a.top_logp, b.top_logp, atol=2e-3, rtol=1e-3)


def test_a_prompt_reads_only_what_it_does_not_share_with_the_first(tiny_models):
    from conftest import TargetForwardLog

    target = load_target(tiny_models["llama"], device="cpu", dtype="float32")
    prompts = [[5, 9, 14, 3, 22, 7], [5, 9, 14, 3, 40, 41, 42], [5, 9], [5, 9, 14, 3, 22, 7]]
    with TargetForwardLog(target) as log:
        generate_batched(target, prompts, TAPS, max_new_tokens=4, width=4)
    assert log.take()[:4] == [6, 3, 1, 1]  # then one token per row and step


def test_build_dataset_resumes_after_an_interruption(tmp_path, tiny_target_dir, monkeypatch):
    from transformers import AutoTokenizer

    from dflash_cli.engine.fast import FastPath

    target = load_target(tiny_target_dir, device="cpu", dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    options = dict(max_new_tokens=6, batch_size=3, stop_ids=[2], topk=3)
    whole = build_dataset(target, tokenizer, TEXTS, [1, 4], tmp_path / "whole", **options)
    assert whole == list(range(len(TEXTS)))
    original, calls = FastPath.forward_rows, [0]

    def interrupted(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 20:  # within the generation of the second shard's answers, as Ctrl-C would
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FastPath, "forward_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_dataset(target, tokenizer, TEXTS, [1, 4], tmp_path / "data", **options)
    first = read_index(tmp_path / "data")["shards"]
    assert 0 < len(first) < 3 and all(len(s["prompts"]) == 3 for s in first)
    files = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "data").glob("*.safetensors")}
    monkeypatch.setattr(FastPath, "forward_rows", original)
    assert build_dataset(target, tokenizer, TEXTS, [1, 4], tmp_path / "data", **options) == whole
    index = read_index(tmp_path / "data")
    assert index["shards"][: len(first)] == first and {s["generator"] for s in index["shards"]} == {"batched fp32"}
    assert all(p.stat().st_mtime_ns == files[p.name] for p in (tmp_path / "data").glob("*.safetensors")
               if p.name in files)  # stored answers were not generated again
    for a, b in zip(load_dataset(tmp_path / "whole"), load_dataset(tmp_path / "data"), strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.features, b.features) and a.prompt_len == b.prompt_len
        assert a.top_ids is not None and b.top_ids is not None and torch.equal(a.top_ids, b.top_ids)


def test_a_target_it_cannot_run_falls_back_to_transformers_generate(tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "mistral"
    config = target_config("llama", model_type="mistral", architectures=["MistralForCausalLM"], head_dim=16,
                           sliding_window=8)
    save_target(folder, config, seed=1, scale=3.0)
    save_tiny_tokenizer(folder)
    target = load_target(folder, device="cpu", dtype="float32")
    assert unsupported(target) == "sliding-window attention"
    with pytest.raises(ValueError, match="sliding-window"):
        generate_batched(target, PROMPTS[:2], TAPS, max_new_tokens=4)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert build_dataset(target, tokenizer, TEXTS[:3], [1, 4], tmp_path / "data", max_new_tokens=5) == [0, 1, 2]
    index = read_index(tmp_path / "data")
    assert [s["generator"] for s in index["shards"]] == ["transformers"]
    assert [len(e.ids) - e.prompt_len for e in load_dataset(tmp_path / "data")] == [5, 5, 5]


def test_format_follows_the_targets_dtype_and_the_cpu(tiny_models):
    fp32 = load_target(tiny_models["llama"], device="cpu", dtype="float32")
    assert choose_format(fp32, capability="AVX512", fast_bf16=True).name == "fp32"  # fp32 data stay fp32
    assert choose_format(fp32).weights is None
    bf16 = load_target(tiny_models["llama"], device="cpu", dtype="bfloat16")
    assert choose_format(bf16, capability="AVX512", fast_bf16=True).name == "bf16"  # q4 loses at batch width
    assert choose_format(bf16, capability="AVX512", fast_bf16=True, q4_pays=True).name == "q4"
    assert choose_format(bf16, capability="AVX2", fast_bf16=False, q4_pays=True).name == "bf16"  # q4 needs native bf16
    assert choose_format(bf16, capability="DEFAULT", fast_bf16=True, q4_pays=True).name == "bf16"
    bf16.weight_quant = "q8"  # loaded with --quant q8: kept
    assert choose_format(bf16, capability="AVX512", fast_bf16=True).name == "q8"


@pytest.mark.parametrize("weights", [None, "q4"])
def test_bf16_and_q4_formats_run_and_are_recorded(tmp_path, tiny_target_dir, weights, monkeypatch):
    from transformers import AutoTokenizer

    import dflash_cli.train.batched as batched

    target = load_target(tiny_target_dir, device="cpu", dtype="bfloat16")
    fmt = GenFormat(torch.bfloat16, weights, "test")
    examples = generate_batched(target, PROMPTS[:4], TAPS, max_new_tokens=6, fmt=fmt, width=2)
    assert [len(e.ids) - e.prompt_len for e in examples] == [6] * 4
    assert all(e.features.shape == (len(e.ids) - 1, 3 * 64) and torch.isfinite(e.features).all() for e in examples)
    monkeypatch.setattr(batched, "choose_format", lambda _target: fmt)
    build_dataset(target, AutoTokenizer.from_pretrained(str(tiny_target_dir)), TEXTS[:2], [1, 4], tmp_path / "data",
                  max_new_tokens=4)
    assert json.loads((tmp_path / "data" / "index.json").read_text())["shards"][0]["generator"] == \
        f"batched {weights or 'bf16'}"


def test_width_shrinks_to_fit_memory(tiny_models, monkeypatch):
    import dflash_cli.engine.device as device
    from dflash_cli.train.batched import BatchedGenerator

    target = load_target(tiny_models["qwen3"], device="cpu", dtype="float32")
    # per position: 6 layers x K and V x 2 heads x 16 dims x 4 bytes, 3 taps x 64 features in bf16, one id
    per_row = (6 * 2 * 2 * 16 * 4 + 2 * 3 * 64 + 8) * (48 + 2)
    monkeypatch.setattr(device, "free_memory", lambda _device: 4 * 5 * per_row)
    gen = BatchedGenerator(target, TAPS, context=48, max_new_tokens=8, width=64)
    assert gen.width == 5
    assert dict(gen.answers(enumerate(PROMPTS))).keys() == set(range(len(PROMPTS)))
    with pytest.raises(ValueError, match="45 positions"):  # 37 prompt tokens and 8 new ones
        list(BatchedGenerator(target, TAPS, context=44, max_new_tokens=8).answers([(0, PROMPTS[2])]))


@pytest.mark.parametrize("weights", ["q4a8", "q8a8"])
@pytest.mark.parametrize("kv_cache", ["", "f16"])
def test_integer_activation_formats_answer_as_that_format_decodes_alone(tiny_models, weights, kv_cache,
                                                                          monkeypatch):
    """The deployed target on most CPUs decodes in q4a8: the batched generator in that format writes exactly
    the replies decoding writes, one prompt at a time (each row's activations are quantized on their own),
    with fp16 caches (DFLASH_KV_CACHE=f16) too."""
    from dflash_cli.engine.cpu import native

    monkeypatch.setenv("DFLASH_KV_CACHE", kv_cache)

    if native.unavailable():
        pytest.skip(f"the q4a8/q8a8 kernels cannot be built here: {native.unavailable()}")
    alone = load_target(tiny_models["llama"], device="cpu", dtype="float32", quant=weights)
    assert alone.enable_fast_path(256) is None and alone.weight_quant == weights
    target = load_target(tiny_models["llama"], device="cpu", dtype="float32")
    examples = generate_batched(target, PROMPTS, TAPS, max_new_tokens=8, width=4,
                                fmt=GenFormat(torch.float32, weights, "test"))
    fp32 = generate_batched(target, PROMPTS, TAPS, max_new_tokens=8, width=4)
    for prompt, example in zip(PROMPTS, examples):
        cache, ids = alone.new_cache(), list(prompt)
        logits, _ = alone.forward(torch.tensor([prompt]), cache, 0, last_logit_only=True)
        while len(ids) - len(prompt) < 8:  # as `generate` decodes in this format: one token per forward
            ids.append(int(logits[-1].argmax()))
            logits, _ = alone.forward(torch.tensor([[ids[-1]]]), cache, len(ids) - 1)
        assert example.ids.tolist() == ids
    assert any(a.ids.tolist() != b.ids.tolist() for a, b in zip(examples, fp32))  # the format changed replies


def test_reply_format_writes_the_data_in_the_named_format(tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    from dflash_cli.engine.cpu import native
    from dflash_cli.engine.errors import InvalidSettingError

    if native.unavailable():
        pytest.skip(f"the q8a8 kernels cannot be built here: {native.unavailable()}")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    fp32 = load_target(tiny_target_dir, device="cpu", dtype="float32")
    build_dataset(fp32, tokenizer, TEXTS[:2], [1, 4], tmp_path / "q8a8", max_new_tokens=4, reply_format="q8a8")
    assert json.loads((tmp_path / "q8a8" / "index.json").read_text())["shards"][0]["generator"] == "batched q8a8"
    with pytest.raises(InvalidSettingError, match="--reply-format bf16 needs the target in bfloat16"):
        build_dataset(fp32, tokenizer, TEXTS[:2], [1, 4], tmp_path / "bf16", max_new_tokens=4, reply_format="bf16")
