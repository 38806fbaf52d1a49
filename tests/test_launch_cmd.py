"""`dflash-cli serve-cmd`: the vLLM / SGLang command for each registry pair, its errors, and --exec."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_cli.ui.cli import cli

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = Path(__file__).parent / "data" / "serve-cmd.txt"
REGISTRY = ROOT / "src" / "dflash_cli" / "models" / "registry.toml"


@pytest.fixture(autouse=True)
def empty_config(tmp_path, monkeypatch):
    """No user pairs or settings from the machine running the tests."""
    config = tmp_path / "config.toml"
    config.write_text("")
    monkeypatch.setenv("DFLASH_CONFIG", str(config))
    return config


def run(*args):
    return CliRunner().invoke(cli, ["serve-cmd", *args])


def expectations() -> list[tuple[str, str]]:
    lines = [line for line in EXPECTED.read_text().splitlines() if line and not line.startswith("#")]
    return [tuple(line.split("\t")) for line in lines]


def test_expectation_file_covers_every_pair_with_a_drafter_and_both_engines():
    pairs = tomllib.loads(REGISTRY.read_text())["pairs"]
    want = {(name, engine) for name, p in pairs.items() if p.get("drafter") for engine in ("vllm", "sglang")}
    have = {(shlex.split(args)[0], shlex.split(args)[2]) for args, _ in expectations()}
    assert have == want


@pytest.mark.parametrize(("args", "line"), expectations(), ids=[a for a, _ in expectations()])
def test_printed_command_matches_the_checked_in_expectation(args, line):
    result = run(*shlex.split(args))
    assert result.exit_code == 0, result.output
    assert result.stdout == line + "\n"


def test_flags_of_each_engine():
    vllm = shlex.split(run("qwen3-8b", "--engine", "vllm", "--tp", "4", "--port", "9000").stdout)
    assert vllm[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "4" and vllm[vllm.index("--port") + 1] == "9000"
    spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 15}
    # each response then carries its own acceptance, which --engine reads instead of the server-wide counters
    assert vllm[vllm.index("--per-request-spec-decode-metrics") + 1] == "summary"

    sgl = shlex.split(run("qwen3.6-35b-a3b", "--engine", "sglang", "--tp", "8").stdout)
    assert sgl[:3] == ["python3", "-m", "sglang.launch_server"]
    flags = dict(zip(sgl[3::2], sgl[4::2]))
    assert flags == {"--model-path": "Qwen/Qwen3.6-35B-A3B", "--tp-size": "8", "--speculative-algorithm": "DFLASH",
                     "--speculative-draft-model-path": "z-lab/Qwen3.6-35B-A3B-DFlash",
                     "--speculative-num-draft-tokens": "16", "--mamba-scheduler-strategy": "extra_buffer"}
    # a plain (non-hybrid) target has no mamba flag
    assert "--mamba-scheduler-strategy" not in run("qwen3-8b", "--engine", "sglang").stdout


def one_error(result, code: int, *needles: str) -> None:
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: ") and lines[1].startswith("Hint: "), lines
    for needle in needles:
        assert needle in lines[0]


def test_a_pair_without_a_drafter_is_refused(empty_config):
    empty_config.write_text('[pairs.plain]\ntarget = "org/plain"\nblock_size = 16\n')
    one_error(run("plain", "--engine", "vllm"), 2, "plain has no DFlash drafter")


def test_unknown_names_folders_and_built_ins_are_refused(tmp_path):
    one_error(run("no-such-model", "--engine", "sglang"), 2, "no-such-model")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    one_error(run(str(folder), "--engine", "vllm"), 2, "local folder")
    one_error(run("demo", "--engine", "vllm"), 2, "built in")
    one_error(run("some-org/not-a-pair", "--engine", "vllm"), 2, "not a registry pair")


def test_bad_tp_port_and_missing_block_size(empty_config):
    one_error(run("qwen3-8b", "--engine", "vllm", "--tp", "0"), 2, "--tp 0")
    one_error(run("qwen3-8b", "--engine", "vllm", "--tp", "-2"), 2, "--tp -2")
    one_error(run("kimi-k2.5", "--engine", "vllm", "--tp", "0"), 2, "--tp 0")  # not replaced by the registry's 8
    bad_port = run("qwen3-8b", "--engine", "vllm", "--port", "70000")
    assert bad_port.exit_code == 2 and bad_port.stderr.startswith("Error: --port 70000")
    empty_config.write_text('[pairs.unsized]\ntarget = "org/target"\ndrafter = "org/drafter"\n')
    one_error(run("unsized", "--engine", "vllm"), 2, "block size")
    assert run("qwen3-8b", "--engine", "tgi").exit_code == 2  # click's own choice check
    # 0 is a value, not "the registry's": it used to fall back to 16 silently
    one_error(run("qwen3-8b", "--engine", "vllm", "--block-size", "0"), 2, "--block-size 0")
    # past the drafter's trained block (16): it used to print num_speculative_tokens 9998
    one_error(run("qwen3-8b", "--engine", "vllm", "--block-size", "9999"), 2, "drafts blocks of 16")
    assert '"num_speculative_tokens": 7' in run("qwen3-8b", "--engine", "vllm", "--block-size", "8").stdout


def fake_engine(bin_dir: Path, name: str, record: Path) -> None:
    """An executable that writes its argv (one JSON list, argv[0] included) to `record`."""
    script = bin_dir / name
    script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"open({str(record)!r}, 'w').write(json.dumps(sys.argv))\n")
    script.chmod(0o755)


@pytest.mark.parametrize(("engine", "exe"), [("vllm", "vllm"), ("sglang", "python3")])
def test_exec_runs_exactly_the_printed_argv(tmp_path, empty_config, engine, exe):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    fake_engine(bin_dir, exe, record)
    env = {**os.environ, "PATH": str(bin_dir), "PYTHONPATH": str(ROOT / "src"), "DFLASH_CONFIG": str(empty_config)}
    args = ["qwen3.5-9b", "--engine", engine, "--tp", "2", "--port", "8123"]
    printed = subprocess.run([sys.executable, "-m", "dflash_cli", "serve-cmd", *args], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    ran = subprocess.run([sys.executable, "-m", "dflash_cli", "serve-cmd", *args, "--exec"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == ""
    assert ran.stderr.strip() == printed  # shown on stderr before the exec
    argv = json.loads(record.read_text())
    assert argv[1:] == shlex.split(printed)[1:]
    assert Path(argv[0]).name == exe


def test_exec_without_the_engine_installed(tmp_path, empty_config):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {**os.environ, "PATH": str(empty_bin), "PYTHONPATH": str(ROOT / "src"), "DFLASH_CONFIG": str(empty_config)}
    ran = subprocess.run([sys.executable, "-m", "dflash_cli", "serve-cmd", "qwen3-8b", "--engine", "vllm", "--exec"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1 and ran.stdout == ""
    lines = ran.stderr.splitlines()
    assert lines[0] == "Error: vllm is not on PATH: install vllm to run this command"
    assert lines[1].startswith("Hint: pip install vllm") and len(lines) == 2


def test_exec_sglang_with_a_python_that_lacks_it_prints_the_install_line(tmp_path, empty_config):
    """sglang runs as `python3 -m sglang.launch_server`: without the module that was Python's own error."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python3"  # a real Python (this one, which has no sglang) found first on PATH
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"),
           "DFLASH_CONFIG": str(empty_config)}
    ran = subprocess.run([sys.executable, "-m", "dflash_cli", "serve-cmd", "qwen3-8b", "--engine", "sglang",
                          "--exec"], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1 and ran.stdout == ""
    lines = ran.stderr.splitlines()
    assert lines[0] == "Error: python3 on PATH has no sglang module: install sglang to run this command"
    assert lines[1].startswith("Hint: pip install") and len(lines) == 2


def test_the_new_pairs_get_their_block_sizes_and_the_giants_their_server_flags():
    """Issue 27: gpt-oss-20b's block (8) no longer has to be passed; gpt-oss-120b drafts blocks of 10;
    Kimi K2.5 and GLM-5.1 are served on 8 GPUs unless --tp says otherwise, Kimi with --trust-remote-code
    (its tokenizer is code); Qwen3-Coder-Next is a Gated DeltaNet hybrid, which SGLang serves with
    --mamba-scheduler-strategy extra_buffer."""
    def spec(*args):
        argv = shlex.split(run(*args).stdout)
        return argv, json.loads(argv[argv.index("--speculative-config") + 1]) if "vllm" in args else None

    assert spec("gpt-oss-20b", "--engine", "vllm")[1]["num_speculative_tokens"] == 7
    assert spec("gpt-oss-120b", "--engine", "vllm")[1]["num_speculative_tokens"] == 9
    for name, target in (("kimi-k2.5", "moonshotai/Kimi-K2.5"), ("glm-5.1", "zai-org/GLM-5.1-FP8")):
        argv, speculative = spec(name, "--engine", "vllm")
        assert argv[2] == target and argv[argv.index("--tensor-parallel-size") + 1] == "8"
        assert speculative["num_speculative_tokens"] == 7  # block 8
        assert ("--trust-remote-code" in argv) == (name == "kimi-k2.5")
        sgl = shlex.split(run(name, "--engine", "sglang", "--tp", "16").stdout)
        assert sgl[sgl.index("--tp-size") + 1] == "16" and sgl[sgl.index("--speculative-num-draft-tokens") + 1] == "8"
        assert ("--trust-remote-code" in sgl) == (name == "kimi-k2.5")
    assert "--trust-remote-code" not in run("qwen3-8b", "--engine", "vllm").stdout
    coder = shlex.split(run("qwen3-coder-next", "--engine", "sglang").stdout)
    assert coder[-2:] == ["--mamba-scheduler-strategy", "extra_buffer"]
    assert "--mamba-scheduler-strategy" not in run("gemma-4-26b-a4b", "--engine", "sglang").stdout
