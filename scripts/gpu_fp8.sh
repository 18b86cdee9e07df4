#!/usr/bin/env bash
# One device call for the FP8 work (issue #20): the FP8 gtests (Fp8* suites: quantization, forward and backward GEMMs)
# under the default mainloop and MEGAMOE_SM90_FP8_PROMOTE=1, compute-sanitizer memcheck over them, then
# ROUNDS rounds of megamoe_fp8_gemm_timing (bf16 against FP8 per GEMM, dH, the forward chain) and the dense ceiling
# (bench/dense_gemm_ceiling.py). Logs in OUT (timings packed into OUT/fp8-timing.tar.xz: a call brings back <= 8 files).
# Inputs: CARRY (default .carry/) with libmegamoe.so[.xz], megamoe_tests[.xz], megamoe_fp8_gemm_timing[.xz].
#   OUT=/tmp/out ROUNDS=2 bash scripts/gpu_fp8.sh
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
mkdir -p "$OUT"
for f in megamoe_tests libmegamoe.so megamoe_fp8_gemm_timing; do
    if [ -f "$CARRY/$f.xz" ]; then xz -dkf "$CARRY/$f.xz"; fi
done
chmod +x "$CARRY/megamoe_tests" "$CARRY/megamoe_fp8_gemm_timing"
export MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so
status=0
timeout 120 "$CARRY/megamoe_tests" --gtest_filter='Fp8*' >"$OUT/gtest-fp8.log" 2>&1 || status=1
MEGAMOE_SM90_FP8_PROMOTE=1 timeout 120 "$CARRY/megamoe_tests" --gtest_filter='Fp8GemmSm90.*' \
    >"$OUT/gtest-fp8-promote.log" 2>&1 || status=1
grep -hE "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$OUT/gtest-fp8.log" "$OUT/gtest-fp8-promote.log"
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 "$CARRY/megamoe_tests" \
    --gtest_filter='Fp8*' >"$OUT/memcheck-fp8.log" 2>&1 || status=1
grep -E "ERROR SUMMARY" "$OUT/memcheck-fp8.log"
mkdir -p "$OUT/timing"
for round in $(seq 1 "${ROUNDS:-2}"); do
    timeout 120 "$CARRY/megamoe_fp8_gemm_timing" >"$OUT/timing/fp8-gemm-r$round.log" 2>&1 || status=1
    grep -E " ms " "$OUT/timing/fp8-gemm-r$round.log"
done
timeout 120 python3 bench/dense_gemm_ceiling.py >"$OUT/timing/dense-gemm-ceiling.log" 2>&1 || status=1
(cd "$OUT" && tar -cJf fp8-timing.tar.xz timing && rm -rf timing)
exit $status
