#!/usr/bin/env bash
# Builds the libraries a side-by-side device call compares (scripts/gpu_ab_libs.sh) and packs each xz'd into CARRY
# (default .carry/, git-ignored) as lib-NAME.so.xz. Each argument is NAME=REV[,CMAKE_ARG...]: REV a commit (built in
# a git worktree under BUILD_ROOT) or "." (this working tree, in build-NAME/), the CMake arguments added to the
# configure (e.g. -DMEGAMOE_M_PAIR_BLOCK_MIB=8). TESTS="NAME ..." also packs those builds' GoogleTest binary as
# megamoe_tests-NAME.xz (for compute-sanitizer). Builds run one after another (about 6-15 minutes each on 2 cores).
#   bash scripts/pack_ab_libs.sh base=58e7f51 main=. pb8=.,-DMEGAMOE_M_PAIR_BLOCK_MIB=8
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
BUILD_ROOT=${BUILD_ROOT:-/tmp/megamoe-ab}
[ $# -ge 1 ] || { echo "usage: $0 NAME=REV[,CMAKE_ARG...] ..." >&2; exit 2; }
mkdir -p "$CARRY" "$BUILD_ROOT"
for spec in "$@"; do
    name=${spec%%=*}
    rest=${spec#*=}
    IFS=, read -r -a fields <<<"$rest"
    rev=${fields[0]}
    cmake_args=("${fields[@]:1}")
    if [ "$rev" = . ]; then
        src=$PWD
        build=$PWD/build-$name
    else
        src=$BUILD_ROOT/src-$name
        [ -d "$src" ] || git worktree add --detach "$src" "$rev" >/dev/null
        git -C "$src" checkout --detach -q "$rev"
        build=$src/build
    fi
    tests=OFF
    [[ " ${TESTS:-} " == *" $name "* ]] && tests=ON
    echo "== $name: $rev ${cmake_args[*]:-} (tests $tests)"
    cmake -S "$src" -B "$build" -G Ninja -DMEGAMOE_BUILD_TESTS=$tests "${cmake_args[@]}" >"$BUILD_ROOT/$name-cmake.log"
    targets=(megamoe)
    [ $tests = ON ] && targets+=(megamoe_tests)
    ninja -C "$build" "${targets[@]}" >"$BUILD_ROOT/$name-build.log" || { tail -30 "$BUILD_ROOT/$name-build.log"; exit 1; }
    xz -T0 -9 -c "$build/libmegamoe.so" >"$CARRY/lib-$name.so.xz"
    [ $tests = ON ] && xz -T0 -9 -c "$build/megamoe_tests" >"$CARRY/megamoe_tests-$name.xz"
done
du -ch "$CARRY"/lib-*.so.xz "$CARRY"/megamoe_tests-*.xz 2>/dev/null
