#!/usr/bin/env bash
# Builds what the device calls run (build/: the library, the GoogleTest binary and the FP8 timing programs, sm_80 +
# sm_90a, the CUDA runtime static) and packs each xz'd into CARRY (default .carry/, git-ignored), where
# scripts/gpu_*.sh unpack them; a device call carries it with `carry: [".carry"]` (64 MiB at most: the sizes are
# printed). Run on the build machine before the first device call of a session.
#   bash scripts/pack_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
TARGETS=(libmegamoe.so megamoe_tests megamoe_fp8_gemm_timing megamoe_fp8_layer_timing)
[ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMEGAMOE_BUILD_TESTS=ON >/dev/null
ninja -C build megamoe "${TARGETS[@]:1}"
mkdir -p "$CARRY"
for f in "${TARGETS[@]}"; do xz -T0 -9 -c "build/$f" >"$CARRY/$f.xz"; done
du -ch "$CARRY"/*.xz
