#!/usr/bin/env bash
# One device call that compares builds of the library side by side (scripts/ab_libs.py): each CARRY/lib-NAME.so[.xz]
# (NAME e.g. base, main) writes the digests of its outputs (the reference shapes in SHAPES, bf16 and FP8, and the ragged
# set on the default and the portable kernels), then the builds' timings alternate ROUNDS times (each round a fresh
# process per build, so the machine's drift shows as spread, not as a difference). The digests of every build are
# compared with the first one's. Logs to OUT (NAME-digests.log, NAME-rROUND.log); a summary on stdout, ending in the
# table of medians over the rounds (ab_libs.py --timings). RUNS: timed calls per number in each round (default 5);
# DIGESTS=none: timings only; DIGEST_NAMES="NAME ...": digests of those builds only; DIGEST_BASE=LOG: a digests log
# committed from an earlier run (digests are the same on every machine) that the builds' digests are compared with
# first, e.g. the 58e7f51 build's, so that build's digests need not be run again; DIGEST_COMMON=1: only the digests
# both logs have are compared (a log of other shapes).
#   OUT=/tmp/out SHAPES=qwen3-30b-a3b,deepseek-v3 ROUNDS=2 bash scripts/gpu_ab_libs.sh base main
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
SHAPES=${SHAPES:-qwen3-30b-a3b}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
[ $# -ge 1 ] || { echo "usage: $0 NAME [NAME ...] (CARRY/lib-NAME.so[.xz] each)" >&2; exit 2; }
for name in "$@"; do
    if [ -f "$CARRY/lib-$name.so.xz" ]; then xz -dkf "$CARRY/lib-$name.so.xz"; fi
    [ -f "$CARRY/lib-$name.so" ] || { echo "missing $CARRY/lib-$name.so[.xz]" >&2; exit 2; }
done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts
status=0
logs=()
[ -n "${DIGEST_BASE:-}" ] && logs+=("$DIGEST_BASE")
if [ "${DIGESTS:-all}" != none ]; then
    for name in ${DIGEST_NAMES:-$@}; do
        MEGAMOE_LIBRARY=$PWD/$CARRY/lib-$name.so timeout "${DIGEST_TIMEOUT:-200}" python3 scripts/ab_libs.py \
            --name "$name" --shapes "$SHAPES" >"$OUT/$name-digests.log" 2>&1 || status=1
        logs+=("$OUT/$name-digests.log")
    done
    if [ ${#logs[@]} -ge 2 ]; then
        python3 scripts/ab_libs.py --compare "${logs[@]}" ${DIGEST_COMMON:+--common} || status=1
    fi
fi
rounds=()
names=("$@")
for round in $(seq "$ROUNDS"); do
    order=("${names[@]}")
    if [ $((round % 2)) = 0 ]; then  # every other round in the reverse order: a drift within a round favours no build
        order=()
        for ((i = ${#names[@]} - 1; i >= 0; i--)); do order+=("${names[i]}"); done
    fi
    for name in "${order[@]}"; do
        MEGAMOE_LIBRARY=$PWD/$CARRY/lib-$name.so timeout "${ROUND_TIMEOUT:-150}" python3 scripts/ab_libs.py \
            --name "$name" --shapes "$SHAPES" --digests none --rounds 1 --round-offset "$round" --runs "${RUNS:-5}" \
            >"$OUT/$name-r$round.log" 2>&1 || status=1
        grep -E "^== " "$OUT/$name-r$round.log" | cut -c1-170
        rounds+=("$OUT/$name-r$round.log")
    done
done
[ ${#rounds[@]} -gt 0 ] && python3 scripts/ab_libs.py --timings "${rounds[@]}"
exit $status
