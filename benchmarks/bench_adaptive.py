"""Adaptive speculation with a useless drafter: does it fall back to plain-decoding speed?

Target: the built-in SmolLM2-135M-Instruct (offline). Drafter: random weights in the DFlash format
(never accepted). Rows: plain decoding, speculation with a fixed block, adaptive speculation. Greedy,
interleaved per prompt, medians over prompts, prefill excluded.

    .venv/bin/python benchmarks/bench_adaptive.py [--tokens 128] [--prompts 4] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair, save_drafter
from dflash_cli.engine.text import encode_prompt
from dflash_cli.models.smollm2 import ensure_smollm2

PROMPTS = ["Explain what a hash map is.", "Write a short poem about autumn.",
           "How do I reverse a list in Python?", "Give me three tips for better sleep.",
           "What causes the seasons on Earth?", "Describe a good first day at a new job."]


def random_drafter(folder: Path, hidden: int, layers: int) -> Path:
    cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=hidden, intermediate_size=1536,
               num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
               hidden_act="silu", rope_theta=100000.0, num_target_layers=layers, block_size=16,
               dflash_config={"mask_token_id": 3, "target_layer_ids": [1, layers // 2, layers - 3]})
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(DrafterConfig.from_dict(cfg)), folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir = ensure_smollm2()
    from transformers import AutoConfig, AutoTokenizer

    tc = AutoConfig.from_pretrained(target_dir)
    drafter_dir = random_drafter(Path(tempfile.mkdtemp()) / "drafter", tc.hidden_size, tc.num_hidden_layers)
    pair = load_pair(target_dir, drafter_dir, device="cpu", dtype=args.dtype)
    tok = AutoTokenizer.from_pretrained(target_dir)
    configs = {"plain": dict(drafter=None), "fixed block 16": dict(drafter=pair.drafter, block_size=16),
               "adaptive": dict(drafter=pair.drafter)}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    blocks = []
    prompts = [encode_prompt(tok, text) for text in PROMPTS[: args.prompts]]
    for name, kw in configs.items():  # warm-up
        generate(pair.target, kw["drafter"], prompts[0], max_new_tokens=16, stop_ids=[],
                 block_size=kw.get("block_size"))
    for prompt in prompts:
        for name, kw in configs.items():  # interleaved
            res = generate(pair.target, kw["drafter"], prompt, max_new_tokens=args.tokens, stop_ids=[],
                           block_size=kw.get("block_size"))
            rates[name].append(res.stats.decode_tokens_per_second)
            if name == "adaptive":
                blocks.append(res.stats.block_rounds)
    plain = statistics.median(rates["plain"])
    print(f"# SmolLM2-135M ({args.dtype}, {torch.get_num_threads()} threads), random drafter, "
          f"{args.tokens} tokens x {len(prompts)} prompts, greedy")
    print(f"{'config':<16} {'tok/s':>8} {'vs plain':>9}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:<16} {rate:8.1f} {rate / plain:8.2f}x")
    paused = sum(b[0] for b in blocks) / max(sum(sum(b) for b in blocks), 1)
    print(f"adaptive: {paused:.0%} of steps ran with drafting paused")


if __name__ == "__main__":
    main()
