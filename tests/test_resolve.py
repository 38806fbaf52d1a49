"""--model values -> folders: registry pairs, preflight from configs before weights, download on first use."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import drafter_config, save_random_drafter, target_config
from support.hub_fixtures import DRAFTER, TARGET, cache, fake, online, read_folder, repo_files, server  # noqa: F401

from dflash_cli.engine.errors import CheckpointError, IncompatiblePairError, UnsupportedModelError
from dflash_cli.models.cache import NotDownloadedError
from dflash_cli.models.resolve import resolve_pair

WIDE = "tiny-org/wide-dflash"


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    path.write_text(f'[pairs.tiny]\ntarget = "{TARGET}"\ndrafter = "{DRAFTER}"\n\n'
                    f'[pairs.mismatched]\ntarget = "{TARGET}"\ndrafter = "{WIDE}"\n')
    monkeypatch.setenv("DFLASH_CONFIG", str(path))
    return path


def weight_downloads(fake) -> int:
    return len([r for r in fake.requests if "/resolve/" in r.path and r.path.endswith(".safetensors")])


def test_alias_downloads_the_pair_on_first_use_then_works_offline(fake, online, config, monkeypatch):
    notes = []
    pair = resolve_pair("tiny", endpoint=fake.endpoint, on_status=notes.append)
    assert (pair.target_dir / "model.safetensors").is_file() and (pair.drafter_dir / "config.json").is_file()
    assert "paired with tiny" in pair.drafter_note
    assert any(note.startswith(f"Downloading {TARGET}:") for note in notes)  # says what and how much first
    fake.reset_requests()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = resolve_pair("tiny", endpoint=fake.endpoint)
    assert again.target_dir == pair.target_dir and fake.requests == []


def test_a_mismatched_pair_is_refused_before_any_weights_download(fake, online, config, tmp_path):
    wide = save_random_drafter(tmp_path / "wide", drafter_config(target_config(hidden_size=96)))
    fake.add_revision(WIDE, read_folder(wide))
    fake.reset_requests()
    with pytest.raises(IncompatiblePairError, match="hidden size 96"):
        resolve_pair("mismatched", endpoint=fake.endpoint)
    assert weight_downloads(fake) == 0


def test_offline_and_not_downloaded_names_the_command(fake, config, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NotDownloadedError) as err:
        resolve_pair("tiny", endpoint=fake.endpoint)
    assert "pull" in err.value.hint and fake.requests == []


def test_unsupported_pairs_are_refused_with_the_reason(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    path.write_text('[pairs.later]\ntarget = "a/b"\nunsupported = "mamba layers cannot roll back yet"\n')
    monkeypatch.setenv("DFLASH_CONFIG", str(path))
    with pytest.raises(UnsupportedModelError, match="mamba layers cannot roll back yet"):
        resolve_pair("later")


def test_no_draft_and_explicit_folders(tiny_models):
    plain = resolve_pair(str(tiny_models["qwen3"]), no_draft=True)
    assert plain.drafter_dir is None and "--no-draft" in plain.drafter_note
    explicit = resolve_pair(str(tiny_models["qwen3"]), str(tiny_models["qwen3-drafter"]))
    assert explicit.drafter_dir == tiny_models["qwen3-drafter"]
    unknown = resolve_pair(str(tiny_models["qwen3"]))
    assert unknown.drafter_dir is None and "no drafter known" in unknown.drafter_note
    json.loads((plain.target_dir / "config.json").read_text())


@pytest.mark.parametrize("text, problem", [
    ("{oops", "is not valid JSON: Expecting"), (b"\xff{}", "is not valid JSON"),
    ("[1, 2]", "is not a model configuration (expected a JSON object)")])
def test_every_reader_words_a_bad_config_json_alike(tiny_models, tmp_path, text, problem):
    """One reader of config.json (engine/pairing.py): the loader, the preflight and `show` say the same."""
    import shutil

    from click.testing import CliRunner

    from dflash_cli.engine.pairing import read_config
    from dflash_cli.ui.cli import cli

    folder = Path(shutil.copytree(tiny_models["qwen3"], tmp_path / "target"))
    path = folder / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    message = f"{path} {problem}"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        read_config(folder, "target")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        resolve_pair(str(folder), str(tiny_models["qwen3-drafter"]))
    shown = CliRunner().invoke(cli, ["show", str(folder), "--json"])
    assert json.loads(shown.stdout)["configs"]["target"].startswith(message), shown.output


def test_an_impossible_plan_is_refused_before_any_weights_download(fake, online, config):
    from dflash_cli.models.memory.preflight import MemoryBudget, MemoryPlanError

    fake.reset_requests()
    with pytest.raises(MemoryPlanError) as err:
        resolve_pair("tiny", endpoint=fake.endpoint, quant="auto",
                     budget=MemoryBudget(1 << 20, 8192, "bf16", "GPU memory"))
    assert "GiB of GPU memory are free" in str(err.value) and "target" in str(err.value)
    assert err.value.hint and weight_downloads(fake) == 0
    fits = resolve_pair("tiny", endpoint=fake.endpoint, quant="auto",
                        budget=MemoryBudget(64 << 30, 8192, "bf16", "GPU memory"))
    assert fits.quant == "none"  # the best quality that fits: no quantization


def test_a_pair_too_big_for_one_of_several_gpus_is_pointed_at_a_split():
    from conftest import target_config

    from dflash_cli.models.memory.preflight import MemoryBudget, MemoryPlanError, preflight_memory

    target_cfg = target_config("qwen3")
    hints = {}
    for gpus in (1, 4):
        with pytest.raises(MemoryPlanError) as err:
            preflight_memory(target_cfg, None, "none", MemoryBudget(1 << 20, 8192, "bf16", "GPU memory", "cuda:0",
                                                                    gpus=gpus), "tiny")
        hints[gpus] = err.value.hint
    assert hints[4].startswith("--device-map auto splits it over the 4 GPUs; ")
    assert "--device-map" not in hints[1]


def test_quant_auto_from_the_command_line(tiny_models, tmp_path):
    import shutil

    from click.testing import CliRunner
    from conftest import save_tiny_tokenizer

    from dflash_cli.ui.cli import cli

    target = tmp_path / "target"
    shutil.copytree(tiny_models["qwen3"], target)
    save_tiny_tokenizer(target)
    result = CliRunner().invoke(cli, ["generate", "-m", str(target), "--draft",
                                      str(tiny_models["qwen3-drafter"]), "--quant", "auto", "-n", "3",
                                      "--dtype", "float32", "--device", "cpu", "--json"], input="1 2 3")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["generated_tokens"] == 3


def test_a_block_size_the_drafter_cannot_take_is_refused_before_any_weights_download(fake, online, config):
    """`generate -m NAME --block-size 99` must not fetch gigabytes to say the drafter drafts blocks of 8."""
    from dflash_cli.engine.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError, match=r"block size 99 is outside 1\.\.\d+") as err:
        resolve_pair("tiny", endpoint=fake.endpoint, block_size=99)
    assert "--block-size" in err.value.hint and weight_downloads(fake) == 0
    pair = resolve_pair("tiny", endpoint=fake.endpoint, block_size=2)  # a size it takes: the pair downloads
    assert pair.block_size >= 2 and weight_downloads(fake) > 0
