#!/usr/bin/env bash
# One device call (about 10 minutes): engine correctness on CUDA (transformers path, fast path, compiled
# fast path), then the Qwen3-8B-shaped benchmark, eager vs fast vs compiled side by side, in bf16 and nf4.
# Run on the GPU machine from the repository root, with the bitsandbytes wheel carried in .whl/:
#   bash benchmarks/gpu_run.sh            (writes logs and JSON under $OUT, or ./.bench-out)
set -uo pipefail
OUT=${OUT:-.bench-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/dflash-inductor}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.txt"
# The engine tests, on the GPU, in fp32: losslessness, caches, drafter masks, the compiled fast path;
# the doctor, whose report must agree with the GPU it runs on; and the fast path split over the GPU and the CPU.
DFLASH_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_speculative.py tests/test_drafter.py tests/test_fast.py tests/test_doctor.py tests/test_device_map.py 2>&1 | tail -5 | tee "$OUT/tests-cuda.txt"
# bf16: all three paths (tables print as each section finishes; a cut-short run keeps what it measured)
timeout 200 python3 benchmarks/bench_engine.py --preset qwen3-8b --device cuda --dtype bfloat16 \
  --paths eager fast compiled --prompts 2 --new-tokens 256 --no-hf --json "$OUT/bench-qwen3-8b-bf16.json" \
  2>"$OUT/bench-qwen3-8b-bf16.err" | tee "$OUT/bench-qwen3-8b-bf16.txt"
# nf4: bitsandbytes layers run the fast path eagerly; compiled is tried and falls back if it cannot
timeout 150 python3 benchmarks/bench_engine.py --preset qwen3-8b --device cuda --dtype bfloat16 --quant nf4 \
  --paths eager fast compiled --prompts 1 --new-tokens 128 --taus 6.5 --no-hf \
  --json "$OUT/bench-qwen3-8b-nf4.json" 2>"$OUT/bench-qwen3-8b-nf4.err" | tee "$OUT/bench-qwen3-8b-nf4.txt"
# Qwen3.5-4B shape (hybrid: Gated DeltaNet + attention), bf16: verify, draft and the per-step rollback of the
# linear-attention state, fast vs compiled
timeout 150 python3 benchmarks/bench_engine.py --preset qwen3.5-4b --device cuda --dtype bfloat16 \
  --paths fast compiled --prompts 1 --new-tokens 128 --no-hf \
  --json "$OUT/bench-qwen3.5-4b-bf16.json" 2>"$OUT/bench-qwen3.5-4b-bf16.err" | tee "$OUT/bench-qwen3.5-4b-bf16.txt"
