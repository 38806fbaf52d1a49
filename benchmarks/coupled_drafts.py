#!/usr/bin/env python
"""Draft acceptance at T>0 on the real SmolLM2-135M-Instruct + the bundled demo drafter (converted once by
`dflash-cli` into ~/.cache/dflash-cli/models):
coupled sampled drafts (the loop's rule) vs argmax drafts (the rule before), same seeds, fp32, CPU.

    python benchmarks/coupled_drafts.py     # about 8 minutes on 2 CPU cores
"""

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

import dflash_cli
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.text import encode_prompt

torch.set_num_threads(1)


class ArgmaxDrafts:
    """The same drafter, proposing its argmax whatever the temperature."""

    def __init__(self, d): self.d, self.config = d, d.config
    block_size = property(lambda s: s.d.block_size)
    mask_token_id = property(lambda s: s.d.mask_token_id)
    def new_cache(self, c=256): return self.d.new_cache(c)
    def draft(self, *a, sampler=None, **k): return self.d.draft(*a, **k)

target = Path.home() / ".cache/dflash-cli/models/smollm2-135m-instruct"
drafter = Path(dflash_cli.__file__).parent / "demo" / "smollm2-135m-dflash"
pair = load_pair(target, drafter, device="cpu", dtype="float32")
tok = AutoTokenizer.from_pretrained(str(target))
prompts = [json.loads(line)["prompt"] for name in ("math", "code", "chat")
           for line in (Path(dflash_cli.__file__).parent / "prompts" / f"{name}.jsonl").read_text().splitlines()[:3]]
for T in (0.0, 0.7, 1.0):
    for name, d in (("coupled", pair.drafter), ("argmax", ArgmaxDrafts(pair.drafter))):
        if T == 0 and name == "argmax":
            continue
        acc = dr = steps = toks = 0
        for i, p in enumerate(prompts):
            ids = encode_prompt(tok, p)
            out = generate(pair.target, d, ids, max_new_tokens=64, temperature=T, seed=i, adaptive=False)
            acc, dr = acc + out.stats.accepted, dr + out.stats.drafted
            steps, toks = steps + out.stats.steps, toks + len(out.tokens)
        print(f"T={T} {name:8s} draft acceptance {acc}/{dr} = {acc/dr:.3f}  tau = {toks/steps:.2f}", flush=True)
