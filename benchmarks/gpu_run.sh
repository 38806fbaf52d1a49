#!/usr/bin/env bash
# One device call of about 8 minutes at most: 455 s of steps (set-up included), then up to 20 s to pack the
# inductor cache. Each step prints its results and a "=== step: N s" line as it finishes, so a run cut short
# keeps what it measured:
#   1 environment (GPU, versions, which SDPA kernel takes the fast path's masked attention call), CUDA tests
#   2 bf16, Qwen3-8B shape: fast and compiled unit costs, CUDA graphs on; recompiles, graph breaks and
#     CUDA-graph skips logged
#   3 the compiled unit costs with CUDA graphs off
#   4 nf4: compiled (falls back to eager when it cannot) and fast unit costs
#   5 bf16 engine table (plain, random drafter, oracle tau 6.5): compiled, or fast if step 2 did not compile
#   6 only with GPU_RUN_HYBRID=1 (90 s more): Qwen3.5-4B shape (hybrid), unit costs and rollback
# A step's timeout is the time left before the deadline less what the later steps are promised, so time an
# early step does not use goes to the next one.
# On the GPU machine, from the repository root, with the bitsandbytes wheel carried in .whl/
# (benchmarks/gpu_wheel.sh):   bash benchmarks/gpu_run.sh
# Output: stdout, also in $OUT/gpu-run.txt; the steps' files (bench stdout/stderr/JSON, torch logs, dynamo
# counters, test output) in $OUT/gpu-run-logs.tgz, rewritten after each step; the inductor cache in
# $OUT/inductor-cache.tgz when under 15 MiB (carried back as .bench-out/inductor-cache.tgz, it makes the
# next run's compiles warm).
# GPU_RUN_DRY=cpu: the same steps on the CPU with a 1-layer model, to check this script without a GPU.
# Environment: OUT (.bench-out), PYTHON (python3), GPU_RUN_STEP_SECONDS ("90 160 60 80 65"),
# GPU_RUN_CACHE_IN (.bench-out/inductor-cache.tgz), GPU_RUN_LOGS (/tmp/dflash-gpu-run).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
DRY=${GPU_RUN_DRY:-}
if [ -n "$DRY" ]; then
  OUT=${OUT:-.bench-out/gpu-run-dry}
  [ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python} || PY=${PYTHON:-python3}
  DEV=cpu
  CACHE_IN=${GPU_RUN_CACHE_IN:-}
  export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/dflash-inductor-dry}
  MODEL=(--preset cpu-small --layers 1 --device cpu --dtype float32 --prompt-len 32 --new-tokens 24)
  UNIT_REPEATS=(--repeats 3) SHORT_REPEATS=(--repeats 3) FAST_TOKENS=(--new-tokens 24)
  read -r -a BUDGET <<< "${GPU_RUN_STEP_SECONDS:-120 150 90 120 120}"
  HYBRID=(--preset qwen3.5-4b --layers 4 --device cpu --dtype float32 --prompt-len 32 --new-tokens 24 --repeats 3
          --paths fast)
else
  OUT=${OUT:-.bench-out}
  PY=${PYTHON:-python3}
  DEV=cuda
  CACHE_IN=${GPU_RUN_CACHE_IN:-.bench-out/inductor-cache.tgz}
  export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/dflash-inductor}
  MODEL=(--preset qwen3-8b --device cuda --dtype bfloat16)
  UNIT_REPEATS=() SHORT_REPEATS=(--repeats 10) FAST_TOKENS=(--new-tokens 128)
  read -r -a BUDGET <<< "${GPU_RUN_STEP_SECONDS:-90 160 60 80 65}"
  HYBRID=(--preset qwen3.5-4b --device cuda --dtype bfloat16 --paths fast compiled)
fi
[ "${GPU_RUN_HYBRID:-0}" = 1 ] && BUDGET+=("${GPU_RUN_HYBRID_SECONDS:-90}")
TOTAL=0
for b in "${BUDGET[@]}"; do TOTAL=$((TOTAL + b)); done
DEADLINE=$((START + TOTAL))
LOGS=${GPU_RUN_LOGS:-/tmp/dflash-gpu-run}
SITE=/tmp/dflash-gpu-site
rm -rf "$LOGS" && mkdir -p "$LOGS" "$OUT" || exit 1
exec > >(tee "$OUT/gpu-run.txt") 2>&1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
NOTES=$LOGS/step-notes.txt  # the lines of the current step that the closing summary repeats

# bench_engine.py in this process, so that dynamo's counters can be written at exit (also on SIGTERM from
# timeout); GPU_RUN_GRAPHS=0 compiles without CUDA graphs (mode="reduce-overhead" turns them on, and no
# environment variable turns them off again).
cat > "$LOGS/gpu_run_wrap.py" <<'EOF'
import atexit, json, os, runpy, signal, sys
import torch
if os.environ.get("GPU_RUN_GRAPHS") == "0":
    _compile = torch.compile
    def _compile_without_graphs(*args, **kwargs):
        if kwargs.get("mode") == "reduce-overhead":
            kwargs["mode"] = "default"
        return _compile(*args, **kwargs)
    torch.compile = _compile_without_graphs
def _write_counters():
    try:
        from torch._dynamo.utils import counters
        data = {k: dict(v) for k, v in counters.items() if v}
    except Exception as e:
        data = {"error": repr(e)}
    with open(os.environ["GPU_RUN_COUNTERS"], "w") as f:
        json.dump(data, f, indent=1, default=str)
atexit.register(_write_counters)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF

# One step's numbers from its JSON, dynamo counters and torch log.
cat > "$LOGS/gpu_run_summary.py" <<'EOF'
import json, re, sys


def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None


d = load(sys.argv[1]) or {}
m = d.get("meta") or {}
if m:
    print(f"  built in {m['build_seconds']:.0f}s: {m['target']}; {m['dtype']}, quant {m['quant']}")
else:
    print("  no JSON: the step ended before its first section")
for path, r in (d.get("paths") or {}).items():
    u, bits = r.get("unit_costs") or {}, []
    if r.get("compile_seconds") is not None:
        bits.append(f"compile {r['compile_seconds']:.0f}s")
    for key in ("compile_failure", "attention", "cuda_graphs", "cuda_graphs_after"):
        if r.get(key):
            bits.append(f"{key.replace('_', ' ')}: {r[key]}")
    if r.get("drafter_compiled") is False:
        bits.append("drafter eager")
    if u:
        b = max(int(k.split("_")[1]) for k in u if k.startswith("verify_"))
        bits += [f"decode 1 {1e3 * u['decode_1']:.2f} ms", f"verify {b} {1e3 * u[f'verify_{b}']:.2f} ms",
                 f"draft {b} {1e3 * u[f'draft_{b}']:.2f} ms"]
    for row in r.get("rows") or []:
        name = row["config"].replace("dflash ", "")
        bits.append(f"{name} {row['tokens_per_s']:.1f} tok/s tau {row['tau']:.2f}")
    print(f"  {path}: " + (", ".join(bits) or "skipped"))
c = load(sys.argv[2])
if c:
    ind, st, gb = c.get("inductor", {}), c.get("stats", {}), c.get("graph_break", {})
    print(f"  dynamo counters: {st.get('unique_graphs', 0)} graphs, {sum(gb.values())} graph breaks, "
          f"cudagraph_skips {ind.get('cudagraph_skips', 0)}, FX cache hits {ind.get('fxgraph_cache_hit', 0)} "
          f"misses {ind.get('fxgraph_cache_miss', 0)}")
    for reason in list(gb)[:3]:
        print(f"    graph break: {reason[:160]}")
try:
    text = open(sys.argv[3], errors="replace").read()
except OSError:
    text = ""
skips = len(re.findall(r"skipping cudagraphs", text, re.I))
recorded = len(re.findall(r"Recording (function=|cudagraph tree)", text))
print(f"  torch logs: {text.count('Recompiling function')} recompiles, {skips} CUDA-graph skips, "
      f"{recorded} CUDA graphs recorded")
for reason in sorted(set(re.findall(r"skipping cudagraphs due to ([^\n]+)", text)))[:3]:
    print(f"    skip reason: {reason[:160]}")
EOF

cat > "$LOGS/gpu_run_env.py" <<'EOF'
import importlib.util, inspect, platform, sys, warnings
import torch
import torch.nn.functional as F
print("python", platform.python_version(), sys.executable)
cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN", cudnn)
for name in ("triton", "transformers"):
    if importlib.util.find_spec(name):
        print(name, __import__(name).__version__)
    else:
        print(name, "not installed")
if importlib.util.find_spec("bitsandbytes"):
    import bitsandbytes
    import bitsandbytes.cextension as ce
    lib = getattr(getattr(ce.lib, "_lib", None), "_name", None)
    print("bitsandbytes", bitsandbytes.__version__, "| native library:", type(ce.lib).__name__, lib)
else:
    print("bitsandbytes not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu {p.name} | compute capability {p.major}.{p.minor} | {p.multi_processor_count} SMs | "
          f"{p.total_memory / 2**30:.0f} GiB")
    b = torch.backends.cuda
    print("SDPA backends enabled: flash", b.flash_sdp_enabled(), "efficient", b.mem_efficient_sdp_enabled(),
          "cudnn", b.cudnn_sdp_enabled(), "math", b.math_sdp_enabled())
else:
    print("no CUDA device | cpu threads", torch.get_num_threads())
# TORCH_LOGS names this torch knows (an unknown name makes import torch fail)
known = inspect.signature(torch._logging.set_logs).parameters
names = [n for n in ("recompiles", "graph_breaks", "perf_hints", "cudagraphs") if n in known]
open(sys.argv[1], "w").write(",".join(names))
print("TORCH_LOGS for the benchmarks:", ",".join(names))
# The fast path eager attention call (engine/static_forward.py _attend) at the Qwen3-8B shape: query heads folded onto
# their 8 K/V heads, a bool mask, keys sliced from a longer cache buffer. Which kernel runs, which accept it.
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
kv, group, hd, L = 8, 4, 128, 512
for n in (1, 16):
    q = torch.randn(1, kv, group * n, hd, device=dev, dtype=dt)
    k, v = (torch.randn(1, kv, 2 * L, hd, device=dev, dtype=dt)[:, :, :L] for _ in range(2))
    pos, keys = torch.arange(L - n, L, device=dev), torch.arange(L, device=dev)
    mask = (keys[None, :] <= pos[:, None]).repeat(group, 1)[None, None]
    accepted = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            accepted.append(backend.name.lower())
        except RuntimeError:
            pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ops = sorted({e.key for e in prof.key_averages()
                  if "attention" in e.key and e.key != "aten::scaled_dot_product_attention"})
    print(f"eager SDPA, {n} token(s) x {group} query heads per K/V head, bool mask, {L} keys: "
          f"runs {', '.join(ops) or 'math (decomposed)'} | accepted by: {', '.join(accepted)}")
EOF

later() {  # seconds promised to the steps after step $1
  local s=0 i
  for ((i = $1; i < ${#BUDGET[@]}; i++)); do s=$((s + BUDGET[i])); done
  echo "$s"
}

begin() {  # begin STEP_NUMBER NAME: sets T, this step's timeout; returns 1 (skip) when too little is left
  STEP="$1 $2"
  STEP_T0=$(date +%s)
  T=$((DEADLINE - STEP_T0 - $(later "$1")))
  : >"$NOTES"
  echo
  if ((T < 15)); then
    echo "=== $STEP: skipped, ${T}s left" | tee -a "$LOGS/summary.txt"
    return 1
  fi
  echo "=== $STEP (timeout ${T}s, $((STEP_T0 - START))s into the run)"
}

finish() {  # finish RC
  local dt=$(($(date +%s) - STEP_T0)) note=""
  { [ "$1" = 124 ] || [ "$1" = 137 ]; } && note=", TIMED OUT"
  echo "=== $STEP: ${dt}s, rc $1$note"
  { echo "$STEP: ${dt}s, rc $1$note"; cat "$NOTES"; } >>"$LOGS/summary.txt"
  tar -czf "$OUT/gpu-run-logs.tgz.part" -C "$LOGS" . && mv "$OUT/gpu-run-logs.tgz.part" "$OUT/gpu-run-logs.tgz"
}

bench() {  # bench NAME [VAR=VALUE ...] -- bench_engine.py arguments
  local name=$1 envs=() rc
  shift
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env ${envs[@]+"${envs[@]}"} TORCH_LOGS="$TORCH_LOGS_NAMES" TORCH_LOGS_OUT="$LOGS/$name.torch.log" \
    GPU_RUN_COUNTERS="$LOGS/$name.counters.json" \
    timeout -k 5 "$T" "$PY" "$LOGS/gpu_run_wrap.py" benchmarks/bench_engine.py "$@" --json "$LOGS/$name.json" \
    2>"$LOGS/$name.err" | tee "$LOGS/$name.txt"
  rc=${PIPESTATUS[0]}
  grep -E '^\[[0-9:]{8}\] ' "$LOGS/$name.err" | sed 's/^/  log: /'
  if [ "$rc" != 0 ]; then  # the end of stderr without torch's log lines: the error, if any
    grep -vE '^[VIWE][0-9]{4} |^\[[0-9:]{8}\] ' "$LOGS/$name.err" | tail -n 12 | sed 's/^/  err: /'
  fi
  "$PY" "$LOGS/gpu_run_summary.py" "$LOGS/$name.json" "$LOGS/$name.counters.json" "$LOGS/$name.torch.log" \
    | tee -a "$NOTES"
  return "$rc"
}

attention_in_compiled_code() {  # the SDPA kernels named in inductor's generated code so far
  local found
  found=$(grep -rhoE 'aten\._(scaled_dot_product|flash_attention|efficient_attention|cudnn_attention)[a-z_]*' \
    "$TORCHINDUCTOR_CACHE_DIR" --include='*.py' 2>/dev/null | sort | uniq -c | sort -rn | head -n 4 |
    awk '{printf "%s%s (%s)", (NR > 1 ? ", " : ""), $2, $1}')
  echo "  attention in the compiled code so far: ${found:-no SDPA op (decomposed, or nothing compiled)}" \
    | tee -a "$NOTES"
}

echo "gpu_run.sh ${DRY:+(dry run: $DRY) }$(date -u +%FT%TZ), steps ${BUDGET[*]} s, deadline ${TOTAL}s, out $OUT"

# ---------------------------------------------------------------- 1 environment and tests
begin 1 environment
if ls .whl/*.whl >/dev/null 2>&1; then
  rm -rf "$SITE"
  timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:$SITE
else
  echo "no .whl/*.whl: bitsandbytes only if installed (bash benchmarks/gpu_wheel.sh makes the wheel)"
fi
if [ -n "$CACHE_IN" ] && [ -f "$CACHE_IN" ]; then
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && tar -xzf "$CACHE_IN" -C "$TORCHINDUCTOR_CACHE_DIR" \
    && echo "inductor cache unpacked from $CACHE_IN: compiles may be warm from the start"
fi
{
  command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi \
    --query-gpu=name,memory.total,memory.used,driver_version,compute_cap,clocks.sm,clocks.max.sm --format=csv
  echo "cpu cores $(nproc)"
  timeout 60 "$PY" "$LOGS/gpu_run_env.py" "$LOGS/torch-logs-names" 2>&1 | grep -v '^USDT:'
} | tee "$LOGS/1-env.txt"
grep -E '^(NVIDIA|torch|triton|transformers|bitsandbytes|gpu |eager SDPA)' "$LOGS/1-env.txt" | sed 's/^/  /' >>"$NOTES"
TORCH_LOGS_NAMES=$(cat "$LOGS/torch-logs-names" 2>/dev/null || echo recompiles)
finish 0

if begin 1 tests; then
  # fp32 on the device. First the tests marked cuda in files outside the list below (at most 30 s), then the
  # engine tests: losslessness, caches, drafter masks, the compiled fast path, the doctor, a GPU + CPU split.
  tests=(tests/test_speculative.py tests/test_drafter.py tests/test_fast.py tests/test_doctor.py
         tests/test_device_map.py)
  [ -f tests/test_gpu_paths.py ] && tests+=(tests/test_gpu_paths.py)
  mapfile -t marked < <(grep -lE 'mark\.cuda\b' tests/*.py | grep -vxF -f <(printf '%s\n' "${tests[@]}"))
  rc=0
  if ((${#marked[@]} == 0)); then
    echo "no other file has tests marked cuda"
  else
    DFLASH_TEST_DEVICE=$DEV timeout -k 5 $((T < 30 ? T : 30)) "$PY" -m pytest -q -p no:cacheprovider -m cuda \
      "${marked[@]}" 2>&1 | tee "$LOGS/1-tests-cuda.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 5 ] && echo "(no test selected by -m cuda)" && rc=0
    grep -E '[0-9]+ (passed|failed|error|skipped|deselected)' "$LOGS/1-tests-cuda.txt" | tail -n 1 \
      | sed 's/^/  -m cuda: /' >>"$NOTES"
  fi
  left=$((DEADLINE - $(date +%s) - $(later 1)))
  if ((left < 5)); then
    echo "engine tests: no time left" | tee -a "$NOTES"
  else
    DFLASH_TEST_DEVICE=$DEV timeout -k 5 "$left" "$PY" -m pytest -q -x -p no:cacheprovider "${tests[@]}" 2>&1 \
      | tee "$LOGS/1-tests.txt"
    rc2=${PIPESTATUS[0]}
    grep -E '[0-9]+ (passed|failed|error)' "$LOGS/1-tests.txt" | tail -n 1 | sed 's/^/  /' >>"$NOTES"
    [ "$rc" = 0 ] && rc=$rc2
  fi
  finish "$rc"
fi

# ---------------------------------------------------------------- 2-4 unit costs
if begin 2 bf16-compiled-graphs; then
  bench 2-bf16-graphs -- "${MODEL[@]}" "${UNIT_REPEATS[@]}" --paths fast compiled --units-only
  rc=$?
  attention_in_compiled_code
  finish "$rc"
fi

if begin 3 bf16-compiled-no-graphs; then
  bench 3-bf16-nographs GPU_RUN_GRAPHS=0 -- "${MODEL[@]}" "${UNIT_REPEATS[@]}" --paths compiled --units-only
  rc=$?
  attention_in_compiled_code
  finish "$rc"
fi

if begin 4 nf4-compiled; then
  bench 4-nf4 -- "${MODEL[@]}" "${SHORT_REPEATS[@]}" --quant nf4 --paths compiled fast --units-only
  finish $?
fi

# ---------------------------------------------------------------- 5 engine table
if begin 5 bf16-engine-table; then
  path=(--paths compiled)
  if ! grep -q '"compile_seconds": [0-9]' "$LOGS/2-bf16-graphs.json" 2>/dev/null \
      || grep -q 'FAILED: eager\|compilation failed' "$LOGS/2-bf16-graphs.err" 2>/dev/null; then
    echo "step 2 did not finish compiling: the fast path instead" | tee -a "$NOTES"
    path=(--paths fast "${FAST_TOKENS[@]}")
  fi
  bench 5-bf16-table -- "${MODEL[@]}" "${SHORT_REPEATS[@]}" --prompts 1 --taus 6.5 --no-hf "${path[@]}"
  finish $?
fi

# ---------------------------------------------------------------- 6 (GPU_RUN_HYBRID=1) Qwen3.5-4B shape
if ((${#BUDGET[@]} > 5)) && begin 6 hybrid-units; then
  # Gated DeltaNet + attention: verify, draft and the per-step rollback of the linear-attention state
  bench 6-hybrid -- "${HYBRID[@]}" --units-only
  finish $?
fi

# ---------------------------------------------------------------- the inductor cache, for the next run
if [ -d "$TORCHINDUCTOR_CACHE_DIR" ]; then
  cache_tgz=/tmp/dflash-inductor-cache.tgz
  if timeout 20 tar -czf "$cache_tgz" -C "$TORCHINDUCTOR_CACHE_DIR" . 2>/dev/null \
      && (($(stat -c %s "$cache_tgz") <= 15 * 1024 * 1024)); then
    mv "$cache_tgz" "$OUT/inductor-cache.tgz"
    echo "inductor cache: $OUT/inductor-cache.tgz, $(du -h "$OUT/inductor-cache.tgz" | cut -f1)"
  else
    echo "inductor cache not kept ($(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1) unpacked): tar failed or over 15 MiB"
    rm -f "$cache_tgz"
  fi
fi

echo
echo "=== summary: $(($(date +%s) - START))s in all"
cat "$LOGS/summary.txt"
exec >&- 2>&-
wait  # for tee to write the last lines
