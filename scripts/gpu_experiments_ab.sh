#!/usr/bin/env bash
# One device call (about 9 minutes) that decides the build option under measurement (docs/log/
# 2026-12-06-m-tile-order.md) against the default build:
#   (1) bitwise: the digests of ALL (the build with every option on, default pb8) equal `main`'s at DIGEST_SHAPES and
#       the ragged set (scripts/ab_libs.py --compare): the options reorder tiles, never the math;
#   (2) compute-sanitizer (TOOLS, default racecheck) over the M-grouped gtests on ALL's test binary;
#   (3) timings of main and each variant alternated ROUNDS times at SHAPES (every GEMM's median, fwd, fwd+bwd, CUDA
#       graph, back to back), ending in the table of medians (main first: above 1 the variant is faster).
# Inputs: CARRY (default .carry/) with lib-NAME.so.xz for main and every variant and megamoe_tests-ALL.xz, from
#   TESTS=pb8 bash scripts/pack_ab_libs.sh main=. pb8=.,-DMEGAMOE_M_PAIR_BLOCK_MIB=8
# MAIN_DIGESTS=LOG: main's digests from an earlier call (gpu_ab_libs.sh's main-digests.log, carried back): compared
# with ALL's, so main's are not run again. Logs under OUT; a summary on stdout.
#   OUT=/tmp/out bash scripts/gpu_experiments_ab.sh [VARIANT ...]      (default: pb8)
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
SHAPES=${SHAPES:-qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b}
DIGEST_SHAPES=${DIGEST_SHAPES:-qwen3-30b-a3b,mixtral-8x7b}
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(pb8)
ALL=${ALL:-${variants[-1]}}
mkdir -p "$OUT"
status=0
start=$SECONDS
echo "== bitwise: main and $ALL at $DIGEST_SHAPES and the ragged set"
OUT=$OUT/digests SHAPES=$DIGEST_SHAPES ROUNDS=0 DIGEST_TIMEOUT=${DIGEST_TIMEOUT:-150} DIGEST_BASE=${MAIN_DIGESTS:-} \
    DIGEST_NAMES=${MAIN_DIGESTS:+$ALL} DIGEST_COMMON=${MAIN_DIGESTS:+1} bash scripts/gpu_ab_libs.sh main "$ALL" ||
    status=1
echo "== sanitizers on $ALL's test binary ($((SECONDS - start)) s)"
OUT=$OUT/sanitize BUILD=$ALL TOOLS=${TOOLS:-racecheck} SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-120} \
    bash scripts/gpu_sanitize.sh 'Sm90Backward.*:Sm90Forward.RaggedShapesMatchReference:Fp8BackwardSm90.DHiddenMatchesReference:Fp8GemmSm90.*:SeparateSm90.*' ||
    status=1
echo "== timings: main ${variants[*]} ($((SECONDS - start)) s)"
OUT=$OUT/timing SHAPES=$SHAPES DIGESTS=none ROUNDS=${ROUNDS:-2} RUNS=${RUNS:-10} \
    bash scripts/gpu_ab_libs.sh main "${variants[@]}" || status=1
echo "== done in $((SECONDS - start)) s, status $status"
exit $status
