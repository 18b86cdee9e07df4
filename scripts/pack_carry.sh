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
mkdir -p "$CARRY"
if [ "${LEAN:-0}" = 1 ]; then
    [ -f build-lean/build.ninja ] ||
        cmake -S . -B build-lean -G Ninja -DMEGAMOE_LEAN_HOPPER=ON -DMEGAMOE_BUILD_TESTS=OFF >/dev/null
    ninja -C build-lean megamoe
    xz -T0 -9e -c build-lean/libmegamoe.so >"$CARRY/libmegamoe.so.xz"
    du -h "$CARRY/libmegamoe.so.xz"
    exit 0
fi
TARGETS=(libmegamoe.so megamoe_tests megamoe_fp8_gemm_timing megamoe_fp8_layer_timing)
[ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMEGAMOE_BUILD_TESTS=ON >/dev/null
ninja -C build megamoe "${TARGETS[@]:1}"
for f in "${TARGETS[@]}"; do xz -T0 -9 -c "build/$f" >"$CARRY/$f.xz"; done
du -ch "$CARRY"/*.xz
