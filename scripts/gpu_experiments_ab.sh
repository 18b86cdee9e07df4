#!/usr/bin/env bash
# One device call (about 9 minutes) that decides the build options under measurement (docs/log/
# 2026-12-06-dswiglu-buffers.md, 2026-12-06-m-tile-order.md) against the default build:
#   (1) bitwise: the digests of `both` (every option on) equal `main`'s at DIGEST_SHAPES and the ragged set
#       (scripts/ab_libs.py --compare): the options reorder loads and tiles, never the math;
#   (2) compute-sanitizer (TOOLS, default racecheck) over the M-grouped gtests on `both`'s test binary;
#   (3) timings of main and each variant alternated ROUNDS times at SHAPES (every GEMM's median, fwd, fwd+bwd, CUDA
#       graph, back to back), ending in the table of medians (main first: above 1 the variant is faster).
# Inputs: CARRY (default .carry/) with lib-NAME.so.xz for main and every variant and megamoe_tests-both.xz, from
#   bash scripts/pack_ab_libs.sh main=. dh4=.,-DMEGAMOE_DSWIGLU_BUFFERS=4 pb8=.,-DMEGAMOE_M_PAIR_BLOCK_MIB=8 \
#       both=.,-DMEGAMOE_DSWIGLU_BUFFERS=4,-DMEGAMOE_M_PAIR_BLOCK_MIB=8        # with TESTS=both
# MAIN_DIGESTS=LOG: main's digests from an earlier call (gpu_ab_libs.sh's main-digests.log, carried back): compared
# with both's, so main's are not run again. Logs under OUT; a summary on stdout.
#   OUT=/tmp/out bash scripts/gpu_experiments_ab.sh [VARIANT ...]      (default: dh4 pb8 both)
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
SHAPES=${SHAPES:-qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b}
DIGEST_SHAPES=${DIGEST_SHAPES:-qwen3-30b-a3b,mixtral-8x7b}
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(dh4 pb8 both)
mkdir -p "$OUT"
status=0
start=$SECONDS
echo "== bitwise: main and both at $DIGEST_SHAPES and the ragged set"
OUT=$OUT/digests SHAPES=$DIGEST_SHAPES ROUNDS=0 DIGEST_TIMEOUT=${DIGEST_TIMEOUT:-150} DIGEST_BASE=${MAIN_DIGESTS:-} \
    DIGEST_NAMES=${MAIN_DIGESTS:+both} DIGEST_COMMON=${MAIN_DIGESTS:+1} bash scripts/gpu_ab_libs.sh main both || status=1
echo "== sanitizers on both's test binary ($((SECONDS - start)) s)"
OUT=$OUT/sanitize BUILD=both TOOLS=${TOOLS:-racecheck} SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-120} \
    bash scripts/gpu_sanitize.sh 'Sm90Backward.*:Sm90Forward.RaggedShapesMatchReference:Fp8BackwardSm90.DHiddenMatchesReference:Fp8GemmSm90.*:SeparateSm90.*' ||
    status=1
echo "== timings: main ${variants[*]} ($((SECONDS - start)) s)"
OUT=$OUT/timing SHAPES=$SHAPES DIGESTS=none ROUNDS=${ROUNDS:-2} RUNS=${RUNS:-10} \
    bash scripts/gpu_ab_libs.sh main "${variants[@]}" || status=1
echo "== done in $((SECONDS - start)) s, status $status"
exit $status
