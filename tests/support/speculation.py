"""What speculative decoding is checked against: transformers' greedy reply, oracle drafters, random prompts."""

from __future__ import annotations

import random
import weakref

import torch
from conftest import VOCAB

from dflash_cli.engine.generate import generate
from dflash_cli.engine.oracle import OracleDrafter

# references already computed, per model: the lossless tests ask for the same one many times (an oracle drafter
# is built from it, per block size, per acceptance), and on the hybrid and Gemma 4 targets transformers' generate
# is the slowest part of the suite
_references: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(target, prompt, max_new_tokens, eos=None):
    """transformers' own greedy generate: the reference output. Remembered for the model as its weights are
    (each parameter's storage and version: an in-place change or a replaced weight computes it again); a
    greedy reply to n tokens is the first n of a longer one."""
    model = target.model
    weights = tuple((p.data_ptr(), p._version) for p in model.parameters())
    key = (tuple(prompt), tuple(eos) if isinstance(eos, (list, tuple)) else eos, weights)
    known = _references.setdefault(model, {})
    longest = known.get(key)
    if longest is not None and (longest[0] >= max_new_tokens or len(longest[1]) < longest[0]):
        return longest[1][:max_new_tokens]  # asked for at least this many, or it stopped before that
    ids = torch.tensor([prompt], device=target.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos, pad_token_id=0)
    reply = out[0, len(prompt):].tolist()
    known[key] = (max_new_tokens, reply)
    return list(reply)


def tiny_pair(tiny_models, kind: str):
    """A tiny pair loaded in fp32: kind "qwen3" or "llama" on transformers' forward, "...-fast" on the fast
    path (static cache, eager)."""
    from conftest import DEVICE

    from dflash_cli.engine.load import load_pair

    family, _, fast = kind.partition("-")
    pair = load_pair(tiny_models[family], tiny_models[f"{family}-drafter"], device=DEVICE, dtype="float32")
    if fast:
        assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    return pair


def random_prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 140) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def oracle_for(pair, prompt, n_new, acceptance=1.0, seed=0):
    reference = prompt + hf_greedy(pair.target, prompt, n_new + 20)
    return OracleDrafter(pair.drafter, reference, acceptance=acceptance, seed=seed, vocab_size=160)


def assert_speculative_equals_plain(pair, make_prompts, block_sizes, *, max_new_tokens: int) -> None:
    """Greedy speculative decoding commits the plain greedy reply, with long accepted prefixes (an oracle that
    knows the reply drafts it right 80% of the time) and with the pair's own random drafter, at every block
    size; `make_prompts(2, seed=block_size)` gives the prompts."""
    for block_size in block_sizes:
        for prompt in make_prompts(2, seed=block_size):
            plain = generate(pair.target, None, prompt, max_new_tokens=max_new_tokens, stop_ids=[]).tokens
            oracle = OracleDrafter(pair.drafter, prompt + plain + [0] * 20, acceptance=0.8, seed=block_size,
                                   vocab_size=VOCAB)
            got = generate(pair.target, oracle, prompt, max_new_tokens=max_new_tokens, block_size=block_size,
                           stop_ids=[])
            assert got.tokens == plain
            assert got.stats.accepted > 0
            drafted = generate(pair.target, pair.drafter, prompt, max_new_tokens=max_new_tokens,
                               block_size=block_size, stop_ids=[])
            assert drafted.tokens == plain
