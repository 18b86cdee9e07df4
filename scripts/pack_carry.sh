#!/usr/bin/env bash
# Builds what the device calls run (build/: the library, the GoogleTest binary and the FP8 timing programs, sm_80 +
# sm_90a, the CUDA runtime static) and packs each xz'd into CARRY (default .carry/, git-ignored), where
# scripts/gpu_*.sh unpack them; a device call carries it with `carry: [".carry"]` (64 MiB at most: the sizes are
# printed). Run on the build machine before the first device call of a session.
# LEAN=1 packs the library alone, built lean in build-lean/ (-DMEGAMOE_LEAN_HOPPER=ON: Hopper only, the same sm_90a
# SASS without PTX or line tables, ~0.85 MB against ~4.8): the carry that fits beside the SonicMoE bundle (~56 MB) and
# the tree within a call's 64 MiB, e.g. CARRY=.carry-peer LEAN=1 for scripts/gpu_bench_peers.sh.
#   bash scripts/pack_carry.sh
#   CARRY=.carry-peer LEAN=1 bash scripts/pack_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
if [ "${LEAN:-0}" = 1 ]; then
    BUILD=build-lean CONFIG=(-DMEGAMOE_LEAN_HOPPER=ON -DMEGAMOE_BUILD_TESTS=OFF) XZ_LEVEL=-9e
    TARGETS=(libmegamoe.so)
else
    BUILD=build CONFIG=(-DMEGAMOE_BUILD_TESTS=ON) XZ_LEVEL=-9
    TARGETS=(libmegamoe.so megamoe_tests megamoe_fp8_gemm_timing megamoe_fp8_layer_timing)
fi
[ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja "${CONFIG[@]}" >/dev/null
ninja -C "$BUILD" megamoe "${TARGETS[@]:1}"
mkdir -p "$CARRY"
for f in "${TARGETS[@]}"; do xz -T0 "$XZ_LEVEL" -c "$BUILD/$f" >"$CARRY/$f.xz"; done
du -ch "$CARRY"/*.xz
