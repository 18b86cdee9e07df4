#!/usr/bin/env bash
# One device call: bench/bench.py (megamoe beside SonicMoE, the compiled and eager torch paths and the dense GEMM; its
# FP8 variants beside torchao's FP8 path) on a GPU machine without network. Inputs, carried from here:
#   CARRY (default .carry/): libmegamoe.so built here, or libmegamoe.so.xz (xz -9: ~1.2 MB instead of ~10 MB);
#   .peers/sonicmoe: ../shared/tools/peers/pack_sonicmoe.sh .peers/sonicmoe (without it the SonicMoE column says why);
#   .peers/torchao: scripts/pack_torchao.sh (the torchao 0.18.0 wheel of the FP8 peer torchao-fp8; without it its
#   rows say why).
# Results go to OUT, rewritten after every case (a run cut short keeps the cases done); bench.log has it all.
# BENCH_SCRIPT runs another script with the same peers installed (scripts/profile_peer_kernels.py: kernel by kernel).
#   MEGAMOE_COMMIT=<sha> OUT=/tmp/out bash scripts/gpu_bench_peers.sh [bench.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
mkdir -p "$OUT"
# a carried .xz always wins over a libmegamoe.so a warm machine kept from an earlier call
if [ -f "$CARRY/libmegamoe.so.xz" ]; then xz -dkf "$CARRY/libmegamoe.so.xz"; fi
export PYTHONUNBUFFERED=1 MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
# JIT caches beside the tree (ignored, so a later call on a warm machine finds them)
export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-$PWD/.cache/quack}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
if [ -f .peers/sonicmoe/install.sh ]; then
    t0=$SECONDS
    if env_line=$(bash .peers/sonicmoe/install.sh /tmp/peers); then
        eval "$env_line"
        echo "SonicMoE bundle installed in $((SECONDS - t0)) s" >&2
    else
        echo "SonicMoE bundle did not install: its column will say why" >&2
    fi
fi
shopt -s nullglob
torchao_wheels=(.peers/torchao/torchao-*.whl)
shopt -u nullglob
if [ ${#torchao_wheels[@]} -gt 0 ]; then
    t0=$SECONDS
    if python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --upgrade --target /tmp/site \
            "${torchao_wheels[@]}"; then
        export PYTHONPATH=/tmp/site:$PYTHONPATH
        echo "torchao wheel installed in $((SECONDS - t0)) s" >&2
    else
        echo "torchao wheel did not install: the torchao-fp8 rows will say why" >&2
    fi
fi
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found" >&2
timeout "${BENCH_TIMEOUT:-560}" python3 "${BENCH_SCRIPT:-bench/bench.py}" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
exit "${PIPESTATUS[0]}"
