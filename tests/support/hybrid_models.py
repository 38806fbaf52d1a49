"""The hybrid families (Qwen3.5 dense and MoE, Qwen3-Next): tiny targets, fitting drafters, loaded pairs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conftest import VOCAB, drafter_config, save_hybrid_target, save_qwen3_next_target, save_random_drafter

from dflash_cli.engine.load import load_pair


@dataclass(frozen=True)
class Family:
    """A hybrid family's tiny target, the drafter that fits it, and the cases its tests run."""

    save_target: Callable[[Path], Path]
    layers: int
    taps: tuple[int, ...]
    block_size: int = 8  # the drafter's
    block_sizes: tuple[int, ...] = (3, 8)  # greedy speculation's
    boundaries: tuple[int, ...] = (63, 64, 65, 127, 128, 129)  # prompt lengths around 64-token chunks


FAMILIES = {
    "qwen3_5": Family(lambda folder: save_hybrid_target(folder, seed=3), 4, (0, 2, 3)),
    "qwen3_5_moe": Family(lambda folder: save_hybrid_target(folder, moe=True, seed=3), 4, (0, 2, 3)),
    "qwen3_next": Family(lambda folder: save_qwen3_next_target(folder, seed=3), 8, (1, 3, 6, 7), block_size=16,
                         block_sizes=(3, 8, 16)),
}


def save_family(name: str, root: Path, block_size: int | None = None) -> tuple[Path, Path]:
    """(target, drafter) folders of family `name`; `block_size` replaces the drafter's."""
    family = FAMILIES[name]
    target = family.save_target(root / "target")
    drafter = save_random_drafter(root / "drafter", drafter_config(
        dict(hidden_size=64, vocab_size=VOCAB, num_hidden_layers=family.layers), taps=family.taps,
        block_size=block_size or family.block_size), seed=2)
    return target, drafter


def load_family(name: str, root: Path):
    pair = load_pair(*save_family(name, root), device="cpu", dtype="float32")
    assert pair.target.hybrid and pair.target.enable_fast_path(400, pad_to=FAMILIES[name].block_size) is None
    return pair
