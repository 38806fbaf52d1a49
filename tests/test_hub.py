"""models/hub.py and models/cache.py against a loopback server speaking the Hub API, with the real client."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
from support.hub_fixtures import DRAFTER, JUNK, TARGET, cache, fake, online, read_folder, repo_files, server  # noqa: F401

from dflash_cli.models import cache as hub_cache
from dflash_cli.models import folders, hub


def _pull(fake, repo_id, cache, **kw):
    return hub.pull(repo_id, cache_dir=cache, endpoint=fake.endpoint, max_workers=2, **kw)


def test_allow_patterns_exclude_code_and_pickles():
    for path in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                 "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                 "qwen.tiktoken"]:
        assert hub.wanted(path), path
    for path in ["model.py", "tokenizer.py", "vocab.py", "pytorch_model.bin", "model.pt", "x.pth", "a.ckpt",
                 "b.pkl", "README.md", "tokenization_qwen.py"]:
        assert not hub.wanted(path), path


def test_pull_pair_loads_and_generates(fake, online, cache, repo_files):
    from dflash_cli.engine.generate import generate
    from dflash_cli.engine.load import load_pair

    target = _pull(fake, TARGET, cache)
    drafter = _pull(fake, DRAFTER, cache)
    got = {p.name for p in target.iterdir()}
    assert "model.safetensors" in got and "config.json" in got and "tokenizer.json" in got
    for folder in (target, drafter):
        names = [p.name for p in folder.rglob("*")]
        assert not [n for n in names if n.endswith((".py", ".bin"))], names
    assert not fake.gets("/model.py") and not fake.gets("/pytorch_model.bin")
    for name in ("model.safetensors", "config.json"):
        assert (target / name).read_bytes() == repo_files[TARGET][name]

    pair = load_pair(target, drafter, device="cpu", dtype="float32")
    result = generate(pair.target, pair.drafter, [5, 6, 7, 8], max_new_tokens=6)
    assert len(result.tokens) >= 1


def test_second_pull_offline_makes_zero_requests(fake, online, cache, monkeypatch):
    first = _pull(fake, TARGET, cache)
    fake.reset_requests()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_cache.local_snapshot(TARGET, cache_dir=cache) == first
    assert _pull(fake, TARGET, cache) == first
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert _pull(fake, TARGET, cache, local_files_only=True) == first
    assert fake.requests == []


def test_local_snapshot_names_what_is_missing(fake, online, cache):
    with pytest.raises(hub_cache.NotDownloadedError) as e:
        hub_cache.local_snapshot(TARGET, cache_dir=cache)
    assert str(e.value) == f"{TARGET} is not downloaded"
    assert e.value.hint == f"run `dflash-cli pull {TARGET}` (needs the network)"

    folder = _pull(fake, TARGET, cache)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(hub_cache.NotDownloadedError, match=r"partly downloaded: missing tokenizer\.json$"):
        hub_cache.local_snapshot(TARGET, cache_dir=cache)
    assert fake.gets("tokenizer.json")  # sanity: it was served by the pull


def test_revision_pinning(fake, online, cache, repo_files):
    old_sha = fake.repos[TARGET].refs["main"]
    newer = dict(repo_files[TARGET])
    newer["config.json"] = newer["config.json"].replace(b'"rms_norm_eps"', b'"custom_field": 1,\n  "rms_norm_eps"')
    new_sha = fake.add_revision(TARGET, newer)
    assert new_sha != old_sha

    latest = _pull(fake, TARGET, cache)
    assert latest.name == new_sha and (latest / "config.json").read_bytes() == newer["config.json"]
    pinned = _pull(fake, TARGET, cache, revision=old_sha)
    assert pinned.name == old_sha
    assert (pinned / "config.json").read_bytes() == repo_files[TARGET]["config.json"]
    with pytest.raises(hub.RevisionNotFoundError, match="revision 'nope' was not found in"):
        _pull(fake, TARGET, cache, revision="nope")


def test_cut_transfer_resumes_with_range(fake, online, cache, repo_files, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub keeps only whole chunks (10 MiB by default) of a dropped transfer: make them small.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    data = repo_files[TARGET]["model.safetensors"]
    cut = 4096 * 20
    assert len(data) > 2 * cut
    fake.cut_once("model.safetensors", cut)
    folder = _pull(fake, TARGET, cache)
    got = (folder / "model.safetensors").read_bytes()
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(data).hexdigest()
    ranges = [r.range for r in fake.gets("/model.safetensors")]
    assert len(ranges) == 2 and ranges[0] is None  # second request resumes where the first stopped
    assert ranges[1].startswith("bytes=") and 0 < int(ranges[1][6:-1]) <= cut and ranges[1].endswith("-")
    assert not list(cache.rglob("*.incomplete"))


def test_missing_repo(fake, online, cache):
    with pytest.raises(hub.RepoNotFoundError) as e:
        _pull(fake, "nobody/nothing", cache)
    assert str(e.value) == "repository nobody/nothing was not found on the Hub (or it is private)"
    assert e.value.hint


def _gate(fake, repo_files):
    fake.add_revision("acme/gated", repo_files[TARGET], gated="manual", allowed_tokens={"hf_good"})


def test_gated_without_token(fake, online, cache, repo_files):
    _gate(fake, repo_files)
    with pytest.raises(hub.GatedRepoError) as e:
        _pull(fake, "acme/gated", cache, token=False)
    assert str(e.value) == "acme/gated is gated: log in first"
    assert "hf auth login" in e.value.hint and "HF_TOKEN" in e.value.hint
    assert "https://huggingface.co/acme/gated" in e.value.hint
    assert fake.requests and all(r.authorization is None for r in fake.requests)


def test_gated_with_token_not_accepted(fake, online, cache, repo_files, monkeypatch):
    _gate(fake, repo_files)
    monkeypatch.setenv("HF_TOKEN", "hf_other")
    with pytest.raises(hub.GatedRepoError) as e:
        _pull(fake, "acme/gated", cache)
    assert str(e.value) == "acme/gated is gated and your account has not been granted access yet"
    assert e.value.hint == "accept the licence at https://huggingface.co/acme/gated, then pull again"
    assert any(r.authorization == "Bearer hf_other" for r in fake.requests)
    # with an accepted token it downloads
    assert (_pull(fake, "acme/gated", cache, token="hf_good") / "model.safetensors").is_file()


def test_pickle_only_repo_refused_before_download(fake, online, cache, repo_files):
    files = {k: v for k, v in repo_files[TARGET].items() if not k.endswith(".safetensors")}
    fake.add_revision("old/pickles", files)
    fake.reset_requests()
    with pytest.raises(hub.PickleOnlyRepoError) as e:
        _pull(fake, "old/pickles", cache)
    assert str(e.value).startswith("old/pickles has weights only as pickle files (pytorch_model.bin)")
    assert e.value.hint == "use a repository that ships *.safetensors weights"
    assert not [r for r in fake.requests if "/resolve/" in r.path]


def test_truncated_safetensors_is_corrupt(fake, online, cache, repo_files):
    files = dict(repo_files[DRAFTER])
    files["model.safetensors"] = files["model.safetensors"][:-100]
    fake.add_revision("bad/truncated", files)
    with pytest.raises(hub_cache.CorruptWeightsError) as e:
        _pull(fake, "bad/truncated", cache)
    assert "model.safetensors is corrupt or truncated" in str(e.value)
    assert "dflash-cli rm" in e.value.hint


def test_check_safetensors_garbage_header(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(hub_cache.CorruptWeightsError, match="header is not valid JSON"):
        hub_cache.check_safetensors(bad)
    bad.write_bytes(b"\x01")
    with pytest.raises(hub_cache.CorruptWeightsError, match="shorter than"):
        hub_cache.check_safetensors(bad)


def test_plan_download_sizes(fake, online, cache, repo_files):
    plan = hub.plan_download(TARGET, cache_dir=cache, endpoint=fake.endpoint)
    served = repo_files[TARGET]
    assert {f.path: f.size for f in plan.files} == {p: len(d) for p, d in served.items() if p not in JUNK}
    assert set(plan.skipped) == set(JUNK)
    assert plan.total_bytes == sum(len(d) for p, d in served.items() if p not in JUNK)
    assert plan.cached == () and plan.download_bytes == plan.total_bytes
    assert plan.commit == fake.repos[TARGET].refs["main"]
    infos = hub.repo_files(TARGET, endpoint=fake.endpoint)
    assert {f.path: f.size for f in infos} == {p: len(d) for p, d in served.items()}

    _pull(fake, TARGET, cache)
    again = hub.plan_download(TARGET, cache_dir=cache, endpoint=fake.endpoint)
    assert again.download_bytes == 0 and set(again.cached) == {f.path for f in again.files}


def test_fetch_configs_only(fake, online, cache, repo_files):
    folder = hub.fetch_configs(TARGET, cache_dir=cache, endpoint=fake.endpoint)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json"]
    assert json.loads((folder / "config.json").read_bytes()) == json.loads(repo_files[TARGET]["config.json"])
    assert not fake.gets("model.safetensors")
    # the partial snapshot does not pass for a full download
    with pytest.raises(hub_cache.NotDownloadedError, match="partly downloaded: missing .*model.safetensors"):
        hub_cache.local_snapshot(TARGET, cache_dir=cache)


def test_unreachable_hub(online, cache):
    import socket

    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"http://127.0.0.1:{port}"
    with pytest.raises(hub.HubUnreachableError) as e:
        hub.pull(TARGET, cache_dir=cache, endpoint=dead)
    assert str(e.value) == f"cannot reach the Hub at {dead} to get {TARGET}"
    assert "HF_HUB_OFFLINE=1" in e.value.hint
    with pytest.raises(hub.HubUnreachableError):
        hub.plan_download(TARGET, cache_dir=cache, endpoint=dead)


def test_unreachable_hub_uses_complete_cache(fake, online, cache):
    import socket

    folder = _pull(fake, TARGET, cache)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert hub.pull(TARGET, cache_dir=cache, endpoint=f"http://127.0.0.1:{port}") == folder


def test_list_and_remove(fake, online, cache):
    _pull(fake, TARGET, cache)
    _pull(fake, DRAFTER, cache)
    repos = {r.repo_id: r for r in hub_cache.list_local(cache)}
    assert set(repos) == {TARGET, DRAFTER}
    for r in repos.values():
        assert r.size_on_disk == sum(p.stat().st_size for p in (r.path / "blobs").iterdir())
        assert r.refs == ("main",) and len(r.revisions) == 1 and r.last_modified > 0

    freed = hub_cache.remove([DRAFTER], cache_dir=cache)
    assert freed == repos[DRAFTER].size_on_disk
    assert [r.repo_id for r in hub_cache.list_local(cache)] == [TARGET]
    assert hub_cache.local_snapshot(TARGET, cache_dir=cache).is_dir()
    with pytest.raises(hub_cache.NotDownloadedError, match="not in the local cache: tiny-org/qwen3-tiny-dflash"):
        hub_cache.remove([DRAFTER], cache_dir=cache)


def test_default_cache_follows_env(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert folders.default_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert folders.default_cache_dir() == tmp_path / "c"
    assert hub_cache.list_local() == []


HF_VARIABLES = ("HF_HOME", "XDG_CACHE_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN_PATH",
                "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TEST_NAME")


def test_cache_token_and_offline_are_read_as_huggingface_hub_reads_them(tmp_path):
    """What hub (and the doctor) read now equals what huggingface_hub works out at import from the same
    environment, among them the older HUGGINGFACE_HUB_CACHE over HF_HOME (once read by the doctor only)."""
    import os
    import subprocess
    import sys

    cases = [{}, {"XDG_CACHE_HOME": f"{tmp_path}/xdg"}, {"HF_HOME": f"{tmp_path}/home", "XDG_CACHE_HOME": "/x"},
             {"HF_HOME": f"{tmp_path}/home", "HUGGINGFACE_HUB_CACHE": f"{tmp_path}/legacy"},
             {"HUGGINGFACE_HUB_CACHE": f"{tmp_path}/legacy", "HF_HUB_CACHE": f"{tmp_path}/new"},
             {"HF_HOME": "~/hf-$HF_TEST_NAME", "HF_TEST_NAME": "x", "HF_TOKEN_PATH": f"{tmp_path}/token"},
             {"HF_HUB_OFFLINE": "yes"}, {"TRANSFORMERS_OFFLINE": "1"},
             {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}]
    script = f"""
import importlib, json, os, sys
from huggingface_hub import constants
from dflash_cli.models import folders
out = []
for case in json.loads(sys.argv[1]):
    for name in {HF_VARIABLES!r}:
        os.environ.pop(name, None)
    importlib.reload(constants)  # the library's own values without any of the variables
    os.environ.update(case)
    ours = [str(folders.default_cache_dir()), str(folders.token_path()), folders.offline_variable() is not None]
    importlib.reload(constants)
    out.append([ours, [constants.HF_HUB_CACHE, constants.HF_TOKEN_PATH, constants.HF_HUB_OFFLINE]])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k not in HF_VARIABLES} | {"HOME": str(tmp_path / "user")}
    run = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    for case, (ours, theirs) in zip(cases, json.loads(run.stdout), strict=True):
        assert ours == theirs, case


def test_on_off_variables_take_huggingface_hubs_words():
    from huggingface_hub import constants

    from dflash_cli.settings import TRUE_WORDS

    assert TRUE_WORDS == constants.ENV_VARS_TRUE_VALUES


def test_tqdm_class_sees_the_bytes(fake, online, cache):
    from tqdm.auto import tqdm

    bars: list[tqdm] = []

    class Recording(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            bars.append(self)

    plan = hub.plan_download(DRAFTER, cache_dir=cache, endpoint=fake.endpoint)
    _pull(fake, DRAFTER, cache, tqdm_class=Recording)
    assert plan.download_bytes in [b.total for b in bars]


def test_offline_at_import_time_in_a_subprocess(fake, online, cache):
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE set before huggingface_hub is imported (how a user runs the CLI)."""
    import os
    import subprocess
    import sys

    _pull(fake, TARGET, cache)
    fake.reset_requests()
    script = (
        "import sys\n"
        "from dflash_cli.models import cache, hub\n"
        f"print(hub.pull({TARGET!r}, endpoint={fake.endpoint!r}).name)\n"
        "try:\n"
        f"    hub.pull({DRAFTER!r}, endpoint={fake.endpoint!r})\n"
        "except cache.NotDownloadedError as e:\n"
        "    print(e, '|', e.hint)\n"
        "try:\n"
        f"    hub.plan_download({TARGET!r}, endpoint={fake.endpoint!r})\n"
        "except cache.NotDownloadedError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == fake.repos[TARGET].refs["main"]
    assert lines[1] == f"{DRAFTER} is not downloaded | run `dflash-cli pull {DRAFTER}` (needs the network)"
    assert lines[2] == f"cannot ask the Hub about {TARGET}: HF_HUB_OFFLINE is set"
    assert fake.requests == []


def test_fetch_configs_offline(fake, online, cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub_cache.NotDownloadedError, match=f"^{TARGET} is not downloaded$"):
        hub.fetch_configs(TARGET, cache_dir=cache, endpoint=fake.endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    folder = hub.fetch_configs(TARGET, cache_dir=cache, endpoint=fake.endpoint)
    fake.reset_requests()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.fetch_configs(TARGET, cache_dir=cache, endpoint=fake.endpoint) == folder
    assert fake.requests == []
