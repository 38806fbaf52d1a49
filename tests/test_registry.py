"""The registry of known pairs: shipped data, user additions, and how a model name finds its drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_cli.engine.drafter import DrafterConfig
from dflash_cli.models.registry import RegistryError, find_pair, load_registry

DATA = Path(__file__).parent / "data" / "hf-configs"


def test_shipped_pairs_cover_the_published_drafters():
    registry = load_registry()
    expected = {"qwen3-4b": "z-lab/Qwen3-4B-DFlash-b16", "qwen3-8b": "z-lab/Qwen3-8B-DFlash-b16",
                "llama3.1-8b": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
                "qwen3-coder-30b-a3b": "z-lab/Qwen3-Coder-30B-A3B-DFlash", "gpt-oss-20b": "z-lab/gpt-oss-20b-DFlash"}
    for alias, drafter in expected.items():
        assert registry[alias].drafter == drafter and registry[alias].unsupported is None
    assert registry["llama3.1-8b"].block_size == 10
    assert registry["qwen3-8b"].thinking is False
    # the hybrid Qwen3.5/3.6 targets run (exact linear-attention rollback); their drafters think
    for size in ("3.5-4b", "3.5-9b", "3.5-27b", "3.5-35b-a3b", "3.5-122b-a10b", "3.6-27b", "3.6-35b-a3b"):
        entry = registry[f"qwen{size}"]
        assert entry.unsupported is None and entry.thinking is True and entry.block_size == 16
        assert entry.drafter == f"z-lab/{entry.target.split('/')[1]}-DFlash"


def test_block_sizes_agree_with_the_published_drafter_configs():
    registry = load_registry()
    qwen3_4b = DrafterConfig.from_dict(json.loads((DATA / "z-lab__Qwen3-4B-DFlash-b16" / "config.json").read_text()))
    assert registry["qwen3-4b"].block_size == qwen3_4b.block_size
    qwen35 = DrafterConfig.from_dict(json.loads((DATA / "z-lab__Qwen3.5-4B-DFlash" / "config.json").read_text()))
    assert registry["qwen3.5-4b"].block_size == qwen35.block_size


def test_find_by_alias_repo_id_folder_and_hub_cache_path(tmp_path):
    registry = load_registry()
    assert find_pair("Qwen3-8B", registry).alias == "qwen3-8b"  # aliases ignore case
    assert find_pair("Qwen/Qwen3-8B", registry).drafter == "z-lab/Qwen3-8B-DFlash-b16"
    folder = tmp_path / "Qwen3-4B"
    folder.mkdir()
    assert find_pair(str(folder), registry).alias == "qwen3-4b"
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert find_pair(str(snapshot), registry).alias == "llama3.1-8b"
    other = tmp_path / "my-model"
    other.mkdir()
    assert find_pair(str(other), registry) is None


def test_user_pairs_add_and_override():
    registry = load_registry({"mine": {"target": "me/target", "drafter": "me/drafter", "block_size": 8},
                              "qwen3-8b": {"target": "Qwen/Qwen3-8B", "drafter": "me/better-drafter"}})
    assert registry["mine"].source == "config" and registry["mine"].block_size == 8
    assert registry["qwen3-8b"].drafter == "me/better-drafter"


@pytest.mark.parametrize("raw, message", [({"drafter": "x/y"}, "needs a 'target'"),
                                          ({"target": "a/b", "blocksize": 8}, "unknown field")])
def test_malformed_user_pairs_are_named(raw, message):
    with pytest.raises(RegistryError, match=message):
        load_registry({"broken": raw})
