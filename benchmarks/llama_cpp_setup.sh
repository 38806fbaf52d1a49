#!/usr/bin/env bash
# Builds llama-cpp-python (llama.cpp's Python binding) once, with this CPU's native flags, into a wheel kept
# in the cache folder, and installs it into .venv: what benchmarks/llama_cpp_compare.py needs. Not for CI.
# The build compiles llama.cpp from the package index's source release: about 10-15 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
wheels=${DFLASH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash-cli}/bench-wheels/$(uname -m)-$( (grep -m1 "^model name" /proc/cpuinfo; grep -m1 "^flags" /proc/cpuinfo) | sha256sum | cut -c1-12)
pip=(.venv/bin/python -m pip --disable-pip-version-check)
if .venv/bin/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null; then
  exit 0
fi
if ! ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
  mkdir -p "$wheels"
  echo "building llama-cpp-python $version with native CPU flags (once; 10-15 minutes) ..." >&2
  CMAKE_ARGS="-DGGML_NATIVE=ON" "${pip[@]}" wheel --quiet --no-deps -w "$wheels" "llama-cpp-python==$version"
fi
"${pip[@]}" install --quiet "$wheels"/llama_cpp_python-"$version"-*.whl
