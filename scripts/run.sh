#!/usr/bin/env bash
# Sets up .venv if needed, then runs dflash-cli with the given arguments. Without arguments it runs the
# built-in offline demo pair: the real SmolLM2-135M-Instruct with the DFlash drafter shipped in the package.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- generate -m demo --verbose "Explain photosynthesis to a ten-year-old."
fi
exec .venv/bin/dflash-cli "$@"
