#!/usr/bin/env bash
# On a GPU machine, what a user gets from the wheel: dist/megamoe-*.whl (scripts/build_wheel.sh, built elsewhere)
# installed without building (pip --no-deps --no-index into WHEEL_SITE), then, with only that install on the path (no
# MEGAMOE_LIBRARY, no source tree), the library it loads named, the GPU pytest files (scripts/gpu_pytest_files.sh picks
# them) and bench/bench_small_batch.py. Logs to OUT: wheel-import.log, wheel-pytest.log, small-batch JSON and log.
# Set MEGAMOE_COMMIT to the commit the wheel was built from: the device machine's copy of .git is stale, and the
# benchmark's report names the commit.
#   MEGAMOE_COMMIT=<sha> OUT=/tmp/out bash scripts/gpu_wheel_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-out}
WHEEL_SITE=${WHEEL_SITE:-/tmp/megamoe-wheel-site}
mkdir -p "$OUT"
status=0
wheel=$(ls dist/megamoe-*.whl) || exit 1
rm -rf "$WHEEL_SITE"
python3 -m pip install -q --no-deps --no-index --no-compile --target "$WHEEL_SITE" "$wheel" || exit 1
[ -n "${MEGAMOE_COMMIT:-}" ] || echo "warning: MEGAMOE_COMMIT unset: the benchmark's report takes the commit from .git" >&2
run=(env -u MEGAMOE_LIBRARY PYTHONUNBUFFERED=1 "PYTHONPATH=$WHEEL_SITE:$PWD/bench")
"${run[@]}" python3 -c 'import megamoe, torch; print("megamoe", megamoe.__version__, "from", megamoe.__file__, "library",
    megamoe._lib.library()._name, "| torch", torch.__version__, "|", torch.cuda.get_device_name())' \
    2>&1 | tee "$OUT/wheel-import.log" || status=1
PYTEST_FILES=${PYTEST_FILES:-$(bash scripts/gpu_pytest_files.sh)}
(cd tests/python && "${run[@]}" timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest -v -rs -p no:cacheprovider \
    --durations=10 $PYTEST_FILES >"$OUT/wheel-pytest.log" 2>&1) || status=1
tail -n 3 "$OUT/wheel-pytest.log"
grep -E "^FAILED" "$OUT/wheel-pytest.log" | head -20
"${run[@]}" timeout "${BENCH_TIMEOUT:-120}" python3 bench/bench_small_batch.py --out "$OUT" \
    >"$OUT/wheel-small-batch.log" 2>&1 || status=1
tail -n 8 "$OUT/wheel-small-batch.log"
exit $status
