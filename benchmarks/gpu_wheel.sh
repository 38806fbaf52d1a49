#!/usr/bin/env bash
# Builds .whl/bitsandbytes-*.whl for the GPU machine, which has no network and no bitsandbytes: the PyPI
# wheel cut down to the CPU library and the CUDA libraries of the CUDA versions given (about 4 MB for 13.0
# instead of 43 MB), with its RECORD rewritten to match. Run here (pip needs the package registry), then
# carry .whl with the device call; gpu_run.sh installs it.
#   bash benchmarks/gpu_wheel.sh [CUDA_VERSION ...]     default 13.0; e.g. 12.8, or 12.8 13.0 for both
# bitsandbytes loads libbitsandbytes_cuda<torch.version.cuda>.so, so the version must be torch's CUDA version
# on the GPU machine (2.11.0+cu130 there in 2026-11: 13.0). Environment: BNB_VERSION (0.50.2),
# GPU_PYTHON_VERSION (3.12, the GPU machine's python3; the wheel is py3-none, so any 3.x gets the same file),
# BNB_PLATFORM (manylinux_2_24_x86_64), WHEEL_DIR (.whl), PYTHON (.venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${BNB_VERSION:-0.50.2}
PYVER=${GPU_PYTHON_VERSION:-3.12}
PLATFORM=${BNB_PLATFORM:-manylinux_2_24_x86_64}
DEST=${WHEEL_DIR:-.whl}
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
[ $# -gt 0 ] || set -- 13.0

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --platform "$PLATFORM" --python-version "$PYVER" \
  -d "$tmp" "bitsandbytes==$VERSION"
src=$(ls "$tmp"/bitsandbytes-*.whl)
mkdir -p "$tmp/out" "$DEST"
"$PY" - "$src" "$tmp/out" "$@" <<'EOF'
"""Copy the wheel without the native libraries not asked for; drop their RECORD lines (the rest are unchanged)."""
import os, sys, zipfile

src, dest, versions = sys.argv[1], sys.argv[2], sys.argv[3:]
keep = {"libbitsandbytes_cpu.so"} | {f"libbitsandbytes_cuda{v.replace('.', '')}.so" for v in versions}
out = os.path.join(dest, os.path.basename(src))
with zipfile.ZipFile(src) as zin:
    libs = sorted(os.path.basename(n) for n in zin.namelist() if n.startswith("bitsandbytes/libbitsandbytes_"))
    print("libraries in", os.path.basename(src) + ":", " ".join(libs))
    missing = sorted(keep - set(libs))
    if missing:
        sys.exit(f"not in this wheel: {' '.join(missing)}")
    dropped = {n for n in zin.namelist()
               if n.startswith("bitsandbytes/libbitsandbytes_") and os.path.basename(n) not in keep}
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if info.filename in dropped:
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(l for l in lines if l.split(",", 1)[0] not in dropped) + "\n").encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
print("kept:", " ".join(sorted(keep)))
EOF
# Check: every file is in RECORD with its hash and size, and pip installs it without the network.
"$PY" - "$tmp"/out/bitsandbytes-*.whl <<'EOF'
import base64, hashlib, sys, zipfile

with zipfile.ZipFile(sys.argv[1]) as z:
    record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    rows = {r.split(",")[0]: r.split(",")[1:] for r in z.read(record).decode().splitlines() if r}
    assert set(rows) == set(z.namelist()), set(rows) ^ set(z.namelist())
    for name, (digest, size) in rows.items():
        if name == record:
            continue
        data = z.read(name)
        want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert (digest, size) == (want, str(len(data))), name
print("RECORD matches", len(rows), "files")
EOF
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" "$tmp"/out/bitsandbytes-*.whl
echo "pip installs it (no network): $(cd "$tmp/site/bitsandbytes" && echo libbitsandbytes_*.so)"
rm -f "$DEST"/bitsandbytes-*.whl
mv "$tmp"/out/bitsandbytes-*.whl "$DEST"/
ls -l "$DEST"/bitsandbytes-*.whl
