#!/usr/bin/env bash
# Tests what users install: the wheel in dist/ (scripts/build_wheel.sh) installed into a new virtual environment and
# the Python suite (tests/python) run against that install, not the source tree, with no CUDA toolkit in reach (nvcc
# off PATH, CUDA_HOME unset) and no MEGAMOE_LIBRARY. GPU tests skip, with a reason, where no CUDA device is present.
#
#   bash scripts/test_wheel.sh newest   # a venv over this Python's site-packages (its torch, transformers and the
#                                       # frameworks the adapter tests use), torch upgraded to the newest release
#   bash scripts/test_wheel.sh oldest   # an isolated venv with the oldest torch pyproject.toml accepts, numpy and
#                                       # pytest alone (also shows the wheel needs nothing else, nvidia-cutlass included);
#                                       # the frameworks' own tests (test_frameworks_*.py: torchtitan needs tokenizers,
#                                       # megatron-core more) run in the newest one only
#
# PYTHON names the interpreter the venvs are made from (default python3); they live in build/venv-<which>.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
which=${1:?usage: test_wheel.sh newest|oldest}
oldest_torch=$(sed -n 's/^dependencies = \["torch>=\([0-9.]*\)".*\]$/\1/p' pyproject.toml)
case "$which" in
    newest) venv_args=(--system-site-packages) torch_spec=(--upgrade torch) pytest_args=() ;;
    oldest) venv_args=() torch_spec=("torch==${oldest_torch:?no torch>= floor in pyproject.toml}.*")
        pytest_args=(--ignore=test_frameworks_torchtitan.py --ignore=test_frameworks_megatron.py) ;;
    *) echo "usage: test_wheel.sh newest|oldest" >&2; exit 2 ;;
esac
wheel=$(ls dist/megamoe-*.whl)

venv=build/venv-$which
rm -rf "$venv"
"$PYTHON" -m venv "${venv_args[@]}" "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "${torch_spec[@]}"
"${pip[@]}" "$wheel" numpy pytest
"${pip[@]}" --force-reinstall --no-deps "$wheel"  # into the venv even where the machine's Python has this version

# The user's machine: no toolkit on the search paths (no folder named cuda, none holding an nvcc, a wrapper's included),
# nothing pointing at one or at another libmegamoe.so.
source scripts/without_toolkit.sh
run=(env -u CUDA_HOME -u CUDA_PATH -u LIBRARY_PATH -u MEGAMOE_LIBRARY "PATH=$(pwd)/$venv/bin:$(without_toolkit "$PATH")"
     "LD_LIBRARY_PATH=$(without_toolkit "${LD_LIBRARY_PATH:-}")")
if "${run[@]}" bash -c 'command -v nvcc'; then echo "error: nvcc still on PATH" >&2; exit 1; fi
"${run[@]}" python -c 'import megamoe, torch; print("megamoe", megamoe.__version__, "from", megamoe._lib.library()._name,
    "| torch", torch.__version__)'
(cd tests/python && "${run[@]}" python -m pytest -q -rs -p no:cacheprovider "${pytest_args[@]}" .)
