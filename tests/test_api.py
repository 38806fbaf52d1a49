"""The public API (`import dflash_cli`): the README's example, text or ids, a cheap import; the Drafter protocol."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import dflash2_config, drafter_config, random_drafter, save_tiny_pair, target_config

import dflash_cli
from dflash_cli.engine.dflash2 import DFlash2Drafter
from dflash_cli.engine.drafter import DFlashDrafter, Drafter
from dflash_cli.engine.generate import generate as engine_generate
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.text import encode_prompt

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("api"))


def readme_example() -> str:
    section = README.read_text(encoding="utf-8").split("\n## Python\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs_and_prints_the_targets_own_greedy_text(pair):
    target_dir, drafter_dir = pair
    code = readme_example()
    assert "path/to/Qwen3-8B-DFlash-b16" in code and "path/to/Qwen3-8B\"" in code
    code = code.replace("path/to/Qwen3-8B-DFlash-b16", str(drafter_dir)).replace("path/to/Qwen3-8B", str(target_dir))
    out = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), scope)
    runtime = scope["runtime"]
    assert isinstance(runtime.drafter, DFlashDrafter) and scope["stats"].speculative
    ids = encode_prompt(runtime.tokenizer, "Write a haiku about caches.", enable_thinking=False)
    plain = engine_generate(runtime.target, None, ids, tokenizer=runtime.tokenizer, max_new_tokens=256)
    text, stats_line = out.getvalue().rsplit("\n", 2)[:2]
    assert text == plain.text  # lossless: the drafter changes nothing in the output
    assert re.fullmatch(r"tau \d+\.\d\d, \d+\.\d tok/s", stats_line)


def test_generate_takes_text_or_ids(pair):
    runtime = dflash_cli.load(str(pair[0]), draft=str(pair[1]), dtype="float32", device="cpu")
    from_text = dflash_cli.generate(runtime, "Hi", max_new_tokens=12, stop_ids=[])
    ids = encode_prompt(runtime.tokenizer, "Hi")
    from_ids = dflash_cli.generate(runtime, ids, max_new_tokens=12, stop_ids=[])
    raw = dflash_cli.generate(runtime, "Hi", chat_template=False, max_new_tokens=12, stop_ids=[])
    assert isinstance(from_text, dflash_cli.GenerationResult) and len(from_text.tokens) == 12
    assert from_ids.tokens == from_text.tokens
    assert raw.stats.prompt_tokens == len(runtime.tokenizer("Hi")["input_ids"]) < len(ids)


def test_import_is_cheap():
    code = ("import sys, dflash_cli; dflash_cli.load, dflash_cli.Step; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_drafter_satisfies_the_protocol():
    tcfg = target_config("qwen3")
    v1 = random_drafter(drafter_config(tcfg))
    v2 = random_drafter(dflash2_config(tcfg))
    assert isinstance(v2, DFlash2Drafter)
    for drafter in (v1, v2, OracleDrafter(v1, [1, 2, 3])):
        assert isinstance(drafter, Drafter)
    assert not isinstance(object(), Drafter)


def test_load_opens_as_the_command_line_does(pair, monkeypatch, tmp_path):
    """`load` goes through runtime.open_runtime like generate: the result is a Runtime, the registry's names
    are resolved (a pair too big for one machine is refused before any download), and the memory preflight
    runs (a machine without room refuses before the weights load)."""
    runtime = dflash_cli.load(str(pair[0]), draft=str(pair[1]), dtype="float32", device="cpu")
    assert isinstance(runtime, dflash_cli.Runtime) and runtime.speculative
    assert "speculation on" in runtime.ready_line() and runtime.model_name == str(pair[0])
    plain = dflash_cli.load(str(pair[0]), draft=str(pair[1]), no_draft=True, dtype="float32", device="cpu")
    assert plain.drafter is None and not plain.speculative
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    with pytest.raises(dflash_cli.DFlashError, match="multi-GPU server"):
        dflash_cli.load("kimi-k2.5")
    import dflash_cli.engine.device as device

    monkeypatch.setattr(device, "free_memory", lambda _device: 1000)  # 1000 bytes free: nothing fits
    with pytest.raises(dflash_cli.DFlashError, match="memory"):
        dflash_cli.load(str(pair[0]), draft=str(pair[1]), dtype="float32", device="cpu")
