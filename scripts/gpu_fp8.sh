#!/usr/bin/env bash
# One device call for the FP8 work (issue #20): the FP8 gtests (*Fp8* suites: quantization, the M-grouped forward and
# backward GEMMs, the K-grouped weight-gradient GEMM, the layer) under the default mainloop, Fp8GemmSm90 under
# MEGAMOE_SM90_FP8_PROMOTE=1, the M-grouped FP8 GEMMs under MEGAMOE_SM90_FP8_HALVES=1 (gtests and timing, alternated
# with the default) and the layer with MEGAMOE_FP8_WGRAD=1 (its weight gradients on the FP8 GEMM),
# compute-sanitizer memcheck over them, then ROUNDS rounds of megamoe_fp8_gemm_timing (bf16 against FP8 per GEMM, dH,
# the forward chain) and megamoe_fp8_wgrad_timing (the weight gradients), the dense ceiling
# (bench/dense_gemm_ceiling.py) and megamoe_fp8_layer_timing (the layer through the C API, bf16 against FP8: its
# variants, the weight gradients in FP8 among them, alternate in each round; skipped when LAYER_ROUNDS=0). Logs in OUT (timings
# packed into OUT/fp8-timing.tar.xz: a call brings back <= 8 files). SKIP_MEMCHECK=1 leaves memcheck out,
# MEMCHECK_TESTS narrows it (a gtest filter); NEW_TESTS (default: the kernels not yet run on a GPU) run first, alone.
# Inputs: CARRY (default .carry/) with libmegamoe.so[.xz], megamoe_tests[.xz], megamoe_fp8_gemm_timing[.xz],
# megamoe_fp8_wgrad_timing[.xz], megamoe_fp8_layer_timing[.xz] (each step skipped when its binary is not there).
#   OUT=/tmp/out STEPS="tests" bash scripts/gpu_fp8.sh; STEPS="memcheck gemm wgrad" ROUNDS=1 ...; STEPS=layer ...
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
mkdir -p "$OUT"
for f in megamoe_tests libmegamoe.so megamoe_fp8_gemm_timing megamoe_fp8_wgrad_timing megamoe_fp8_layer_timing; do
    if [ -f "$CARRY/$f.xz" ]; then xz -dkf "$CARRY/$f.xz"; fi
    if [ -f "$CARRY/$f" ] && [ "$f" != libmegamoe.so ]; then chmod +x "$CARRY/$f"; fi
done
export MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so
status=0
# STEPS picks the parts, in this order (each bounded by its timeouts; a 600 s call fits "tests", or "memcheck gemm
# wgrad", or "layer"): tests, memcheck, gemm, wgrad, layer.
STEPS=" ${STEPS:-tests memcheck gemm wgrad layer} "
wants() { [[ "$STEPS" == *" $1 "* ]]; }
gtest_summary() { grep -hE "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$@" || tail -n 5 "$@"; }
if wants tests; then
    # The kernels new since the last GPU run in a process of their own first (a crash or a hang there costs one short
    # step, not the rest), then every other FP8 suite and the switches' variants.
    NEW_TESTS=${NEW_TESTS:-Fp8LayerCuda.*}
    timeout "${NEW_TIMEOUT:-90}" "$CARRY/megamoe_tests" --gtest_filter="$NEW_TESTS" >"$OUT/gtest-fp8-new.log" 2>&1 ||
        status=1
    gtest_summary "$OUT/gtest-fp8-new.log"
    timeout 150 "$CARRY/megamoe_tests" --gtest_filter="*Fp8*:-$NEW_TESTS" >"$OUT/gtest-fp8.log" 2>&1 || status=1
    MEGAMOE_SM90_FP8_PROMOTE=1 timeout 120 "$CARRY/megamoe_tests" --gtest_filter='Fp8GemmSm90.*' \
        >"$OUT/gtest-fp8-promote.log" 2>&1 || status=1
    MEGAMOE_FP8_WGRAD=1 timeout 120 "$CARRY/megamoe_tests" --gtest_filter='Fp8LayerCuda.*' \
        >"$OUT/gtest-fp8-wgrad.log" 2>&1 || status=1
    MEGAMOE_SM90_FP8_HALVES=1 timeout 120 "$CARRY/megamoe_tests" --gtest_filter='Fp8GemmSm90.*:Fp8BackwardSm90.*' \
        >"$OUT/gtest-fp8-halves.log" 2>&1 || status=1
    # The K-grouped FP8 GEMM's epilogue variants (sm90/knobs.h), with the layer's weight gradients on it.
    for wgrad_env in "MEGAMOE_SM90_FP8_WGRAD_OVERLAP=1"; do
        echo "$wgrad_env" >>"$OUT/gtest-fp8-wgrad-variants.log"
        env $wgrad_env MEGAMOE_FP8_WGRAD=1 timeout 120 "$CARRY/megamoe_tests" \
            --gtest_filter='KGroupedFp8GemmCuda.*:Fp8LayerCuda.*' >>"$OUT/gtest-fp8-wgrad-variants.log" 2>&1 || status=1
    done
    gtest_summary "$OUT/gtest-fp8.log" "$OUT/gtest-fp8-promote.log" "$OUT/gtest-fp8-wgrad.log" \
        "$OUT/gtest-fp8-halves.log" "$OUT/gtest-fp8-wgrad-variants.log"
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
        MEGAMOE_SM90_FP8_HALVES=1 timeout 120 "$CARRY/megamoe_fp8_gemm_timing" \
            >"$OUT/timing/fp8-gemm-halves-r$round.log" 2>&1 || status=1
        echo "MEGAMOE_SM90_FP8_HALVES=1"
        grep -E " ms " "$OUT/timing/fp8-gemm-halves-r$round.log"
    done
    timeout 120 python3 bench/dense_gemm_ceiling.py >"$OUT/timing/dense-gemm-ceiling.log" 2>&1 || status=1
fi
if wants wgrad && [ -x "$CARRY/megamoe_fp8_wgrad_timing" ]; then
    for round in $(seq 1 "${ROUNDS:-2}"); do
        timeout 150 "$CARRY/megamoe_fp8_wgrad_timing" >"$OUT/timing/fp8-wgrad-r$round.log" 2>&1 || status=1
        grep -E " ms |FAILED" "$OUT/timing/fp8-wgrad-r$round.log"
        for wgrad_env in "MEGAMOE_SM90_FP8_WGRAD_OVERLAP=1"; do
            log="$OUT/timing/fp8-wgrad-r$round-${wgrad_env//[ =]/_}.log"
            env $wgrad_env timeout 150 "$CARRY/megamoe_fp8_wgrad_timing" >"$log" 2>&1 || status=1
            echo "$wgrad_env"
            grep -E " fp8  | ms .*FAILED" "$log"
        done
    done
fi
if wants layer && [ -x "$CARRY/megamoe_fp8_layer_timing" ] && [ "${LAYER_ROUNDS:-2}" != 0 ]; then
    timeout 300 "$CARRY/megamoe_fp8_layer_timing" all "${LAYER_ROUNDS:-2}" >"$OUT/timing/fp8-layer.log" 2>&1 || status=1
    grep -E "ms|bitwise|DIFFER|Frobenius" "$OUT/timing/fp8-layer.log"
fi
(cd "$OUT" && tar -cJf fp8-timing.tar.xz timing && rm -rf timing)
exit $status
