#!/usr/bin/env bash
# Installs what the tests need, builds libmegamoe (CUDA for sm_80 + sm_90a) once, into the binary wheel and with its
# C++ tests, runs GoogleTest, then installs the wheel into new virtual environments without the CUDA toolkit and runs
# pytest against those installs, on the newest torch and on the oldest one the package accepts. GPU tests skip, with a
# reason, where no CUDA device is present. Works on a fresh Debian/Ubuntu machine with the CUDA toolkit.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
command -v nvcc >/dev/null || { echo "error: nvcc (CUDA toolkit >= 12.4) not found" >&2; exit 1; }
missing=()
for pkg in cmake ninja-build libgtest-dev; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}"
fi
"$PYTHON" -m pip install -q --disable-pip-version-check "torch>=2.11" numpy pytest "nvidia-cutlass==4.2.0.0" \
    "scikit-build-core>=0.11" "transformers>=5,<6" tqdm

# One CMake build (build/): the library into the wheel (dist/) and the GoogleTest suite beside it.
bash scripts/build_wheel.sh --no-build-isolation -C build-dir=build -C cmake.define.MEGAMOE_BUILD_TESTS=ON
ctest --test-dir build --output-on-failure

# The frameworks the adapters are tested against (tests/python/test_frameworks_*.py): torchtitan, megatron-core.
bash scripts/install_frameworks.sh "$PYTHON"
# Python: the wheel installed as a user would, into new venvs with no CUDA toolkit, and pytest against those installs.
bash scripts/test_wheel.sh newest
bash scripts/test_wheel.sh oldest
