#!/usr/bin/env bash
# One device call: bench/bench.py (megamoe beside SonicMoE, the compiled and eager torch paths and the dense GEMM; its
# FP8 variants beside torchao's FP8 path) on a GPU machine without network. Inputs, carried from here:
#   CARRY (default .carry/): libmegamoe.so built here, or libmegamoe.so.xz; beside .peers/sonicmoe (~56 MB) only the
#   lean library fits a call's 64 MiB with the tree: CARRY=.carry-peer LEAN=1 bash scripts/pack_carry.sh (~0.85 MB);
#   .peers/sonicmoe: ../shared/tools/peers/pack_sonicmoe.sh .peers/sonicmoe (without it the SonicMoE column says why);
#   .peers/torchao: scripts/pack_torchao.sh (the torchao 0.18.0 wheel of the FP8 peer torchao-fp8; without it its
#   rows say why);
#   QUACK_CACHE_TAR (default CARRY/quack-cache.tar.xz): QuACK's cache folder from an earlier call, unpacked into
#   QUACK_CACHE_DIR (scripts/quack_cache.sh): the autotuning of the peer sonicmoe-tuned (SonicMoE with QuACK's
#   autotuned GEMMs) is then not done again.
# Results go to OUT, rewritten after every case (a run cut short keeps the cases done); bench.log has it all; and
# OUT/quack-cache.tar.xz, QUACK_CACHE_DIR packed after the run (also one cut short by BENCH_TIMEOUT): copy it to
# CARRY/quack-cache.tar.xz here for the next call.
# BENCH_SCRIPT runs another script with the same peers installed (scripts/profile_peer_kernels.py: kernel by kernel).
#   MEGAMOE_COMMIT=<sha> OUT=/tmp/out bash scripts/gpu_bench_peers.sh [bench.py arguments]
#
# sonicmoe-tuned autotunes every GEMM of a shape on its first call, in the bench's check before timing: about 3.5
# minutes for the forward's GEMMs on an H200, more for the backward's. A first run therefore takes one device call per
# shape (timeout_s 600; carry .carry, holding libmegamoe.so.xz and the newest quack-cache.tar.xz, and .peers/sonicmoe):
#   MEGAMOE_COMMIT=<sha> BENCH_TIMEOUT=520 bash scripts/gpu_bench_peers.sh --shapes qwen3-30b-a3b \
#       --peers sonicmoe,sonicmoe-tuned --no-fp8 --timings per_call,graph --quick
# then copy OUT/quack-cache.tar.xz to .carry/quack-cache.tar.xz here and run it again with --shapes qwen3-235b-a22b.
# A call cut short by BENCH_TIMEOUT still packs the tuning done so far: run the same shape again and it goes on from
# there. Once both shapes' tuning is carried, one call times both (--shapes qwen3-30b-a3b,qwen3-235b-a22b), with
# nothing autotuned; bench/plot.py --merge joins per-shape runs of one commit.
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
QUACK_CACHE_TAR=${QUACK_CACHE_TAR:-$CARRY/quack-cache.tar.xz}
bash scripts/quack_cache.sh unpack "$QUACK_CACHE_TAR" "$QUACK_CACHE_DIR"
# QuACK compiles the configs it autotunes in parallel worker processes (8 unless told): one per core here
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-$(nproc)}
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
rc=${PIPESTATUS[0]}
bash scripts/quack_cache.sh pack "$QUACK_CACHE_DIR" "$OUT/quack-cache.tar.xz" 2>&1 | tee -a "$OUT/bench.log"
exit "$rc"
