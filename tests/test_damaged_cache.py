"""Damaged cache entries and folders that cannot be written, through the real CLI (issue 23, E and B).

Cache entries are made the way huggingface_hub writes them (a real pull from the loopback FakeHub) and the
built-in model's conversion is the real one; then they are damaged on disk as a user, a disk or another
tool would. Read-only folders are made read-only for real: `chmod a-w` for an ordinary user; as root (whom
permissions do not stop) a read-only bind mount in a private mount namespace, and the test is skipped where
neither works. The root-proof variants put a file where a folder is expected.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.hub_fixtures import DRAFTER, TARGET, fake, online, server  # noqa: F401 (shared fixtures)
from support.models_cli import env, invoke, repo_files  # noqa: F401 (shared fixtures)


def _storage(cache: Path, repo_id: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}"


def _rows(stdout: str) -> dict[str, str]:
    """list's table: first word of each line -> the line."""
    lines = stdout.splitlines()
    assert lines and lines[0].split()[0] == "REPO", stdout
    return {line.split()[0]: line for line in lines[1:]}


def _json_rows() -> dict[str, dict]:
    result = invoke("list", "--json")
    assert result.exit_code == 0, result.output
    return {row["repo_id"]: row for row in json.loads(result.stdout)}


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("Error:", "Hint:"))]


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (links as their targets, folders as None), to tell that nothing changed."""
    out: dict[str, bytes | None] = {}
    for p in sorted(folder.rglob("*")):
        key = p.relative_to(folder).as_posix()
        out[key] = os.readlink(p).encode() if p.is_symlink() else None if p.is_dir() else p.read_bytes()
    return out


# -- a real read-only folder ----------------------------------------------------------------------------

_RO_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'


def _can_mount_read_only(folder: Path) -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", _RO_MOUNT + ' 2>/dev/null', str(folder), "sh", "-c",
                            'touch "$0/.probe" 2>/dev/null && exit 1 || exit 0', str(folder)],
                           capture_output=True, timeout=30)
    (folder / ".probe").unlink(missing_ok=True)
    return probe.returncode == 0


def run_read_only(folder: Path, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m dflash_cli ARGS` in a subprocess while `folder` (and all below it) is read-only."""
    cmd = [sys.executable, "-m", "dflash_cli", *args]
    environ = {**os.environ, **(env_extra or {})}
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")] if not p.is_symlink()}
        for p, mode in modes.items():
            p.chmod(mode & ~0o222)
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=environ)
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
    if not _can_mount_read_only(folder):
        pytest.skip("running as root, where chmod does not make a folder read-only, and a read-only bind "
                    "mount (unshare -m) is not allowed here")
    return subprocess.run(["unshare", "-m", "sh", "-c", _RO_MOUNT, str(folder), *cmd], capture_output=True,
                          text=True, timeout=300, env=environ)


# -- E: damaged Hub cache entries -----------------------------------------------------------------------

def test_a_repo_whose_blobs_are_gone_is_listed_as_damaged_and_rm_removes_the_pair(fake, online, env):
    assert invoke("pull", "tiny", endpoint=fake.endpoint).exit_code == 0
    for blob in (_storage(env, TARGET) / "blobs").iterdir():
        blob.unlink()

    listed = invoke("list")
    assert listed.exit_code == 0, listed.output
    rows = _rows(listed.stdout)
    assert set(rows) == {TARGET, DRAFTER}  # not silently left out
    assert rows[TARGET].split()[1:3] == ["tiny", "target"] and rows[TARGET].split()[-1] == "damaged"
    assert rows[DRAFTER].split()[-1] == "ok"
    assert f"{TARGET} is damaged" in listed.stderr and f"dflash-cli rm {TARGET} -y" in listed.stderr
    data = _json_rows()
    assert data[TARGET]["status"] == "damaged" and "missing" in data[TARGET]["problem"]
    assert data[DRAFTER]["status"] == "ok" and data[DRAFTER]["problem"] is None
    assert invoke("ls", "-q").stdout.split() == [TARGET, DRAFTER]

    removed = invoke("rm", "tiny", "-y")
    assert removed.exit_code == 0, removed.output
    assert "not downloaded" not in removed.stderr and "damaged" in removed.stderr
    assert f"removed {TARGET}, {DRAFTER}" in removed.stderr
    assert not _storage(env, TARGET).exists() and not _storage(env, DRAFTER).exists()
    assert invoke("ls", "-q").stdout == ""


def _no_snapshots(storage: Path) -> None:
    shutil.rmtree(storage / "snapshots")


def _ref_to_nowhere(storage: Path) -> None:
    (storage / "refs" / "main").write_text("0" * 40)


def _a_file(storage: Path) -> None:
    shutil.rmtree(storage)
    storage.write_text("not a folder")


def _blobs_gone(storage: Path) -> None:
    shutil.rmtree(storage / "blobs")


@pytest.mark.parametrize("damage, why", [
    (_blobs_gone, "6 files are missing from its blobs: chat_template.jinja, config.json, generation_config.json (+3"),
    (_no_snapshots, "its snapshots folder is missing"),
    (_ref_to_nowhere, "refs/main points at a snapshot that is not there"),
    (_a_file, "not a folder")])
def test_every_kind_of_damaged_repo_is_listed_and_removable_by_repo_id(fake, online, env, damage, why):
    assert invoke("pull", TARGET, "--no-draft", endpoint=fake.endpoint).exit_code == 0
    storage = _storage(env, TARGET)
    damage(storage)

    listed = invoke("list")
    assert listed.exit_code == 0, listed.output
    assert _rows(listed.stdout)[TARGET].split()[-1] == "damaged"
    assert why in _json_rows()[TARGET]["problem"]
    assert f"warning: {TARGET} is damaged ({why}" in listed.stderr

    removed = invoke("rm", TARGET, "-y")
    assert removed.exit_code == 0, removed.output
    assert not os.path.lexists(storage)
    assert invoke("ls", "-q").stdout == ""
    again = invoke("rm", TARGET, "-y")
    assert again.exit_code == 1 and "not in the local cache" in again.stderr


def test_truncated_weights_and_a_missing_file_are_shown(fake, online, env):
    assert invoke("pull", "tiny", endpoint=fake.endpoint).exit_code == 0
    weights = next((_storage(env, TARGET) / "snapshots").iterdir()) / "model.safetensors"
    blob = weights.resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[: len(data) // 2])  # a disk or a copy that stopped half-way
    tokenizer = next((_storage(env, DRAFTER) / "snapshots").iterdir()) / "config.json"
    tokenizer.unlink()  # a file of the snapshot deleted by hand: the repo is only partly there

    data = _json_rows()
    assert data[TARGET]["status"] == "damaged" and "model.safetensors" in data[TARGET]["problem"]
    assert data[DRAFTER]["status"] == "partial" and "config.json" in data[DRAFTER]["problem"]
    listed = invoke("list")
    rows = _rows(listed.stdout)
    assert rows[TARGET].split()[-1] == "damaged" and rows[DRAFTER].split()[-1] == "partial"
    assert f"dflash-cli pull {DRAFTER}" in listed.stderr


# -- E: the built-in model's conversion -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["demo", "smollm2-135m"])
def test_a_damaged_conversion_is_listed_as_damaged_and_rm_removes_only_the_conversion(smollm2_converted, name):
    from dflash_cli.models.registry import demo_drafter_dir
    from dflash_cli.models.smollm2 import gguf_path, is_converted, smollm2_dir

    folder = smollm2_dir()
    shutil.copytree(smollm2_converted.folder, folder)
    assert is_converted()
    rows = _rows(invoke("list").stdout)
    assert rows["smollm2-135m"].split()[-1] == "ok"

    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 1000)
    listed = invoke("list")
    assert _rows(listed.stdout)["smollm2-135m"].split()[-1] == "damaged"
    assert "smollm2-135m is damaged" in listed.stderr and "dflash-cli rm demo -y" in listed.stderr
    assert _json_rows()["smollm2-135m"]["status"] == "damaged"

    gguf = gguf_path()
    stamp = (gguf.stat().st_size, gguf.stat().st_mtime_ns)
    refused = invoke("rm", name)  # stdin is not a terminal: asks for -y like any other rm
    assert refused.exit_code == 2 and folder.is_dir()
    removed = invoke("rm", name, "-y")
    assert removed.exit_code == 0, removed.output
    assert "freed" in removed.stderr and str(folder) in removed.stderr
    assert not folder.exists()
    assert (gguf.stat().st_size, gguf.stat().st_mtime_ns) == stamp  # the wheel's GGUF source stays
    assert (demo_drafter_dir() / "config.json").is_file()  # and so does the shipped drafter
    assert invoke("ls", "-q").stdout == ""
    gone = invoke("rm", name, "-y")
    assert gone.exit_code == 1 and "not converted" in gone.stderr and len(_error_lines(gone.stderr)) == 2


# -- B: folders that cannot be written ------------------------------------------------------------------

def test_pull_into_a_cache_under_a_file_is_one_clear_line(fake, online, env, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    for cache in (blocker, blocker / "hub"):
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        result = invoke("pull", "tiny", endpoint=fake.endpoint)
        assert result.exit_code == 1, result.output
        lines = _error_lines(result.stderr)
        assert len(lines) == 2 and lines == result.stderr.splitlines()[-2:], result.stderr
        assert lines[0].startswith("Error: cannot write") and f"{blocker} is a file, not a folder" in lines[0]
        assert "HF_HUB_CACHE" in lines[1]
        assert "Traceback" not in result.stderr and "Ignored error" not in result.stderr
        assert blocker.read_text() == "x"


def test_pull_into_a_read_only_cache_is_one_clear_line_and_writes_nothing(fake, online, env):
    env.mkdir(parents=True)
    result = run_read_only(env, "pull", "tiny", "--endpoint", fake.endpoint)
    assert result.returncode == 1, result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 2 and lines == result.stderr.splitlines()[-2:], result.stderr
    assert lines[0].startswith(f"Error: cannot write the download of {TARGET} in {env}: ")
    assert lines[0].endswith(("read-only file system", "permission denied"))
    assert lines[1].startswith(f"Hint: make {env} writable, or point HF_HUB_CACHE (or HF_HOME) at a writable folder "
                               "with ") and lines[1].endswith(" KiB free")
    assert "Traceback" not in result.stderr and "Ignored error" not in result.stderr
    assert _tree(env) == {}


def test_reading_configs_into_a_cache_that_cannot_be_written_is_one_clear_line(fake, online, env, tmp_path,
                                                                             monkeypatch):
    """show (and generate) fetch a pair's config.json alone before any weights: into the cache too."""
    env.mkdir(parents=True)
    result = run_read_only(env, "show", "tiny", "--endpoint", fake.endpoint)
    assert result.returncode == 1, result.stderr
    assert _error_lines(result.stderr) == result.stderr.splitlines() == [
        f"Error: cannot write the configs of {TARGET} in {env}: "
        + ("read-only file system" if os.geteuid() == 0 else "permission denied"),
        f"Hint: make {env} writable, or point HF_HUB_CACHE (or HF_HOME) at a writable folder"]
    assert _tree(env) == {}

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("HF_HUB_CACHE", str(blocker / "hub"))
    shown = invoke("show", "tiny", endpoint=fake.endpoint)
    assert shown.exit_code == 1 and shown.stdout == ""
    assert shown.stderr.splitlines() == [
        f"Error: cannot write the configs of {TARGET}: {blocker} is a file, not a folder",
        f"Hint: move {blocker} away, or point HF_HUB_CACHE (or HF_HOME) at a folder"]


def test_a_complete_read_only_cache_still_pulls_and_rm_there_is_one_clear_line(fake, online, env):
    assert invoke("pull", "tiny", endpoint=fake.endpoint).exit_code == 0
    before = _tree(env)
    pulled = run_read_only(env, "pull", "tiny", "--endpoint", fake.endpoint)
    assert pulled.returncode == 0, pulled.stderr  # nothing to write: a shared read-only cache works
    assert "ready: dflash-cli chat -m tiny" in pulled.stderr and "Ignored error" not in pulled.stderr

    removed = run_read_only(env, "rm", "tiny", "-y")
    assert removed.returncode == 1, removed.stderr
    lines = _error_lines(removed.stderr)
    assert len(lines) == 2 and lines == removed.stderr.splitlines()[-2:], removed.stderr
    assert lines[0].startswith(f"Error: cannot remove {TARGET} from {env}: ")
    assert "freed" not in removed.stderr and "Traceback" not in removed.stderr
    assert _tree(env) == before  # nothing removed, nothing half-removed


def _needs_the_wheel() -> None:
    from dflash_cli.models.smollm2 import SmolLM2NotInstalled, gguf_path

    try:
        gguf_path()
    except SmolLM2NotInstalled as e:
        pytest.skip(str(e))


def test_generate_demo_with_a_cache_under_a_file_is_one_clear_line(tmp_path, monkeypatch):
    _needs_the_wheel()
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    for cache in (blocker, blocker / "cache"):
        monkeypatch.setenv("DFLASH_CACHE_DIR", str(cache))
        result = invoke("generate", "-m", "demo", "hi")
        assert result.exit_code == 1, result.output
        lines = _error_lines(result.stderr)
        assert len(lines) == 2 and lines == result.stderr.splitlines()[-2:], result.stderr
        assert lines[0] == (f"Error: cannot write the SmolLM2-135M-Instruct conversion: {blocker} is a file, "
                            "not a folder")
        assert lines[1] == f"Hint: move {blocker} away, or point DFLASH_CACHE_DIR at a folder"
        assert result.stdout == "" and blocker.read_text() == "x"


def test_generate_demo_with_a_read_only_cache_is_one_clear_line_and_writes_nothing(tmp_path):
    _needs_the_wheel()
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    result = run_read_only(cache, "generate", "-m", "demo", "hi", env_extra={"DFLASH_CACHE_DIR": str(cache)})
    assert result.returncode == 1, result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 2 and lines == result.stderr.splitlines()[-2:], result.stderr
    assert lines[0].startswith(f"Error: cannot write the SmolLM2-135M-Instruct conversion in {cache / 'models'}: ")
    assert lines[0].endswith(("read-only file system", "permission denied"))
    assert lines[1] == (f"Hint: make {cache / 'models'} writable, or point DFLASH_CACHE_DIR at a writable folder "
                        "with about 350 MB free")
    assert result.stdout == "" and _tree(cache) == {"models": None}


@pytest.mark.slow
def test_a_conversion_onto_a_full_disk_is_one_clear_line_and_leaves_no_half_written_folder(tmp_path):
    _needs_the_wheel()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a small disk is simulated with a tmpfs in a private mount namespace, which needs root")
    cache, listing = tmp_path / "small-disk", tmp_path / "left-behind.txt"
    cache.mkdir()
    script = ('mount -t tmpfs -o size=40m tmpfs "$0" || exit 99; "$@" 2>"$0.err"; rc=$?; '
              f'(cd "$0" && find . -mindepth 1 | sort) > {listing}; cat "$0.err" >&2; exit $rc')
    result = subprocess.run(["unshare", "-m", "sh", "-c", script, str(cache), sys.executable, "-m", "dflash_cli",
                             "generate", "-m", "demo", "hi"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DFLASH_CACHE_DIR": str(cache)})
    if result.returncode == 99:
        pytest.skip("tmpfs cannot be mounted here")
    assert result.returncode == 1, result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 2 and lines == result.stderr.splitlines()[-2:], result.stderr
    assert lines[0] == f"Error: cannot write the SmolLM2-135M-Instruct conversion in {cache / 'models'}: " \
                       "no space left on device"
    assert lines[1].startswith("Hint: free about 350 MB there, or point DFLASH_CACHE_DIR at")
    # the half-written conversion was removed; only the (empty) lock file stays
    assert listing.read_text().split() == ["./models", "./models/.smollm2-135m-instruct.lock"]


def test_a_complete_conversion_is_used_when_its_marker_cannot_be_refreshed(tmp_path):
    """Another install of the same wheel (new path or mtime, same bytes) refreshes the marker's stamp: in a
    folder that cannot be written the refresh is skipped, and the conversion is still used."""
    import torch
    from safetensors.torch import save_file

    from dflash_cli.models import smollm2, smollm2_convert

    _needs_the_wheel()
    gguf = smollm2.gguf_path()
    target = smollm2.smollm2_dir(tmp_path)
    target.mkdir(parents=True)
    for name in smollm2_convert.REQUIRED_FILES:
        if name.endswith(".safetensors"):
            save_file({"w": torch.zeros(2)}, str(target / name))
        else:
            (target / name).write_text("{}")
    marker = {"format": smollm2._MARKER_FORMAT, "dtype": "bfloat16", "source": "/elsewhere/" + gguf.name,
              "source_size": gguf.stat().st_size, "source_mtime_ns": gguf.stat().st_mtime_ns - 10**9,
              "source_sha256": hashlib.sha256(gguf.read_bytes()).hexdigest()}
    (target / ".complete").write_text(json.dumps(marker))
    (target / ".complete.tmp").mkdir()  # where the refreshed marker would be written: the write fails for real
    messages: list[str] = []
    assert smollm2.ensure_smollm2(tmp_path, on_status=messages.append) == target
    assert messages == []  # used as it is, not converted again
    assert json.loads((target / ".complete").read_text()) == marker
