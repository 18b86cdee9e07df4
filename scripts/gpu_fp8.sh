#!/usr/bin/env bash
# One device call for the FP8 kernels: the FP8 gtests (*Fp8* suites: quantization, the M-grouped forward and backward
# GEMMs, the layer), compute-sanitizer memcheck over them, then ROUNDS rounds of megamoe_fp8_gemm_timing (bf16 against
# FP8 per GEMM, dH, the forward chain), the dense ceiling (bench/dense_gemm_ceiling.py) and megamoe_fp8_layer_timing
# (the layer through the C API, bf16 against FP8; skipped when LAYER_ROUNDS=0). Logs in OUT (timings packed into
# OUT/fp8-timing.tar.xz: a call brings back <= 8 files). SKIP_MEMCHECK=1 leaves memcheck out, MEMCHECK_TESTS narrows it
# (a gtest filter). Inputs: CARRY (default .carry/) with libmegamoe.so[.xz], megamoe_tests[.xz],
# megamoe_fp8_gemm_timing[.xz], megamoe_fp8_layer_timing[.xz] (each step skipped when its binary is not there).
#   OUT=/tmp/out STEPS="tests" bash scripts/gpu_fp8.sh; STEPS="memcheck gemm" ROUNDS=1 ...; STEPS=layer ...
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
mkdir -p "$OUT"
for f in megamoe_tests libmegamoe.so megamoe_fp8_gemm_timing megamoe_fp8_layer_timing; do
    if [ -f "$CARRY/$f.xz" ]; then xz -dkf "$CARRY/$f.xz"; fi
    if [ -f "$CARRY/$f" ] && [ "$f" != libmegamoe.so ]; then chmod +x "$CARRY/$f"; fi
done
export MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so
status=0
# STEPS picks the parts, in this order: tests, memcheck, gemm, layer.
STEPS=" ${STEPS:-tests memcheck gemm layer} "
wants() { [[ "$STEPS" == *" $1 "* ]]; }
if wants tests; then
    timeout 200 "$CARRY/megamoe_tests" --gtest_filter='*Fp8*' >"$OUT/gtest-fp8.log" 2>&1 || status=1
    grep -hE "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$OUT/gtest-fp8.log" || tail -n 5 "$OUT/gtest-fp8.log"
fi
if wants memcheck && [ "${SKIP_MEMCHECK:-0}" != 1 ]; then
    timeout "${MEMCHECK_TIMEOUT:-240}" compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
        "$CARRY/megamoe_tests" --gtest_filter="${MEMCHECK_TESTS:-*Fp8*}" >"$OUT/memcheck-fp8.log" 2>&1 || status=1
    grep -E "ERROR SUMMARY" "$OUT/memcheck-fp8.log"
fi
mkdir -p "$OUT/timing"
if wants gemm && [ -x "$CARRY/megamoe_fp8_gemm_timing" ]; then
    for round in $(seq 1 "${ROUNDS:-2}"); do
        timeout 120 "$CARRY/megamoe_fp8_gemm_timing" >"$OUT/timing/fp8-gemm-r$round.log" 2>&1 || status=1
        grep -E " ms " "$OUT/timing/fp8-gemm-r$round.log"
    done
    timeout 120 python3 bench/dense_gemm_ceiling.py >"$OUT/timing/dense-gemm-ceiling.log" 2>&1 || status=1
fi
if wants layer && [ -x "$CARRY/megamoe_fp8_layer_timing" ] && [ "${LAYER_ROUNDS:-2}" != 0 ]; then
    timeout 300 "$CARRY/megamoe_fp8_layer_timing" all "${LAYER_ROUNDS:-2}" >"$OUT/timing/fp8-layer.log" 2>&1 || status=1
    grep -E "ms|Frobenius" "$OUT/timing/fp8-layer.log"
fi
(cd "$OUT" && tar -cJf fp8-timing.tar.xz timing && rm -rf timing)
exit $status
