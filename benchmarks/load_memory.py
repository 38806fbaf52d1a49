"""Memory of a CPU-integer target through the real loader: the whole model through transformers'
from_pretrained, then quantized by the fast path (`whole`), against one decoder layer at a time
(`by-layer`, engine/layerwise.py, what the CLI does), side by side in one run.

A random Qwen3-shaped checkpoint (bf16 safetensors, one shard per layer, as published checkpoints are) is
written once into --dir; each mode then loads it in a fresh process, builds the fast path with a cache of
--context positions, and reports its load time, its peak and current resident memory, and what it holds.

    .venv/bin/python benchmarks/load_memory.py                          # qwen3-1.7b, q4a8: about 2 minutes
    .venv/bin/python benchmarks/load_memory.py --preset qwen3-4b --modes by-layer whole
    .venv/bin/python benchmarks/load_memory.py --preset qwen3-4b --quant q8a8 --modes by-layer
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # Qwen3's published shapes (../shared/data/hf-configs), head_dim 128, vocabulary 151936
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8),
}
GIB = 2**30


def write_checkpoint(folder: Path, preset: str) -> Path:
    """The random checkpoint, one safetensors shard per decoder layer (never the whole model in memory)."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (folder / "model.safetensors.index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**SHAPES[preset], head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
    with init_empty_weights():
        model = Qwen3ForCausalLM(config)
    model.tie_weights()
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        shard = f"layer-{int(parts[2]):03d}" if parts[1] == "layers" else "rest"
        scale = 1.0 if name.endswith("norm.weight") else 0.02
        value = torch.ones(param.shape) if scale == 1.0 else torch.randn(param.shape) * scale
        shards.setdefault(shard, {})[name] = value.to(torch.bfloat16)
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / f"{shard}.safetensors"), metadata={"format": "pt"})
        weight_map.update((name, f"{shard}.safetensors") for name in tensors)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    return folder


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(folder: Path, quant: str, mode: str, context: int) -> None:
    """One load in this process; prints its numbers as one JSON line."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import target_held_bytes

    from dflash_cli.engine.load import load_target

    torch.set_num_threads(2)
    started = time.perf_counter()
    target = load_target(folder, device="cpu", quant=quant, by_layer=mode == "by-layer")
    assert target.enable_fast_path(context) is None
    seconds = time.perf_counter() - started
    logits, _ = target.forward(torch.tensor([[1, 2, 3]]), target.fast.shared_cache(), 0)  # it runs
    assert torch.isfinite(logits).all()
    import gc

    gc.collect()
    out = dict(mode=mode, load_s=seconds, peak=status_kib("VmHWM") * 1024, resident=status_kib("VmRSS") * 1024,
               anon=status_kib("RssAnon") * 1024, file=status_kib("RssFile") * 1024, **target_held_bytes(target))
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(SHAPES), default="qwen3-1.7b")
    ap.add_argument("--quant", choices=["q4", "q8", "q4a8", "q8a8"], default="q4a8")
    ap.add_argument("--modes", nargs="+", choices=["whole", "by-layer"], default=["by-layer", "whole"])
    ap.add_argument("--context", type=int, default=4096, help="the fast path's cache positions (default 4096)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dflash-load-memory"),
                    help="where the random checkpoint is written once (default /tmp/dflash-load-memory)")
    ap.add_argument("--child", choices=["whole", "by-layer"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    folder = args.dir / args.preset
    if args.child:
        return child(folder, args.quant, args.child, args.context)
    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_formats import cpu_line

    print(cpu_line())
    t0 = time.perf_counter()
    write_checkpoint(folder, args.preset)
    params = SHAPES[args.preset]
    print(f"{args.preset} (hidden {params['hidden_size']}, {params['num_hidden_layers']} layers, tied embeddings), "
          f"bf16 checkpoint in {folder} ({time.perf_counter() - t0:.0f}s), {args.quant}, cache of {args.context}")
    print()
    print("| load | seconds | peak resident GiB | resident after GiB | codes GiB | caches GiB | dense left GiB "
          "| resident / (codes + caches) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes:
        run = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--quant", args.quant,
                              "--context", str(args.context), "--dir", str(args.dir), "--child", mode],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(f"| {mode} | failed (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:]} |")
            continue
        m = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"| {mode} | {m['load_s']:.1f} | {m['peak'] / GIB:.2f} | {m['resident'] / GIB:.2f} | "
              f"{m['codes'] / GIB:.2f} | {m['caches'] / GIB:.2f} | {m['dense'] / GIB:.2f} | "
              f"{m['resident'] / (m['codes'] + m['caches']):.2f}x |")


if __name__ == "__main__":
    main()
