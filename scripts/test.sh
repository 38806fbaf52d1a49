#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite (CPU only, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
