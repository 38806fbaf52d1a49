"""--device-map / --max-memory: the per-device planner, option checks, and decoding on a split target.

What is real and what is simulated here (there is no second device on a CPU-only CI machine):

* real: a cpu + disk split loaded through the real loader (an explicit accelerate device map; the disk
  layers' weights wait on `meta` and accelerate's hooks copy them in on every forward), decoded
  speculatively and checked token-identical to plain greedy decoding on the unsplit target;
* simulated: the fast path's per-layer device logic on two CPU "devices". `layer_device`, as engine/fast.py
  reads it, is patched to call layers 3-5 `cpu:1` (a distinct torch.device that allocates on the CPU), so
  the fast path takes every boundary decision it takes on two GPUs; the test counts the moves it makes
  through `move`, as engine/static_forward.py reads it, and where each layer's cache was asked for, and
  checks the output is unchanged;
* real again, only where CUDA is present (the GPU run): the fast path on a target whose layers 3-5 are
  really on the CPU and the rest on the GPU, token-identical to the unsplit target.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import drafter_config, save_random_drafter, save_target, save_tiny_pair, target_config

from dflash_cli.engine import fast, static_forward
from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import load_pair
from dflash_cli.engine.oracle import OracleDrafter
from dflash_cli.engine.placement import parse_max_memory, resolve_split
from dflash_cli.models.memory.sizes import CUDA_CONTEXT_BYTES
from dflash_cli.models.memory.split import choose_split_quant, format_split, plan_split
from dflash_cli.ui.cli import cli as main

TARGET = target_config("qwen3")
PROMPT = [5, 17, 33, 8, 91, 42, 7]

# Hand-computed for the tiny Qwen3 (hidden 64, MLP 128, 4/2 heads of 16, vocab 160, untied), bf16,
# context 64, no drafter (block 1):
LAYER_W = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16 + 3 * 64 * 128 + 2 * 64)  # q,k,v,o, q/k norm, MLP, norms
LAYER_KV = 2 * 2 * 16 * (64 + 1) * 2  # K and V, 2 heads of 16, 65 rows, 2 bytes
HOT_W = 2 * 160 * 64 * 2 + 64 * 2  # embeddings + LM head + final norm
# logits, prefill (MLP and copies, then the attention mask and its bias: 2 query heads per kv head), 10% margin
HOT_WORK = 2 * 1 * 160 * 4 + 64 * (3 * 128 + 4 * 64) * 2 + 2 * 64 * 64 * 3 + HOT_W // 10
PER_LAYER = LAYER_W * 1.1 + LAYER_KV


def test_hand_computed_sizes_match_the_planner():
    assert (LAYER_W, LAYER_KV, HOT_W, HOT_WORK) == (74048, 8320, 41088, 1280 + 81920 + 24576 + 4108)
    plan = plan_split(TARGET, devices=[("cuda:0", 2**31), ("cuda:1", 2**31)], strategy="sequential",
                      context_tokens=64)
    hot, other = plan.shares
    assert (hot.layers, other.layers) == (6, 0)
    assert hot.weights == HOT_W + 6 * LAYER_W
    assert hot.kv == 6 * LAYER_KV
    assert hot.working == HOT_WORK + int(6 * LAYER_W * 0.1) + CUDA_CONTEXT_BYTES
    assert other.total == CUDA_CONTEXT_BYTES


def test_balanced_spreads_the_load_and_sequential_fills_in_order():
    big = [("cuda:0", 2**31), ("cuda:1", 2**31)]
    balanced = plan_split(TARGET, devices=big, strategy="balanced", context_tokens=64)
    # 3+3 would load cuda:0 with HOT + 3 layers; 2+4 loads the fuller device less (4 * PER_LAYER < HOT + 3 layers)
    assert [s.layers for s in balanced.shares] == [2, 4]
    assert balanced.layer_devices() == ["cuda:0"] * 2 + ["cuda:1"] * 4
    assert plan_split(TARGET, devices=big, strategy="auto", context_tokens=64).layer_devices() == \
        balanced.layer_devices()
    # a cuda:0 with room for exactly three layers beside its own
    room3 = int(CUDA_CONTEXT_BYTES + HOT_W + HOT_WORK + 3 * PER_LAYER) + 10
    tight = plan_split(TARGET, devices=[("cuda:0", room3), ("cuda:1", 2**31)], strategy="sequential",
                       context_tokens=64)
    assert [s.layers for s in tight.shares] == [3, 3] and tight.fits and not tight.offloaded_layers
    assert tight.shares[1].first_layer == 3


def test_offload_is_the_last_resort_and_its_caches_stay_on_the_hot_device():
    # room on the CPU for its own parts and exactly one layer: offloading reserves the KV of every
    # offloaded layer and one layer in transit there, so the CPU ends up with no layer of its own
    cpu = int(HOT_W + HOT_WORK + PER_LAYER) + 10
    plan = plan_split(TARGET, devices=[("cpu", cpu), ("disk", None)], strategy="auto", context_tokens=64)
    assert [s.layers for s in plan.shares] == [0, 6]
    assert plan.offloaded_layers == 6 and plan.fits is False  # the reserve does not fit either
    roomy = int(HOT_W + HOT_WORK + 6 * LAYER_KV + LAYER_W + 2 * PER_LAYER) + 10
    plan = plan_split(TARGET, devices=[("cpu", roomy), ("disk", None)], strategy="auto", context_tokens=64)
    cpu_share, disk = plan.shares
    assert (cpu_share.layers, disk.layers) == (2, 4) and plan.fits
    assert cpu_share.kv == 6 * LAYER_KV and disk.total == 0
    assert "(offloaded layers: slow)" in plan.summary
    assert any("offload: slow" in line for line in format_split(plan))


def test_quant_auto_splits_before_quantizing_and_offloads_last():
    gpu_room = int(CUDA_CONTEXT_BYTES + HOT_W + HOT_WORK + 3 * PER_LAYER) + 10  # three bf16 layers each
    two = [("cuda:0", gpu_room), ("cuda:1", gpu_room)]
    assert choose_split_quant(TARGET, devices=two, context_tokens=64) == "bf16"  # one GPU would need int8
    one = [("cuda:0", gpu_room)]
    assert choose_split_quant(TARGET, devices=one, context_tokens=64) in ("int8", "nf4")
    # room for the GPU's own parts plus what offloading needs there (every layer's KV, one layer in
    # transit), less than even nf4 needs for all six layers on the GPU: bf16 with cpu offload
    just_offload = int(CUDA_CONTEXT_BYTES + HOT_W + HOT_WORK + 6 * LAYER_KV + LAYER_W) + 10
    offload = [("cuda:0", just_offload), ("cpu", 2**31)]
    assert choose_split_quant(TARGET, devices=offload, context_tokens=64) == "bf16"
    assert plan_split(TARGET, devices=offload, quant="nf4", context_tokens=64).offloaded_layers > 0


def test_max_memory_parsing():
    assert parse_max_memory("0=14GiB, 1=500MiB,cpu=30GB,disk=1TiB") == {
        "cuda:0": 14 * 2**30, "cuda:1": 500 * 2**20, "cpu": 30 * 10**9, "disk": 2**40}
    assert parse_max_memory("cuda:2=1.5GiB") == {"cuda:2": int(1.5 * 2**30)}
    for bad in ("cpu", "cpu=lots", "gpu0=1GiB", "=1GiB", "cpu=0"):
        with pytest.raises(InvalidSettingError):
            parse_max_memory(bad)


def test_split_settings_checked_together():
    assert resolve_split("auto", None, None) is None
    strategy, devices = resolve_split(None, "sequential", "cpu=1GiB,disk=2GiB")
    assert strategy == "sequential" and devices == [("cpu", 2**30), ("disk", 2 * 2**30)]
    with pytest.raises(InvalidSettingError, match="needs --device-map"):
        resolve_split(None, None, "cpu=1GiB")
    with pytest.raises(InvalidSettingError, match="unknown device map"):
        resolve_split(None, "everywhere", None)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidSettingError, match="not here"):
            resolve_split(None, "auto", "0=1GiB,cpu=1GiB")


@pytest.mark.parametrize("args, message", [
    (["--device-map", "auto", "--max-memory", "cpu=14Gx"], "Error: --max-memory: '14Gx' is not a size"),
    (["--device-map", "auto", "--max-memory", "foo=1GiB"], "Error: --max-memory: unknown device 'foo'"),
    (["--max-memory", "cpu=1GiB"], "Error: --max-memory applies to a split: it needs --device-map"),
    (["--device-map", "auto", "--max-memory", "disk=1GiB"], "Error: --max-memory names only disk"),
    (["--device-map", "auto", "--max-memory", "7=1GiB"], "Error: --max-memory names cuda:7, which is not here"),
])
def test_bad_split_options_are_one_line_and_exit_2(tmp_path, args, message):
    target, drafter = save_tiny_pair(tmp_path)
    result = CliRunner().invoke(main, ["generate", "-m", str(target), "--draft", str(drafter), *args, "hi"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(message) and lines[1].startswith("Hint: ") and len(lines) == 2
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def pair_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    return (save_target(root / "target", TARGET, seed=1, scale=3.0),
            save_random_drafter(root / "drafter", drafter_config(TARGET), seed=2))


@pytest.fixture(scope="module")
def reference(pair_folders):
    """Plain greedy decoding on the unsplit fp32 target."""
    pair = load_pair(*pair_folders, device="cpu", dtype="float32")
    return generate(pair.target, None, PROMPT, max_new_tokens=68, stop_ids=[]).tokens


def speculate(pair, reference, n=48):
    """Speculative greedy decoding through the pair's drafter, made right 70% of the time (OracleDrafter),
    so both accepted and rejected drafts are verified."""
    oracle = OracleDrafter(pair.drafter, PROMPT + reference, acceptance=0.7, seed=0, vocab_size=160)
    result = generate(pair.target, oracle, PROMPT, max_new_tokens=n, stop_ids=[], adaptive=False)
    assert 0 < result.stats.accepted < result.stats.drafted
    return result


def test_cpu_and_disk_split_is_lossless(pair_folders, reference):
    """Real: layers 3-5 offloaded to disk through accelerate, transformers' forward (the fast path says
    why it cannot run them), taps gathered on the hot device; output identical to plain greedy."""
    pair = load_pair(*pair_folders, device="cpu", dtype="float32", layer_devices=["cpu"] * 3 + ["disk"] * 3)
    target = pair.target
    assert [str(p.device) for p in target.layers[4].parameters()][0] == "meta"  # really offloaded
    assert target.layer_devices == ["cpu"] * 3 + ["disk"] * 3
    assert target.split and target.offloaded and target.placement.endswith("(offloaded layers: slow)")
    assert "offloaded" in target.enable_fast_path(256, pad_to=8)
    result = speculate(pair, reference)
    assert result.tokens == reference[:48]


def test_fast_path_crosses_each_device_boundary_once(pair_folders, reference, monkeypatch):
    """Simulated: layers 3-5 on a second CPU 'device' (see the module docstring)."""
    second = torch.device("cpu", 1)
    pair = load_pair(*pair_folders, device="cpu", dtype="float32")
    target = pair.target
    on_second = {id(layer) for layer in target.layers[3:]}
    real_layer_device = fast.layer_device
    monkeypatch.setattr(fast, "layer_device",
                        lambda layer: second if id(layer) in on_second else real_layer_device(layer))
    moves: list[tuple[tuple[int, ...], torch.device]] = []
    real_move = static_forward.move
    monkeypatch.setattr(static_forward, "move",
                        lambda x, device: moves.append((tuple(x.shape), device)) or real_move(x, device))
    assert target.enable_fast_path(256, pad_to=8) is None
    assert target.fast.devices == [torch.device("cpu")] * 3 + [second] * 3
    cache = target.fast.new_cache()
    assert cache.devices == [torch.device("cpu")] * 3 + [second] * 3

    result = speculate(pair, reference)
    assert result.tokens == reference[:48]
    hidden = [(shape, device) for shape, device in moves if len(shape) == 3 and shape[-1] == 64]
    taps_on_second = len([i for i in target._taps if i >= 3])  # taps (1, 3, 4): two live on the second device
    forwards = 1 + result.stats.steps  # the prompt, then one verify per step
    # per forward: the hidden state there and back, and each tap of the second device back to the hot one
    assert len(hidden) == forwards * (2 + taps_on_second)
    assert [d for _, d in hidden].count(second) == forwards


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU beside the CPU (a real two-device split)")
def test_fast_path_on_gpu_and_cpu_is_lossless(pair_folders):
    """Real, on a GPU machine: layers 3-5 moved to the CPU after loading on cuda; the fast path runs each
    layer where its weights are and matches the unsplit target token for token (fp32)."""
    whole = load_pair(*pair_folders, device="cuda", dtype="float32")
    expected = generate(whole.target, None, PROMPT, max_new_tokens=68, stop_ids=[]).tokens
    pair = load_pair(*pair_folders, device="cuda", dtype="float32")
    for layer in pair.target.layers[3:]:
        layer.to("cpu")
    assert pair.target.enable_fast_path(256, pad_to=8) is None
    assert pair.target.fast.devices is not None
    cache = pair.target.fast.new_cache()
    assert cache.keys[0].device.type == "cuda" and cache.keys[5].device.type == "cpu"
    assert speculate(pair, expected).tokens == expected[:48]


def test_show_prints_the_per_device_plan(tmp_path):
    target, drafter = save_tiny_pair(tmp_path)
    result = CliRunner().invoke(main, ["show", str(target), "--context", "64", "--device-map", "sequential",
                                       "--max-memory", "cpu=1GiB,disk=4GiB", "--json"])
    assert result.exit_code == 0, result.output
    split = json.loads(result.stdout)["split"]
    assert split["strategy"] == "sequential" and split["fits"]
    assert [d["device"] for d in split["devices"]] == ["cpu", "disk"]
    assert [d["layers"] for d in split["devices"]] == [6, 0]
    text = CliRunner().invoke(main, ["show", str(target), "--context", "64", "--device-map", "auto",
                                     "--max-memory", "cpu=1GiB"]).stdout
    assert "per-device plan (--device-map auto)" in text and "cpu     layers 0-5" in text


def test_generate_on_a_cpu_and_disk_split_through_the_cli(tmp_path):
    """Real, end to end: the preflight plans the split, the loader offloads what does not fit in the
    CPU's --max-memory to disk, the load line says so, and --compare finds the output identical."""
    target, drafter = save_tiny_pair(tmp_path)
    result = CliRunner().invoke(main, ["generate", "-m", str(target), "--draft", str(drafter), "--dtype", "float32",
                                       "--device-map", "sequential", "--max-memory", "cpu=1200KiB,disk=1GiB",
                                       "--max-context", "64", "-n", "24", "--compare", "hello"])
    assert result.exit_code == 0, result.output
    assert "layers on cpu 3 layers, disk 3 layers (offloaded layers: slow)" in result.stderr
    assert "identical output (24/24 tokens)" in result.stderr


def test_disk_offload_goes_to_the_cache_folder_not_the_temporary_one(tmp_path, monkeypatch):
    """The system's temporary folder is often RAM (tmpfs): the offload folder is made under the cache folder
    (transformers may leave it empty when it can read offloaded weights from the safetensors files
    themselves) and removed with the target."""
    import os
    from pathlib import Path

    import dflash_cli

    target, drafter = save_tiny_pair(tmp_path)
    runtime = dflash_cli.load(str(target), str(drafter), dtype="float32", device="cpu", max_context=64,
                              device_map="sequential", max_memory="cpu=1200KiB,disk=1GiB")
    where = Path(runtime.target.offload_dir.name)
    assert where.parent == Path(os.environ["DFLASH_CACHE_DIR"]) / "offload" and where.is_dir()
    runtime.target.offload_dir.cleanup()
    assert not where.exists()


def test_a_split_that_does_not_fit_is_refused_before_loading(tmp_path):
    target, drafter = save_tiny_pair(tmp_path)
    result = CliRunner().invoke(main, ["generate", "-m", str(target), "--no-draft", "--dtype", "float32",
                                       "--device-map", "auto", "--max-memory", "cpu=100KiB", "--max-context", "64",
                                       "hi"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Error: ") and "does not fit split over cpu in fp32 at 64 tokens: cpu would hold" \
        in lines[0] and lines[0].endswith("of 100.0 KiB")
    assert lines[1].startswith("Hint: ") and len(lines) == 2


def test_hybrid_targets_cannot_offload(tmp_path):
    from conftest import hybrid_config

    from dflash_cli.runtime.local import plan_layers

    cfg = hybrid_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sizes = (2**k for k in range(10, 40))
    cpu = next(s for s in sizes if (p := plan_split(cfg, devices=[("cpu", s), ("disk", None)], context_tokens=64))
               .fits and 0 < p.offloaded_layers < p.num_layers)
    with pytest.raises(InvalidSettingError, match="hybrid"):
        plan_layers(tmp_path, None, ("auto", [("cpu", cpu), ("disk", None)]), "bf16", 64)
    assert plan_layers(tmp_path, None, ("auto", [("cpu", 2**34)]), "bf16", 64) == ["cpu"] * 4
    # too small even to split: the hint does not send a hybrid to disk, which it cannot use
    with pytest.raises(InvalidSettingError) as err:
        plan_layers(tmp_path, None, ("auto", [("cpu", 2**10)]), "bf16", 64)
    assert "disk" not in err.value.hint and "--max-memory" in err.value.hint
