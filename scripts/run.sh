#!/usr/bin/env bash
# Sets up .venv if needed, then runs dflash-cli with the given arguments. Without arguments it runs the
# built-in offline demo pair: the real SmolLM2-135M-Instruct with the DFlash drafter shipped in the package.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the bytecode Python compiles lands in .venv and src: without it every run compiles torch again (4 s)
unset PYTHONDONTWRITEBYTECODE
if [ $# -eq 0 ]; then
  set -- generate -m demo --verbose \
    "A farmer has 12 cows and buys 7 more. Each cow gives 9 liters of milk a day. How many liters of milk does the farm get in a week? Solve it step by step."
fi
exec .venv/bin/dflash-cli "$@"
