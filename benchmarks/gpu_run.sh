#!/usr/bin/env bash
# One device call: engine correctness on CUDA, then the Qwen3-8B-shaped benchmark in bf16 and nf4.
# Run on the GPU machine from the repository root, with the bitsandbytes wheel carried in .whl/:
#   bash benchmarks/gpu_run.sh            (writes logs and JSON under $OUT, or ./.bench-out)
set -uo pipefail
OUT=${OUT:-.bench-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.txt"
# The engine tests, on the GPU, in fp32: losslessness, caches, drafter masks (and the installed transformers).
DFLASH_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_speculative.py tests/test_drafter.py 2>&1 | tail -5 | tee "$OUT/tests-cuda.txt"
for quant in none nf4; do
  timeout 200 python3 benchmarks/bench_engine.py --preset qwen3-8b --device cuda --dtype bfloat16 \
    --quant "$quant" --prompts 3 --new-tokens 256 --json "$OUT/bench-qwen3-8b-$quant.json" \
    2>"$OUT/bench-qwen3-8b-$quant.err" | tee "$OUT/bench-qwen3-8b-$quant.txt"
done
