#!/usr/bin/env bash
# One device call that validates the experiment switches of a build (src/sm90/knobs.h) and times them: the GoogleTest
# suite at the defaults (GTEST_FILTER, default all), the sm_90a tests again under each variant's settings, then
# scripts/ab_knobs.py (the variants side by side in one process, rounds alternated, outputs compared with the
# default's), and the same script at the defaults on each other carried library (LIBS: CARRY/lib-NAME.so[.xz], e.g. a
# build of the previous main) for the changes that have no switch. Logs to OUT; a summary on stdout.
#   OUT=/tmp/out SHAPES=qwen3-30b-a3b,deepseek-v3 LIBS=base \
#   VARIANTS="default;fast=MEGAMOE_SM90_DSWIGLU_MATH:fast;kstore=MEGAMOE_SM90_K_STORE:once" bash scripts/gpu_ab_knobs.sh
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
SHAPES=${SHAPES:-qwen3-30b-a3b}
VARIANTS=${VARIANTS:-default}
MODES=${MODES:-keep-h}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
for f in "$CARRY"/*.xz; do [ -f "$f" ] && xz -dkf "$f"; done
chmod +x "$CARRY/megamoe_tests" 2>/dev/null
export PYTHONUNBUFFERED=1 MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts
status=0
nvidia-smi -L
if [ "${GTEST:-1}" = 1 ]; then
    timeout "${GTEST_TIMEOUT:-300}" "$CARRY/megamoe_tests" --gtest_filter="${GTEST_FILTER:-*}" >"$OUT/gtest.log" 2>&1 ||
        status=1
    echo "gtest (defaults):"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$OUT/gtest.log" || tail -n 3 "$OUT/gtest.log"
    IFS=';' read -ra variants <<<"$VARIANTS"
    for variant in "${variants[@]}"; do
        name=${variant%%=*}
        [ "$variant" = "$name" ] && continue  # no settings: the defaults, tested above
        settings=()
        IFS=',' read -ra pairs <<<"${variant#*=}"
        for pair in "${pairs[@]}"; do settings+=("${pair%%:*}=${pair#*:}"); done
        env "${settings[@]}" timeout "${KNOB_GTEST_TIMEOUT:-120}" "$CARRY/megamoe_tests" \
            --gtest_filter="${KNOB_GTEST_FILTER:-Sm90*:SeparateSm90*:LayoutsCuda*:AccumulateCuda.Sm90*}" \
            >"$OUT/gtest-$name.log" 2>&1 || status=1
        echo "gtest ($name: ${settings[*]}):"
        grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$OUT/gtest-$name.log" || tail -n 3 "$OUT/gtest-$name.log"
    done
fi
timeout "${AB_TIMEOUT:-240}" python3 scripts/ab_knobs.py --shapes "$SHAPES" --variants "$VARIANTS" --modes "$MODES" \
    --rounds "$ROUNDS" >"$OUT/ab.log" 2>&1 || status=1
grep -E "^(==|[a-z0-9-]+ [a-z-]+ [a-z0-9_+-]+: )|TFLOP/s \(|gather_sum|sort_rows|CUDA-graph|sum of kernels" "$OUT/ab.log" | cut -c1-150
for lib in ${LIBS:-}; do
    MEGAMOE_LIBRARY=$PWD/$CARRY/lib-$lib.so timeout "${AB_TIMEOUT:-240}" python3 scripts/ab_knobs.py \
        --shapes "$SHAPES" --variants "$lib" --modes "$MODES" --rounds 1 >"$OUT/ab-$lib.log" 2>&1 || status=1
    grep -E "^==|TFLOP/s \(|gather_sum|sort_rows|CUDA-graph|sum of kernels" "$OUT/ab-$lib.log" | cut -c1-150
done
exit $status
