"""`dflash-cli doctor`: the environment report, on a CPU-only or a GPU machine (conftest isolates HF_HOME and
the dflash dirs)."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch
from click.testing import CliRunner

from dflash_cli.sysinfo import system_memory
from dflash_cli.ui import doctor
from dflash_cli.ui.cli import cli

SECRET = "hf_doctorTestSecretValue1234567890"


@pytest.fixture(autouse=True)
def clean_hub_env(monkeypatch):
    for var in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "NO_COLOR"):
        monkeypatch.delenv(var, raising=False)


def run_json(*args: str) -> tuple[int, dict, str]:
    result = CliRunner().invoke(cli, ["doctor", "--json", *args])
    return result.exit_code, json.loads(result.stdout), result.output


def by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_json_reports_the_environment():
    code, report, _ = run_json()
    assert code == 0 and report["ok"] is True
    checks = by_name(report)
    assert set(report) == {"checks", "ok"}
    assert all(set(c) == {"name", "value", "status", "hint", "data"} for c in report["checks"])
    assert all(c["status"] in ("ok", "warn", "fatal") for c in report["checks"])
    assert not any(c["status"] == "fatal" for c in report["checks"])
    assert checks["torch"]["value"] == torch.__version__
    assert checks["cuda available"]["data"] is torch.cuda.is_available()  # the doctor agrees with torch
    if torch.cuda.is_available():  # a GPU machine (DFLASH_TEST_DEVICE=cuda runs)
        count = torch.cuda.device_count()
        assert checks["cuda available"]["status"] == "ok" and f"({count} device" in checks["cuda available"]["value"]
        for i in range(count):
            assert checks[f"gpu {i}"]["data"]["name"] == torch.cuda.get_device_name(i)
            assert checks[f"gpu {i} memory"]["data"]["total_bytes"] == torch.cuda.mem_get_info(i)[1]
        assert checks["bitsandbytes backend"]["value"] == "cuda"
    else:
        assert checks["cuda available"]["status"] == "warn"
        assert "speculation runs on the CPU" in checks["cuda available"]["hint"]
        assert checks["gpu"]["value"] == "none"
        assert not any(name.startswith("gpu ") for name in checks)
        assert checks["bitsandbytes backend"]["value"] == "cpu"
    assert checks["bitsandbytes"]["value"] == importlib.metadata.version("bitsandbytes")
    assert "kernels" in checks["bitsandbytes backend"]["hint"]
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        assert checks["torch build"]["value"] == "CPU-only build"
    assert checks["cpu cores"]["data"]["logical"] >= 1
    assert checks["system memory"]["data"] > 0
    assert isinstance(checks["cpu bf16"]["data"], bool)
    from dflash_cli.engine.device import cpu_auto_quant

    assert checks["cpu format"]["data"]["quant"] == cpu_auto_quant()[0]
    for dist in ("transformers", "huggingface_hub", "accelerate", "safetensors", "tokenizers", "prompt_toolkit",
                 "rich", "click"):
        assert checks[dist]["value"] == importlib.metadata.version(dist), dist
    assert checks["hf offline"]["data"] is True  # conftest sets HF_HUB_OFFLINE=1
    assert checks["hf token"]["value"] == "none"


def test_json_paths_follow_the_environment_at_call_time(tmp_path, monkeypatch):
    _, report, _ = run_json()
    checks = by_name(report)
    assert checks["hf cache"]["value"] == str(tmp_path / "hf" / "hub")  # HF_HOME from conftest
    assert checks["hf cache size"]["data"] == {"bytes": 0, "repos": 0}  # no cache dir yet: fine
    assert checks["data dir"]["data"] == str(tmp_path / "data")
    assert checks["cache dir"]["data"] == str(tmp_path / "cache")

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    checks = by_name(run_json()[1])
    assert checks["hf cache"]["value"] == str(tmp_path / "elsewhere")
    assert checks["hf offline"]["data"] is False


def test_hub_cache_and_offline_are_the_ones_pull_and_list_use(tmp_path, monkeypatch):
    """The doctor reads them through models/folders.py, as huggingface_hub does: the older HUGGINGFACE_HUB_CACHE
    beats HF_HOME, and TRANSFORMERS_OFFLINE sets the Hub offline too."""
    from dflash_cli.models import folders

    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    checks = by_name(run_json()[1])
    assert checks["hf cache"]["value"] == str(folders.default_cache_dir()) == str(tmp_path / "legacy")
    assert checks["hf offline"]["value"] == "yes (TRANSFORMERS_OFFLINE)" and checks["hf offline"]["data"] is True


def test_human_output_has_aligned_key_names_and_no_escape_codes():
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for key in ("dflash-cli:", "python:", "python executable:", "platform:", "torch:", "torch build:",
                "cuda available:", "gpu 0:" if torch.cuda.is_available() else "gpu:", "cpu cores:",
                "system memory:", "available memory:", "cpu bf16:",
                "bitsandbytes:", "bitsandbytes backend:", "transformers:", "huggingface_hub:", "accelerate:",
                "safetensors:", "tokenizers:", "prompt_toolkit:", "rich:", "click:", "hf cache:",
                "hf cache size:", "hf offline:", "hf token:", "data dir:", "cache dir:", "smollm2:"):
        assert any(line.startswith(key) for line in lines), key
    value_columns = {len(line) - len(line.split(":", 1)[1].lstrip()) for line in lines if not line[0].isspace()}
    assert len(value_columns) == 1  # every value starts in the same column
    if not torch.cuda.is_available():
        assert "[warning]" in result.stdout
        assert "hint: no GPU: speculation runs on the CPU" in result.stdout
    assert "\x1b[" not in result.output


def test_hf_token_env_var_is_named_but_never_printed():
    runner = CliRunner()
    result = runner.invoke(cli, ["doctor", "--json"], env={"HF_TOKEN": SECRET})
    assert by_name(json.loads(result.stdout))["hf token"]["value"] == "HF_TOKEN environment variable"
    assert SECRET not in result.output
    human = runner.invoke(cli, ["doctor"], env={"HF_TOKEN": SECRET})
    assert "HF_TOKEN environment variable" in human.stdout and SECRET not in human.output


def test_hf_token_file_is_found_under_hf_home(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(SECRET + "\n")
    code, report, output = run_json()
    token = by_name(report)["hf token"]
    assert code == 0 and token["value"].startswith("token file")
    assert token["data"]["path"] == str(tmp_path / "hf" / "token")
    assert SECRET not in output
    assert SECRET not in CliRunner().invoke(cli, ["doctor"]).output


def test_empty_token_file_counts_as_none(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text("\n")
    assert by_name(run_json()[1])["hf token"]["value"] == "none"


def test_cache_size_counts_a_cached_repo(tmp_path):
    sha = "a" * 40
    repo = tmp_path / "hf" / "hub" / "models--org--name"
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "snapshots" / sha / "config.json").write_bytes(b"x" * 3000)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    code, report, _ = run_json()
    size = by_name(report)["hf cache size"]
    assert code == 0 and size["status"] == "ok"
    assert size["data"] == {"bytes": 3000, "repos": 1}
    assert size["value"] == "2.9 KiB in 1 repo"


def test_a_fatal_check_exits_1_and_shows_its_hint(monkeypatch):
    real = doctor._dist_version

    def missing_accelerate(dist: str) -> str:
        if dist == "accelerate":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(doctor, "_dist_version", missing_accelerate)
    runner = CliRunner()
    result = runner.invoke(cli, ["doctor"])
    assert result.exit_code == 1
    assert "accelerate:" in result.stdout and "not installed  [FATAL]" in result.stdout
    assert "hint: pip install accelerate" in result.stdout
    assert "Error: 1 fatal problem(s): accelerate" in result.stderr

    result = runner.invoke(cli, ["doctor", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["ok"] is False
    accelerate = by_name(report)["accelerate"]
    assert accelerate["status"] == "fatal" and accelerate["hint"] == "pip install accelerate"


def test_a_whole_collector_can_be_replaced_by_a_fatal_one(monkeypatch):
    monkeypatch.setattr(doctor, "check_transformers", lambda: [
        doctor.Check("transformers", "not importable (ImportError: boom)", "fatal", "pip install transformers")])
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 1 and "hint: pip install transformers" in result.stdout


def test_a_crashing_collector_becomes_a_warning(monkeypatch):
    def broken() -> list:
        raise RuntimeError("nvml exploded")

    broken.__name__ = "check_gpu"
    monkeypatch.setattr(doctor, "check_gpu", broken)
    checks = {c.name: c for c in doctor.collect()}
    assert checks["gpu"].status == "warn" and "nvml exploded" in checks["gpu"].value
    assert doctor.is_ok(list(checks.values()))


def test_low_memory_on_cpu_warns(monkeypatch):
    monkeypatch.setattr(doctor, "system_memory", lambda: (8 * 1024**3, 1024**3))
    checks = {c.name: c for c in doctor.check_cpu()}
    assert checks["available memory"].status == "warn" and checks["available memory"].data == 1024**3
    monkeypatch.setattr(doctor, "system_memory", lambda: (8 * 1024**3, 6 * 1024**3))
    assert {c.name: c for c in doctor.check_cpu()}["available memory"].status == "ok"


def test_meminfo_parses_proc_format_and_falls_back(tmp_path):
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    4096 kB\n")
    assert system_memory(str(fake)) == (16384 * 1024, 4096 * 1024)
    total, _ = system_memory(str(tmp_path / "missing"))  # sysconf fallback (or None, None elsewhere)
    assert total is None or total > 0


def test_old_python_is_fatal(monkeypatch):
    monkeypatch.setattr(doctor, "MIN_PYTHON", (99, 0))
    python = doctor.check_python()[0]
    assert python.status == "fatal" and "99.0" in python.hint


def test_collect_is_pure_data(capsys):
    checks = doctor.collect()
    assert capsys.readouterr() == ("", "")
    assert all(isinstance(c, doctor.Check) for c in checks)
    assert len({c.name for c in checks}) == len(checks)
    json.loads(doctor.to_json(checks))
    with pytest.raises(ValueError):
        doctor.Check("x", "y", "bad")


def test_colour_only_when_asked():
    checks = [doctor.Check("a", "1"), doctor.Check("long name", "2", "warn", "do this")]
    plain = doctor.render_text(checks, color=False)
    assert plain == ["a:         1", "long name: 2  [warning]", "           hint: do this"]
    assert "\x1b[" in "".join(doctor.render_text(checks, color=True))
