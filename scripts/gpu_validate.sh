#!/usr/bin/env bash
# One device call that validates a build on a GPU machine: the GoogleTest suite, pytest (GPU tests included) and,
# optionally, the benchmark against the peers (--bench SHAPES) and the training example (--train STEPS). Every step
# has its own timeout (a hang costs that step, not the call; gtest ~250 s and the GPU pytest files ~150 s on an H200
# at 8ff17ba, so the two fit one 600 s call), and its log goes to OUT.
# Inputs: the library and test binary built elsewhere (CARRY, default .carry/: libmegamoe.so[.xz], megamoe_tests[.xz];
# for the bench, .peers/sonicmoe from ../shared/tools/peers/pack_sonicmoe.sh).
# PYTEST_FILES overrides the pytest files (default: those that mention cuda).
#   MEGAMOE_COMMIT=<sha> OUT=/tmp/out bash scripts/gpu_validate.sh [--bench qwen3-30b-a3b,...] [--train STEPS]
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
mkdir -p "$OUT"
for f in megamoe_tests libmegamoe.so; do
    if [ -f "$CARRY/$f.xz" ]; then xz -dkf "$CARRY/$f.xz"; fi
done
chmod +x "$CARRY/megamoe_tests"
export PYTHONUNBUFFERED=1 MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so PYTHONPATH=$PWD/python:$PWD/bench
status=0
nvidia-smi -L
timeout "${GTEST_TIMEOUT:-330}" "$CARRY/megamoe_tests" >"$OUT/gtest.log" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$OUT/gtest.log" || tail -n 3 "$OUT/gtest.log"
# The test files that touch CUDA (scripts/gpu_pytest_files.sh); -v so that a run cut by its timeout still names every
# test it finished.
PYTEST_FILES=${PYTEST_FILES:-$(bash scripts/gpu_pytest_files.sh)}
(cd tests/python && timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest -v -rs --durations=15 $PYTEST_FILES \
    >"$OUT/pytest.log" 2>&1) || status=1
tail -n 3 "$OUT/pytest.log"
grep -E "^FAILED" "$OUT/pytest.log" | head -20
while [ $# -gt 0 ]; do
    case "$1" in
        --bench)
            BENCH_TIMEOUT=${BENCH_TIMEOUT:-480} OUT=$OUT bash scripts/gpu_bench_peers.sh --shapes "$2" \
                >"$OUT/bench-stdout.log" 2>&1 || status=1
            tail -n 12 "$OUT/bench-stdout.log"
            shift 2 ;;
        --train)
            for impl in megamoe grouped_mm; do
                timeout 240 python3 examples/train_qwen3_moe.py --experts-impl "$impl" --steps "$2" \
                    --log-json "$OUT/train-$impl.json" >"$OUT/train-$impl.log" 2>&1 || status=1
                tail -n 4 "$OUT/train-$impl.log"
            done
            python3 examples/compare_losses.py "$OUT/train-megamoe.json" "$OUT/train-grouped_mm.json" \
                --out "$OUT/train-losses.png" 2>&1 | tail -n 3
            shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
exit $status
