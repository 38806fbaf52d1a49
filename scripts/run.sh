#!/usr/bin/env bash
# Sets up .venv if needed, then runs dflash-cli with the given arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dflash-cli "${@:---help}"
