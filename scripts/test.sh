#!/usr/bin/env bash
# Installs what the tests need, builds libmegamoe (CUDA for sm_80 + sm_90a) once, into the binary wheel and with its
# C++ tests, runs GoogleTest, then installs the wheel into new virtual environments without the CUDA toolkit and runs
# pytest against those installs, on the newest torch and on the oldest one the package accepts; last, the README's
# first command on a machine without nvcc (scripts/test_cpu_only.sh: the CPU-only build, the CPU demo, its tests). GPU
# tests skip, with a reason, where no CUDA device is present.
#
# Needs a Debian/Ubuntu machine (apt-get, through sudo when not root, for cmake, ninja-build, libgtest-dev), a Python
# 3.10+ whose pip may install packages (a virtual environment; a system Python that refuses them, PEP 668, does not
# do), the network for PyPI (a few GB: torch twice, transformers, the frameworks) and the CUDA toolkit 12.4+ (nvcc):
# about 25 minutes on 2 cores, most of them the CUDA build. Without nvcc every build is the CPU-only one (the C++
# reference), said so at the start, and the whole run takes about 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
if ! command -v nvcc >/dev/null; then
    echo "*** nvcc (CUDA toolkit >= 12.4) not found: testing the CPU-only build (no CUDA code is compiled) ***"
    export MEGAMOE_CUDA=OFF
fi
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
# The README's first command without nvcc: the CPU-only build, installed and run.
bash scripts/test_cpu_only.sh
