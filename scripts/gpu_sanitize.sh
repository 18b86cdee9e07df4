#!/usr/bin/env bash
# compute-sanitizer over the CUDA gtests (memcheck, racecheck, synccheck and initcheck clean: each tool's log ends in
# its summary, 0 errors / 0 hazards), one tool at a time with its own timeout, the reports under OUT. The default filter
# runs every kernel family once: the routing and row kernels, the portable GEMMs, the sm_90a M-grouped (16-bit and FP8)
# and K-grouped GEMMs, the FP8 quantizers and the FP8 backward's byte transpose (one-copy weights). Inputs: the test
# binary and library built elsewhere (CARRY, default .carry/: megamoe_tests[.xz], libmegamoe.so[.xz]; BUILD=NAME:
# megamoe_tests-NAME[.xz] and lib-NAME.so[.xz] of scripts/pack_ab_libs.sh); TOOLS picks the tools.
#   OUT=/tmp/out bash scripts/gpu_sanitize.sh [gtest filter]
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
FILTER=${1:-'Routing.*:Cuda.RaggedShapesMatchReference:LayoutKernels.*:Sm90Forward.RaggedShapesMatchReference:Sm90Backward.WeightGradKernelMatchesReference:Fp8GemmSm90.*:Fp8BackwardSm90.DHiddenMatchesReference:Fp8QuantCuda.*:Fp8TransposeCuda.*:Fp8OneCopyCuda.*'}
mkdir -p "$OUT"
tests=megamoe_tests
lib=libmegamoe.so
if [ -n "${BUILD:-}" ]; then
    tests=megamoe_tests-$BUILD
    lib=lib-$BUILD.so
fi
for f in "$tests" "$lib"; do
    if [ -f "$CARRY/$f.xz" ]; then xz -dkf "$CARRY/$f.xz"; fi
done
chmod +x "$CARRY/$tests"
export MEGAMOE_LIBRARY=$PWD/$CARRY/$lib
status=0
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
        "$CARRY/$tests" --gtest_filter="$FILTER" >"$OUT/sanitize-$tool.log" 2>&1
    rc=$?
    [ $rc = 0 ] || status=1
    echo "$tool: rc=$rc, $(grep -cE '^========= (Invalid|Race|Barrier|Error|Warning)' "$OUT/sanitize-$tool.log") reports"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) " "$OUT/sanitize-$tool.log" | head -4
done
exit $status
