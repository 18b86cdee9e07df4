#!/usr/bin/env bash
# The README's first command on a machine without the CUDA toolkit: with nvcc hidden from PATH (and MEGAMOE_CUDA=OFF,
# so that a toolkit installed where CMake still looks goes unused), `pip install .` into a new virtual environment
# builds the CPU-only library (the C++ reference) and says so; then the CPU demo (python bench/bench.py), an import
# that must give no warning, the Python tests of the CPU path and of bad input against that install, and the C++ tests
# of a CPU-only build.
#
#   bash scripts/test_cpu_only.sh
#
# PYTHON names the interpreter the venv is made from (default python3); the venv sees its site-packages (torch, numpy,
# pytest), so only the build's own tools are downloaded. The venv and the builds live in build/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source scripts/without_toolkit.sh

venv=build/venv-cpu-only
rm -rf "$venv" build/cpu-only build/cpu-only-tests
"$PYTHON" -m venv --system-site-packages "$venv"
run=(env -u CUDA_HOME -u CUDA_PATH -u CUDACXX -u MEGAMOE_LIBRARY MEGAMOE_CUDA=OFF
     "PATH=$(pwd)/$venv/bin:$(without_toolkit "$PATH")" "LD_LIBRARY_PATH=$(without_toolkit "${LD_LIBRARY_PATH:-}")")
if "${run[@]}" bash -c 'command -v nvcc'; then echo "error: nvcc still on PATH" >&2; exit 1; fi

# The README's first command, pip install . && python bench/bench.py (its build in a folder of its own).
log=build/cpu-only-install.log
if ! "${run[@]}" python -m pip install -v --disable-pip-version-check -C build-dir=build/cpu-only . >"$log" 2>&1; then
    tail -40 "$log"
    exit 1
fi
grep -q "building WITHOUT CUDA" "$log" || { echo "error: the CPU-only build did not say so ($log)" >&2; exit 1; }
"${run[@]}" python -W error -c 'import megamoe'
"${run[@]}" python -c 'import megamoe
assert not megamoe._lib.has_cuda(), "expected the CPU-only library"
print("megamoe", megamoe.__version__, "(CPU-only) from", megamoe._lib.library()._name)'
"${run[@]}" python bench/bench.py | tee build/cpu-only-demo.log
grep -q "^Next steps:" build/cpu-only-demo.log

(cd tests/python && "${run[@]}" python -m pytest -q -rs -p no:cacheprovider test_cpu.py test_bad_input.py \
    test_argument_errors.py test_argument_errors_compiled.py test_modules.py test_abi.py)

# The C++ tests of the CPU-only build (the reference and the C API's checks).
"${run[@]}" cmake -S . -B build/cpu-only-tests -G Ninja -DMEGAMOE_CUDA=OFF -DMEGAMOE_BUILD_TESTS=ON >/dev/null
"${run[@]}" ninja -C build/cpu-only-tests >/dev/null
"${run[@]}" ctest --test-dir build/cpu-only-tests --output-on-failure
