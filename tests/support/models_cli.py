"""The model commands (pull, list, show, rm) through the CLI: four repos on the FakeHub, a private cache and a
config file naming two user pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import save_tiny_pair

from dflash_cli.ui.cli import cli
from support.hub_fixtures import DRAFTER, JUNK, TARGET, read_folder

OTHER_T, OTHER_D = "other-org/qwen3-tiny", "other-org/qwen3-tiny-dflash"


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("hub-src")
    target, drafter = save_tiny_pair(root)
    t, d = {**read_folder(target), **JUNK}, {**read_folder(drafter), **JUNK}
    return {TARGET: t, DRAFTER: d, OTHER_T: t, OTHER_D: d}


@pytest.fixture
def env(tmp_path, monkeypatch) -> Path:
    """A private Hub cache and a config file naming two user pairs."""
    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("DFLASH_QUANT", raising=False)
    config = tmp_path / "config.toml"
    config.write_text(f'[pairs.tiny]\ntarget = "{TARGET}"\ndrafter = "{DRAFTER}"\nblock_size = 8\n'
                      f'notes = "a tiny test pair"\n\n'
                      f'[pairs.other]\ntarget = "{OTHER_T}"\ndrafter = "{OTHER_D}"\n')
    monkeypatch.setenv("DFLASH_CONFIG", str(config))
    return cache


def invoke(*args: str, endpoint: str | None = None, input: str | None = None):
    extra = ["--endpoint", endpoint] if endpoint and args[0] in ("pull", "show") else []
    return CliRunner().invoke(cli, [*args, *extra], input=input)
