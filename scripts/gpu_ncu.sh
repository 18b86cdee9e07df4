#!/usr/bin/env bash
# One device call of Nsight Compute profiles (--set full, source counters, clocks left alone) of chosen kernels of
# scripts/ncu_moe.py's second pass, each exported as text to OUT: NAME-details.txt (every section) and
# NAME-sass.csv (per-SASS-instruction samples and stall reasons), the report NAME.ncu-rep beside them.
# The text exports are packed into OUT/ncu-text.tar.xz as well (a device call brings back at most 8 files; drop the
# reports with KEEP_REPORTS=0).
# Each PROFILE is NAME:SHAPE:KERNEL_REGEX:SKIP[:VAR=VALUE,...] (SKIP counts the matching launches before it: the
# first pass's and the second pass's earlier ones; keep-h mode runs 4 m_grouped and 2 k_grouped kernels a pass).
# NCU_ARGS adds arguments of scripts/ncu_moe.py (--precision fp8: the FP8 layer).
#   OUT=/tmp/out PROFILES="up-q235:qwen3-235b-a22b:m_grouped:4 dh-q30:qwen3-30b-a3b:m_grouped:6" bash scripts/gpu_ncu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
mkdir -p "$OUT"
for f in "$CARRY"/*.xz; do [ -f "$f" ] && xz -dkf "$f"; done
export PYTHONUNBUFFERED=1 MEGAMOE_LIBRARY=${MEGAMOE_LIBRARY:-$PWD/$CARRY/libmegamoe.so} PYTHONPATH=$PWD/python:$PWD/bench
status=0
for profile in ${PROFILES:?PROFILES=NAME:SHAPE:KERNEL_REGEX:SKIP[:VAR=VALUE,...] ...}; do
    IFS=':' read -r name shape regex skip settings <<<"$profile"
    env_args=()
    IFS=',' read -ra pairs <<<"${settings:-}"
    for pair in "${pairs[@]}"; do env_args+=("$pair"); done
    env "${env_args[@]}" timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --set full --import-source no \
        --section SourceCounters -k "regex:$regex" --launch-skip "$skip" --launch-count 1 -f -o "$OUT/$name" \
        python3 scripts/ncu_moe.py --shape "$shape" ${NCU_ARGS:-} >"$OUT/$name-ncu.log" 2>&1 || status=1
    tail -n 2 "$OUT/$name-ncu.log"
    ncu --import "$OUT/$name.ncu-rep" --page details --print-units base >"$OUT/$name-details.txt" 2>&1 || status=1
    ncu --import "$OUT/$name.ncu-rep" --page source --print-source sass --csv >"$OUT/$name-sass.csv" 2>&1 || status=1
    grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Issue Slots Busy|No Eligible|Achieved Occupancy|Tensor" \
        "$OUT/$name-details.txt" | head -20
done
(cd "$OUT" && tar -cJf ncu-text.tar.xz ./*-details.txt ./*-sass.csv ./*-ncu.log)
if [ "${KEEP_REPORTS:-1}" = 0 ]; then rm -f "$OUT"/*.ncu-rep "$OUT"/*-details.txt "$OUT"/*-sass.csv "$OUT"/*-ncu.log; fi
exit $status
