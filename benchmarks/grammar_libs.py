"""Structured-output libraries side by side: llguidance and xgrammar (whichever are installed) on the same
tokenizers, schema and JSON document, in one run.

Per tokenizer and library: grammar compile time; per-token cost of the next-token mask (what a decode step
pays), of the mask applied to one row of logits, and of consuming the token; the cost of rolling back k
tokens (what a rejected draft costs); and a speculative verify's masks for a block of 8 (the matcher
advanced through the drafts on the way, then rolled back).

    .venv/bin/pip install xgrammar tiktoken     # xgrammar is compared here only (it pulls triton)
    .venv/bin/python benchmarks/grammar_libs.py --tokenizer ~/.cache/dflash-cli/models/smollm2-135m-instruct
    .venv/bin/python benchmarks/grammar_libs.py --tiktoken qwen.tiktoken   # Qwen2/3's 151k BPE ranks

`--tiktoken FILE` builds a tokenizer.json from a tiktoken rank file (Qwen's `qwen.tiktoken` ships in the
`dashscope` wheel) with transformers' converter, so the 151k vocabulary can be measured offline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "address", "active"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "languages": ["English", "French", "Mathematics"],
            "address": {"city": "London", "zip": "W1 4AB"}, "active": True}
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def tiktoken_tokenizer(path: str):
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(202)]
    backend = TikTokenConverter(vocab_file=path, pattern=QWEN_PATTERN, extra_special_tokens=specials).converted()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bench_llguidance(tokenizer, vocab: int, ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    bitmask = llt.allocate_token_bitmask(8, vocab)
    logits = torch.randn(1, vocab)
    mask_t, apply_t, consume_t = [], [], []
    for t in ids:
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, bitmask, 0)
        t1 = time.perf_counter()
        allowed = unpack(bitmask[0], vocab)
        logits.masked_fill(~allowed, float("-inf"))
        t2 = time.perf_counter()
        assert allowed[t], "the document's token is not allowed: the grammar and document disagree"
        assert matcher.consume_token(t)
        mask_t.append(t1 - t0), apply_t.append(t2 - t1), consume_t.append(time.perf_counter() - t2)
    matcher.reset()
    rollback_t, verify_t = [], []
    for start in range(0, len(ids) - 8, 4):
        matcher.reset()
        matcher.consume_tokens(ids[:start])
        block = ids[start:start + 8]
        t0 = time.perf_counter()
        for i, t in enumerate(block):  # a verify: one mask per slot, the matcher advanced through the drafts
            llt.fill_next_token_bitmask(matcher, bitmask, i)
            matcher.consume_token(t)
        t1 = time.perf_counter()
        matcher.rollback(len(block))
        rollback_t.append(time.perf_counter() - t1), verify_t.append(t1 - t0)
    return {"tokenizer s": tok_s, "compile ms": compile_s * 1e3, "mask us": median_us(mask_t),
            "apply us": median_us(apply_t), "consume us": median_us(consume_t),
            "verify8 us": median_us(verify_t), "rollback8 us": median_us(rollback_t)}


def bench_xgrammar(tokenizer, vocab: int, ids: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(8, vocab)
    logits = torch.randn(1, vocab)
    mask_t, apply_t, consume_t = [], [], []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        t1 = time.perf_counter()
        allowed = unpack(bitmask[0], vocab)
        logits.masked_fill(~allowed, float("-inf"))
        t2 = time.perf_counter()
        assert allowed[t], "the document's token is not allowed: the grammar and document disagree"
        assert matcher.accept_token(t)
        mask_t.append(t1 - t0), apply_t.append(t2 - t1), consume_t.append(time.perf_counter() - t2)
    rollback_t, verify_t = [], []
    for start in range(0, len(ids) - 8, 4):
        matcher.reset()
        for t in ids[:start]:
            matcher.accept_token(t)
        block = ids[start:start + 8]
        t0 = time.perf_counter()
        for i, t in enumerate(block):
            matcher.fill_next_token_bitmask(bitmask, i)
            matcher.accept_token(t)
        t1 = time.perf_counter()
        matcher.rollback(len(block))
        rollback_t.append(time.perf_counter() - t1), verify_t.append(t1 - t0)
    return {"tokenizer s": tok_s, "compile ms": compile_s * 1e3, "mask us": median_us(mask_t),
            "apply us": median_us(apply_t), "consume us": median_us(consume_t),
            "verify8 us": median_us(verify_t), "rollback8 us": median_us(rollback_t)}


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    from dflash_cli.engine.constraint import allowed_from_bitmask

    return allowed_from_bitmask(words, vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", action="append", default=[], help="a folder or tokenizer.json")
    parser.add_argument("--tiktoken", action="append", default=[], help="a tiktoken rank file (Qwen's BPE)")
    parser.add_argument("--vocab", type=int, default=0, help="logits width (default: the tokenizer's, 151936 "
                        "for --tiktoken)")
    args = parser.parse_args()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_formats import cpu_line

    from dflash_cli.tables import columns

    tokenizers = []
    for path in args.tokenizer:
        p = Path(path).expanduser()
        tok = (PreTrainedTokenizerFast(tokenizer_file=str(p)) if p.is_file() else AutoTokenizer.from_pretrained(p))
        tokenizers.append((p.name if p.is_dir() else p.parent.name, tok, args.vocab or len(tok)))
    for path in args.tiktoken:
        tokenizers.append((Path(path).name, tiktoken_tokenizer(path), args.vocab or 151936))
    print(f"CPU: {cpu_line()}")
    header = ["tokenizer", "library", "vocab", "doc tokens", "tokenizer s", "compile ms", "mask us", "apply us",
              "consume us", "verify8 us", "rollback8 us"]
    rows = [header]
    for name, tok, vocab in tokenizers:
        ids = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
        for lib, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            try:
                result = bench(tok, vocab, ids)
            except ImportError as e:
                print(f"{lib}: not installed ({e})")
                continue
            rows.append([name, lib, str(vocab), str(len(ids))] + [f"{result[k]:.2f}" if k == "tokenizer s"
                                                                   else f"{result[k]:.0f}" for k in header[4:]])
    print("\n".join(columns(rows, numeric=True, rule=True)))


if __name__ == "__main__":
    main()
