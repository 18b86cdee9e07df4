#!/usr/bin/env bash
# One device call that compares builds of the library side by side (scripts/ab_libs.py): each CARRY/lib-NAME.so[.xz]
# (NAME e.g. base, main) writes the digests of its outputs (the reference shapes in SHAPES, bf16 and FP8, and the ragged
# set on the default and the portable kernels), then the builds' timings alternate ROUNDS times (each round a fresh
# process per build, so the machine's drift shows as spread, not as a difference). The digests of every build are
# compared with the first one's. Logs to OUT (NAME-digests.log, NAME-rROUND.log); a summary on stdout.
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
for name in "$@"; do
    MEGAMOE_LIBRARY=$PWD/$CARRY/lib-$name.so timeout "${DIGEST_TIMEOUT:-200}" python3 scripts/ab_libs.py --name "$name" \
        --shapes "$SHAPES" >"$OUT/$name-digests.log" 2>&1 || status=1
    logs+=("$OUT/$name-digests.log")
done
python3 scripts/ab_libs.py --compare "${logs[@]}" || status=1
for round in $(seq "$ROUNDS"); do
    for name in "$@"; do
        MEGAMOE_LIBRARY=$PWD/$CARRY/lib-$name.so timeout "${ROUND_TIMEOUT:-150}" python3 scripts/ab_libs.py \
            --name "$name" --shapes "$SHAPES" --digests none --rounds 1 --round-offset "$round" \
            >"$OUT/$name-r$round.log" 2>&1 || status=1
        grep -E "^== " "$OUT/$name-r$round.log" | cut -c1-170
    done
done
exit $status
