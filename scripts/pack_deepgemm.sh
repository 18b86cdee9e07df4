#!/usr/bin/env bash
# Packs the peer deepgemm-fp8 of bench/bench.py (bench/peer_deepgemm.py: DeepGEMM's blockwise FP8 grouped GEMMs through
# torchao's blockwise FP8 MoE op) for the GPU machine (Python 3.12, torch 2.11.0+cu130, no network) into DEST (default
# .peers/deepgemm/pack in this repo, ignored by git), from PyPI only, about 11 MiB:
#   sgl-deep-gemm 0.1.5.post1 (DeepGEMM, SGLang's build: a Python-independent _C.so for CUDA 13 whose torch symbols
#     all resolve in torch 2.11.0+cu130, plus the CUTLASS / CuTe headers its run-time JIT compiles the kernels from),
#   apache-tvm-ffi 0.1.11 (the FFI its _C.so is built on, pinned by it),
#   torchao 0.18.0 (the blockwise op and its Triton quantizers; the same wheel as scripts/pack_torchao.sh).
# Newer sgl-deep-gemm (0.1.5.post2 on) import symbols torch 2.11 lacks; docs/log/2026-12-06-deepgemm-peer.md has the
# survey. DEST also gets install.sh; on the GPU machine, with DEST copied there:
#   eval "$(bash .peers/deepgemm/pack/install.sh /tmp/deepgemm)"
# installs the three wheels into /tmp/deepgemm (pip --no-index --no-deps --target) and prints the export lines.
#
#   bash scripts/pack_deepgemm.sh [DEST]
set -euo pipefail
DEST=${1:-$(cd "$(dirname "$0")/.." && pwd)/.peers/deepgemm/pack}
WHEELS=(sgl-deep-gemm==0.1.5.post1 apache-tvm-ffi==0.1.11 torchao==0.18.0)
mkdir -p "$DEST"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# sgl-deep-gemm is tagged py3-none-manylinux2014 (= manylinux_2_17), tvm-ffi cp312-abi3, torchao cp310-abi3
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${WHEELS[@]}" -d "$tmp"
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    version=${spec##*==}
    found=("$tmp/${name//-/_}-$version"-*.whl)
    if [ ! -f "${found[0]}" ]; then
        echo "pack_deepgemm.sh: pip downloaded no $name $version wheel" >&2
        exit 1
    fi
done
rm -f "$DEST"/*.whl  # only these wheels: install.sh takes every wheel in DEST
cp "$tmp"/*.whl "$DEST/"
cat >"$DEST/install.sh" <<'EOI'
#!/usr/bin/env bash
# Installs the carried deepgemm-fp8 wheels into $1 (default /tmp/deepgemm), no network, and prints the export lines
# for `eval`: PYTHONPATH first, and CUDA_HOME where none is set and /usr/local/cuda exists (DeepGEMM's JIT looks for
# the CUDA headers and nvcc there; DG_JIT_USE_NVRTC=1 compiles with NVRTC instead of nvcc).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
site=${1:-/tmp/deepgemm}
mkdir -p "$site"
python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --upgrade --target "$site" \
    "$here"/*.whl >&2
echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH}"
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then
    echo "export CUDA_HOME=/usr/local/cuda"
fi
EOI
chmod +x "$DEST/install.sh"
ls -l "$DEST"
du -sh "$DEST"
