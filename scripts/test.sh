#!/usr/bin/env bash
# Sets up .venv if needed, then lints (ruff), type-checks the package (mypy) and runs the whole test suite
# (CPU only, no network), on as many workers as there are cores (up to 4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The suite starts about 80 Python processes: with PYTHONDONTWRITEBYTECODE set (some sandboxes and CI images
# set it) each would compile torch and transformers from source again, 4-5 s apiece on a slow CPU.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check src tests benchmarks
# mypy (one core, about a minute from a cold cache) runs beside the tests, its report printed after them
mypy_log=$(mktemp)
trap 'rm -f "$mypy_log"' EXIT
.venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
# one worker per core (at most 4; pytest-xdist)
status=0
.venv/bin/python -m pytest -q -n auto --maxprocesses 4 "$@" || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat "$mypy_log"
[ "$mypy_status" -eq 0 ] || { echo "mypy found problems (above)" >&2; [ "$status" -ne 0 ] || status=1; }
exit "$status"
