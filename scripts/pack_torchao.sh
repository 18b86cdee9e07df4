#!/usr/bin/env bash
# Downloads the torchao 0.18.0 wheel for the GPU machine's Python 3.12 into DEST (default .peers/torchao, ignored by
# git like the rest of .peers/): the FP8 peer of bench/bench.py (`torchao-fp8`: torchao's rowwise FP8 grouped GEMM,
# ../shared/tools/peers/README.md). The wheel is pure Python + Triton (~3.4 MB), so nothing else travels with it;
# scripts/gpu_bench_peers.sh installs it there (no network) with pip install --no-index --no-deps --target.
#
#   bash scripts/pack_torchao.sh [DEST]
set -euo pipefail
DEST=${1:-$(cd "$(dirname "$0")/.." && pwd)/.peers/torchao}
VERSION=0.18.0
mkdir -p "$DEST"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 "torchao==$VERSION" -d "$tmp"
wheels=("$tmp"/torchao-"$VERSION"-*.whl)
if [ ! -f "${wheels[0]}" ]; then
    echo "pack_torchao.sh: pip downloaded no torchao-$VERSION wheel" >&2
    exit 1
fi
rm -f "$DEST"/torchao-*.whl  # one wheel in DEST: the install step takes whatever torchao wheel it finds
cp "${wheels[@]}" "$DEST/"
ls -l "$DEST"/torchao-*.whl
