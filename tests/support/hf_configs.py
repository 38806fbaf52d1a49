"""The published config.json files in data/hf-configs (SOURCES.md names where each came from)."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent.parent / "data" / "hf-configs"


def cfg(name: str) -> dict:
    """The config.json stored under `name` (an org__repo folder)."""
    return json.loads((DATA / name / "config.json").read_text())


# Qwen/Qwen3-Coder-Next: no exact copy of its config was found; these are the fields SOURCES.md lists
# ("New pairs"), in transformers' Qwen3NextConfig names. No layer_types: full_attention_interval decides.
QWEN3_CODER_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "partial_rotary_factor": 0.25, "full_attention_interval": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "intermediate_size": 5120,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 151936,
    "max_position_embeddings": 262144, "rope_theta": 5000000, "tie_word_embeddings": False,
}
