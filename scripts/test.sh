#!/usr/bin/env bash
# Sets up .venv if needed, then lints (ruff), type-checks the package (mypy) and runs the whole test suite
# (CPU only, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
