#!/usr/bin/env bash
# One device call that times several builds of the library side by side: each CARRY/lib-NAME.so[.xz] (NAME e.g.
# main, fastmath) runs scripts/profile_backward.py (per-kernel backward times) and scripts/profile_forward.py, the
# builds alternated ROUNDS times (default 2) so that the machine's drift between calls shows as spread, not as a
# difference. Optional: BENCH_OPTIONS=1 adds bench/bench_options.py per build. Logs to OUT (NAME-ROUND-*.log) and a
# summary of the kernel lines on stdout. Build each library here (one build folder per branch), then
#   xz -9 -c build/libmegamoe.so > .carry/lib-NAME.so.xz
#   OUT=/tmp/out SHAPES=qwen3-30b-a3b MODES=keep-h,recompute bash scripts/gpu_ab_libs.sh main fastmath
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
SHAPES=${SHAPES:-qwen3-30b-a3b}
MODES=${MODES:-keep-h}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
[ $# -ge 1 ] || { echo "usage: $0 NAME [NAME ...] (CARRY/lib-NAME.so[.xz] each)" >&2; exit 2; }
for name in "$@"; do
    if [ -f "$CARRY/lib-$name.so.xz" ]; then xz -dkf "$CARRY/lib-$name.so.xz"; fi
    [ -f "$CARRY/lib-$name.so" ] || { echo "missing $CARRY/lib-$name.so[.xz]" >&2; exit 2; }
done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench
status=0
for round in $(seq "$ROUNDS"); do
    for name in "$@"; do
        export MEGAMOE_LIBRARY=$PWD/$CARRY/lib-$name.so
        log=$OUT/$name-$round
        timeout 120 python3 scripts/profile_backward.py --shapes "$SHAPES" --paths sm90 --modes "$MODES" --runs 3 \
            >"$log-backward.log" 2>&1 || status=1
        timeout 90 python3 scripts/profile_forward.py --shapes "$SHAPES" --paths sm90 --runs 3 \
            >"$log-forward.log" 2>&1 || status=1
        echo "== $name, round $round"
        grep -hE "sm90( keep-h| recompute)?:|TFLOP/s \(" "$log-backward.log" "$log-forward.log" |
            sed -E 's/  +/ /g' | cut -c1-160
        if [ "${BENCH_OPTIONS:-0}" = 1 ] && [ "$round" = 1 ]; then
            timeout 150 python3 bench/bench_options.py --out "$OUT/options-$name" >"$log-options.log" 2>&1 || status=1
            grep -E "^\| " "$log-options.log" | cut -c1-120
        fi
    done
done
exit $status
