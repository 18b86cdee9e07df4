#!/usr/bin/env bash
# One device call for the FP8 layer: the FP8 layer gtests with line-buffered output (and a gdb backtrace
# if the process dies), then the accuracy run: examples/train_qwen3_moe.py with experts_implementation megamoe (bf16)
# and megamoe-fp8 from the same seed and data, STEPS steps (default 200), compared by examples/compare_losses.py
# (the mean relative loss difference over the last 100 steps). Logs in OUT. RUNS picks the runs (default "megamoe
# megamoe-fp8"; grouped_mm, HF's experts, gives the bf16 noise floor of the comparison); GTEST_FILTER=none skips the
# gtests; SEED picks the seed (default 0, in the logs' names when set).
# Inputs: CARRY (default .carry/) with libmegamoe.so[.xz] and megamoe_tests[.xz].
#   OUT=/tmp/out STEPS=200 bash scripts/gpu_fp8_train.sh
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
if [ "${GTEST_FILTER:-Fp8Layer*}" != none ]; then
    timeout 120 stdbuf -oL -eL "$CARRY/megamoe_tests" --gtest_filter="${GTEST_FILTER:-Fp8Layer*}" \
        >"$OUT/gtest-fp8-layer.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^\[ RUN" "$OUT/gtest-fp8-layer.log" | tail -n 6
    if ! grep -q "^\[  PASSED  \]" "$OUT/gtest-fp8-layer.log" && command -v gdb >/dev/null; then
        timeout 120 gdb -batch -ex run -ex bt --args "$CARRY/megamoe_tests" --gtest_filter="${GTEST_FILTER:-Fp8Layer*}" \
            >"$OUT/gdb-fp8-layer.log" 2>&1
        grep -A 25 "SIGSEGV\|signal" "$OUT/gdb-fp8-layer.log" | head -n 40
    fi
fi
tag=${SEED:+-seed$SEED}
for run in ${RUNS:-megamoe megamoe-fp8}; do
    timeout "${TRAIN_TIMEOUT:-170}" python3 examples/train_qwen3_moe.py --experts-impl "$run" --steps "${STEPS:-200}" --seed "${SEED:-0}" --log-json "$OUT/train-$run$tag.json" \
        >"$OUT/train-$run$tag.log" 2>&1 || status=1
    tail -n 3 "$OUT/train-$run$tag.log"
done
for run in ${RUNS:-megamoe megamoe-fp8}; do
    [ "$run" = megamoe ] || [ ! -f "$OUT/train-$run$tag.json" ] && continue
    python3 examples/compare_losses.py "$OUT/train-megamoe$tag.json" "$OUT/train-$run$tag.json" \
        --out "$OUT/train-$run$tag-losses.png" --title "Qwen3-30B-A3B shapes, 8 layers: bf16 against $run$tag" 2>&1 |
        tail -n 3
done
exit $status
