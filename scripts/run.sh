#!/usr/bin/env bash
# Sets up .venv if needed, then runs dflash-cli with the given arguments. Without arguments it runs the
# built-in offline example: the real SmolLM2-135M-Instruct answering one prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- generate -m smollm2-135m --verbose "Explain speculative decoding in two sentences."
fi
exec .venv/bin/dflash-cli "$@"
