"""Tiny random Gemma 4 targets (dense and MoE) and drafters, scaled down from the published configs."""

from __future__ import annotations

import torch
from conftest import HF_CONFIGS, VOCAB, drafter_config, read_json

WINDOW = 8  # the targets' sliding window: every prompt of the tests is longer
LAYERS = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
PUBLISHED = {"moe": "google__gemma-4-26B-A4B-it", "dense": "nvidia__Gemma-4-31B-IT-NVFP4"}


def gemma_config(kind: str, **text) -> dict:
    """The published config of the 26B-A4B ("moe") or the 31B ("dense"), scaled down: 6 layers (two
    sliding, one global, twice), 4 query heads; sliding layers 2 K/V heads of 16, global layers 1 of 32."""
    cfg = read_json(HF_CONFIGS / PUBLISHED[kind] / "config.json")
    cfg.pop("quantization_config", None)  # the stand-in's NVFP4 block: the weights here are fp32
    t, v = cfg["text_config"], cfg["vision_config"]
    t.update(hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYERS), layer_types=list(LAYERS),
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_global_key_value_heads=1,
             global_head_dim=32, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, sliding_window=WINDOW,
             max_position_embeddings=512, dtype="float32", final_logit_softcapping=10.0)
    if kind == "moe":
        t.update(num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    t.update(text)
    v.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, head_dim=16, global_head_dim=16)
    cfg.update(image_token_id=151, video_token_id=152, boi_token_id=153, eoi_token_id=154, audio_token_id=155,
               boa_token_id=156, eoa_token_id=157, eoa_token_index=157, eos_token_id=[1, 106])
    return cfg


def save_gemma_target(folder, kind: str, seed: int = 0, scale: float = 3.0, **text):
    """A random tiny Gemma 4 saved as the published checkpoints are (Gemma4ForConditionalGeneration)."""
    import transformers
    from transformers import AutoConfig

    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(AutoConfig.for_model(**gemma_config(kind, **text))).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(scale)  # larger weights: varied greedy replies, and a wrong detail changes them
            elif "norm" in name or "scale" in name:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def gemma_drafter_config(block_size: int = 16) -> dict:
    """The published drafters' layout (4 sliding layers + 1 full, soft-capped logits), scaled down."""
    return drafter_config(dict(hidden_size=64, vocab_size=VOCAB, num_hidden_layers=len(LAYERS)), layers=5,
                          block_size=block_size, taps=(1, 2, 4), layer_types=["sliding_attention"] * 4 +
                          ["full_attention"], sliding_window=4, use_sliding_window=True, final_logit_softcapping=30.0)
