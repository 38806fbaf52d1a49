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


# issue 27's table: (alias, target, drafter, block size); the drafters' configs are unpublished, these values
# are SOURCES.md's "New pairs"
NEW_PAIRS = [
    ("gemma-4-31b", "google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash", 16),
    ("gemma-4-26b-a4b", "google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash", 16),
    ("qwen3-coder-next", "Qwen/Qwen3-Coder-Next", "z-lab/Qwen3-Coder-Next-DFlash", 16),
    ("gpt-oss-120b", "openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", 10),
    ("gpt-oss-20b", "openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", 8),
    ("kimi-k2.5", "moonshotai/Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash", 8),
    ("glm-5.1", "zai-org/GLM-5.1-FP8", "z-lab/GLM-5.1-FP8-DFlash", 8),
]


@pytest.mark.parametrize(("alias", "target", "drafter", "block"), NEW_PAIRS, ids=[p[0] for p in NEW_PAIRS])
def test_the_new_pairs_with_their_drafters_and_block_sizes(alias, target, drafter, block):
    entry = load_registry()[alias]
    assert (entry.target, entry.drafter, entry.block_size) == (target, drafter, block)
    assert entry.unsupported is None and entry.notes
    assert find_pair(target, load_registry()).alias == alias


def test_which_pairs_run_here_and_which_on_a_server():
    registry = load_registry()
    engine = {alias for alias, e in registry.items() if e.engine_only}
    assert engine == {"kimi-k2.5", "glm-5.1"}
    for alias in engine:
        assert registry[alias].runs == "engine" and registry[alias].serve_tp == 8
    assert registry["kimi-k2.5"].trust_remote_code and not registry["glm-5.1"].trust_remote_code
    for alias in set(registry) - engine:
        assert registry[alias].runs == "local" and registry[alias].serve_tp is None
    # thinking: Qwen3-Coder-Next has no thinking mode; the other new drafters' training mode is not published
    assert registry["qwen3-coder-next"].thinking is False
    for alias in ("gemma-4-31b", "gemma-4-26b-a4b", "gpt-oss-120b", "kimi-k2.5", "glm-5.1"):
        assert registry[alias].thinking is None


def test_a_user_pair_can_be_engine_only():
    registry = load_registry({"big": {"target": "org/huge", "drafter": "org/huge-dflash", "block_size": 8,
                                      "runs": "engine", "serve_tp": 16}})
    assert registry["big"].engine_only and registry["big"].serve_tp == 16


@pytest.mark.parametrize("raw, message", [
    ({"target": "a/b", "runs": "cluster"}, "neither"),
    ({"target": "a/b", "serve_tp": 0}, "serve_tp must be a positive integer"),
    ({"target": "a/b", "block_size": "16"}, "block_size must be a positive integer"),
    ({"target": "a/b", "trust_remote_code": "yes"}, "trust_remote_code must be true or false"),
])
def test_bad_values_of_the_new_fields_are_named(raw, message):
    with pytest.raises(RegistryError, match=message):
        load_registry({"broken": raw})
