#!/usr/bin/env bash
# compute-sanitizer over the CUDA gtests (issue #11: memcheck, racecheck and synccheck clean, or each report
# explained in docs/DESIGN.md or docs/log/), one tool at a time with its own timeout, the reports under OUT. Inputs:
# the test binary and library built elsewhere (CARRY, default .carry/: megamoe_tests[.xz], libmegamoe.so[.xz]).
#   OUT=/tmp/out bash scripts/gpu_sanitize.sh [gtest filter, default the small CUDA and sm_90a suites]
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
FILTER=${1:-'Routing.*:Cuda.*:Sm90Forward.RaggedShapesMatchReference:Sm90Backward.RaggedShapesMatchReference:Sm90Backward.KeepHMatchesRecompute:GroupedCuda.*'}
mkdir -p "$OUT"
for f in megamoe_tests libmegamoe.so; do
    if [ -f "$CARRY/$f.xz" ]; then xz -dkf "$CARRY/$f.xz"; fi
done
chmod +x "$CARRY/megamoe_tests"
export MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so
status=0
for tool in memcheck synccheck racecheck; do
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
        "$CARRY/megamoe_tests" --gtest_filter="$FILTER" >"$OUT/sanitize-$tool.log" 2>&1
    rc=$?
    [ $rc = 0 ] || status=1
    echo "$tool: rc=$rc, $(grep -cE '^========= (Invalid|Race|Barrier|Error|Warning)' "$OUT/sanitize-$tool.log") reports"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) " "$OUT/sanitize-$tool.log" | head -4
done
exit $status
