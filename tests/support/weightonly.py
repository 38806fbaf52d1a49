"""Weight-only quantization inputs: a seeded random Linear, GGUF Q4_1 bytes, the `pairs` fixture, and a pair's
drafter with a draft vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn


def linear(out_features: int, in_features: int, seed: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(seed)
    m = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        m.weight.normal_(0, 0.05)
    return m


def q4_1_bytes(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """GGUF Q4_1 blocks as llama.cpp writes them: d, m (fp16), then 16 bytes, weights 0-15 in the low
    nibbles and 16-31 in the high ones."""
    rows, cols = codes.shape
    blocks = codes.reshape(rows, cols // 32, 32).astype(np.uint8)
    qs = blocks[..., :16] | (blocks[..., 16:] << 4)
    head = np.concatenate([d.astype(np.float16)[..., None].view(np.uint8),
                           m.astype(np.float16)[..., None].view(np.uint8)], axis=-1)
    return np.concatenate([head.reshape(rows, cols // 32, 4), qs], axis=-1).reshape(rows, -1)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from conftest import drafter_config, save_random_drafter, save_target, target_config

    root = tmp_path_factory.mktemp("weightonly")
    out = {}
    for family in ("qwen3", "llama"):
        cfg = target_config(family)
        out[family] = (save_target(root / family, cfg, seed=1, scale=3.0),
                       save_random_drafter(root / f"{family}-drafter", drafter_config(cfg), seed=2))
    return out


def with_draft_vocab(folders, root):
    """The pair `folders` (target, drafter) with the drafter saved again under `root` with a draft vocabulary of
    75 of the 160 ids (2, 4, .., 150: its head padded to 80 rows for the kernels)."""
    from safetensors.torch import load_file, save_file

    target_dir, drafter_dir = folders
    tensors = load_file(str(drafter_dir / "model.safetensors"))
    tensors["draft_vocab"] = torch.arange(2, 152, 2)
    folder = root / "drafter"
    folder.mkdir()
    (folder / "config.json").write_bytes((drafter_dir / "config.json").read_bytes())
    save_file(tensors, str(folder / "model.safetensors"))
    return target_dir, folder
