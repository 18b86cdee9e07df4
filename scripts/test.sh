#!/usr/bin/env bash
# Installs what the tests need, builds libmegamoe (CUDA for sm_80 + sm_90a) with its C++ tests, runs
# GoogleTest, installs the Python package with pip and runs pytest. GPU tests skip, with a reason,
# where no CUDA device is present. Works on a fresh Debian/Ubuntu machine with the CUDA toolkit.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
command -v nvcc >/dev/null || { echo "error: nvcc (CUDA toolkit >= 12.4) not found" >&2; exit 1; }
missing=()
for pkg in cmake ninja-build libgtest-dev; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}"
fi
"$PYTHON" -m pip install -q --disable-pip-version-check "torch>=2.6" numpy pytest "nvidia-cutlass==4.2.0.0" \
    "scikit-build-core>=0.10" "transformers>=5,<6" tqdm

# C++: the library and the GoogleTest suite.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build
ctest --test-dir build --output-on-failure

# Python: install the package as a user would, then test that install (not the source tree).
"$PYTHON" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps .
bash scripts/install_frameworks.sh "$PYTHON"  # torchtitan, megatron-core: tests/python/test_frameworks_*.py
(cd tests/python && "$PYTHON" -m pytest -q -rs .)
