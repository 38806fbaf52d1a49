#!/usr/bin/env bash
# The CPU kernels on whatever CPU this runs on, in one call of about 3 minutes at most: made for the GPU
# machine's host CPU (a server CPU, often with AVX-512 VNNI or AMX, which the development machines may lack),
# run before benchmarks/gpu_run.sh in the same device call. Each step prints its results as it finishes:
#   1 the CPU (model, the flags the kernels choose by), the compiler, and doctor's `cpu kernels` line (the
#     build this CPU runs, after its check against a float64 reference)
#   2 tests/test_kernel_variants.py natively: every build this CPU runs gives the AVX2 bits
#   3 benchmarks/cpu_kernels.py --variants on 2 threads: q4a8/q8a8 per build, 8 rows / 1 row
#   4 the formats side by side on 2 threads (fp32, bf16 through oneDNN, q4, q4a8): what --quant auto should pick
#   5 unit costs of a Qwen3-1.7B-shaped q4a8 target (decode, verify 4/8, draft of 8) per build, 8 threads
# From the repository root, with the wheels of benchmarks/gpu_run.sh's set-up carried in .whl/:
#   bash benchmarks/cpu_run.sh
# Output: stdout, also in $OUT/cpu-run.txt. Environment: OUT (.bench-out), PYTHON (python3),
# CPU_RUN_SECONDS (170: the whole run's deadline; a step gets what is left, less the later steps' minimum).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
DEADLINE=$((START + ${CPU_RUN_SECONDS:-170}))
OUT=${OUT:-.bench-out}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python} || PY=${PYTHON:-python3}
SITE=/tmp/dflash-gpu-site
mkdir -p "$OUT" || exit 1
exec > >(tee "$OUT/cpu-run.txt") 2>&1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1

step() {  # step NAME RESERVE: prints the header and sets T, the seconds this step may take
  T=$((DEADLINE - $(date +%s) - $2))
  echo
  echo "=== $1 (timeout ${T}s, $(($(date +%s) - START))s into the run)"
  ((T >= 10))
}

if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import llguidance, prompt_toolkit, gguf" 2>/dev/null; then
  rm -rf "$SITE"
  timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:$SITE
fi

if step "1 cpu" 150; then
  grep -m1 'model name' /proc/cpuinfo
  echo "cores $(nproc); flags the kernels and torch choose by:" \
    "$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx_vnni|avx512_bf16|avx512_fp16|amx_tile|amx_int8|amx_bf16' | tr '\n' ' ')"
  "${CC:-cc}" --version | head -n 1
  timeout 20 "$PY" -c "import torch; print('torch', torch.__version__, 'capability', torch.backends.cpu.get_cpu_capability())"
  timeout "$T" "$PY" -m dflash_cli doctor 2>&1 | grep -iE 'cpu|kernel' | head -n 6
fi

if step "2 kernel variants, tests" 110; then
  timeout -k 5 "$T" "$PY" -m pytest -q -p no:cacheprovider tests/test_kernel_variants.py 2>&1 | tail -n 15
fi

if step "3 q4a8/q8a8 per kernel build, 2 threads" 75; then
  OMP_NUM_THREADS=2 timeout -k 5 "$T" "$PY" benchmarks/cpu_kernels.py --formats q4a8 q8a8 --variants --repeats 20
fi

if step "4 formats, 2 threads" 50; then
  OMP_NUM_THREADS=2 timeout -k 5 "$T" "$PY" benchmarks/cpu_kernels.py --formats fp32 bf16 q4 q4a8 --rows 1 8 16 \
    --repeats 10
fi

if step "5 Qwen3-1.7B shape, q4a8 unit costs per build, 8 threads" 0; then
  for variant in avx2 ""; do
    left=$((DEADLINE - $(date +%s)))
    ((left < 10)) && echo "no time left for ${variant:-the chosen build}" && break
    echo "--- DFLASH_KERNELS=${variant:-(unset: the fastest this CPU runs)}"
    [ -n "$variant" ] && left=$((left / 2))
    DFLASH_KERNELS=$variant timeout -k 5 "$left" "$PY" benchmarks/bench_engine.py \
      --preset qwen3-1.7b --quant q4a8 --units-only --threads 8 --repeats 5 --block-size 8 2>&1 \
      | grep -vE '^\[[0-9:]{8}\] ' | tail -n 14
  done
fi
echo
echo "=== cpu_run.sh: $(($(date +%s) - START))s in all"
exec >&- 2>&-
wait
