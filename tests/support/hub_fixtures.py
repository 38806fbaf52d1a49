"""Fixtures for tests that talk to the loopback FakeHub: a tiny target and drafter, each in its own repo (with code
and pickle files beside it that must never be downloaded), the server, an online environment, a cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import save_tiny_pair

from support.fake_hub import FakeHub

TARGET = "tiny-org/qwen3-tiny"
DRAFTER = "tiny-org/qwen3-tiny-dflash"
JUNK = {"model.py": b"raise SystemExit('never run me')\n", "pytorch_model.bin": b"\x80\x04pickle" * 50}


def read_folder(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("hub-src")
    target, drafter = save_tiny_pair(root)
    return {TARGET: {**read_folder(target), **JUNK}, DRAFTER: {**read_folder(drafter), **JUNK}}


@pytest.fixture(scope="module")
def server():
    fake = FakeHub()
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def fake(server, repo_files):
    server.repos.clear()
    server.reset_requests()
    for repo_id, files in repo_files.items():
        server.add_revision(repo_id, files)
    return server


@pytest.fixture
def online(monkeypatch):
    """conftest sets HF_HUB_OFFLINE=1 for every test; these tests talk to the loopback server."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "hub-cache"
