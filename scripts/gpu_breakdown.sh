#!/usr/bin/env bash
# One device call: where the time goes. (1) Kernel by kernel, megamoe beside SonicMoE and the compiled torch
# `_grouped_mm` path at the four reference shapes (scripts/profile_peer_kernels.py through scripts/gpu_bench_peers.sh,
# which installs the carried SonicMoE bundle from .peers/sonicmoe): OUT/kernels/peer_kernels.{md,json}, bench.log.
# (2) The training step of examples/train_qwen3_moe.py by kernel category and by part of the model (experts, router,
# attention, norms, embedding, LM head, optimizer, outside the model: the loss; the FP8 weight quantization apart), one
# and four micro-batches per optimizer step, megamoe, megamoe FP8 and grouped_mm (scripts/profile_train.py
# --by-module): OUT/train-*.log. Inputs: CARRY (default .carry/) with libmegamoe.so[.xz].
#   OUT=/tmp/out bash scripts/gpu_breakdown.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-out}
CARRY=${CARRY:-.carry}
mkdir -p "$OUT/kernels"
PYTHONPATH=$PWD/bench BENCH_SCRIPT=scripts/profile_peer_kernels.py BENCH_TIMEOUT=${KERNELS_TIMEOUT:-300} \
    OUT=$OUT/kernels CARRY=$CARRY bash scripts/gpu_bench_peers.sh --rounds 2 >/dev/null 2>&1
tail -n 40 "$OUT/kernels/bench.log"
export PYTHONUNBUFFERED=1 MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so PYTHONPATH=$PWD/python:$PWD/bench
for micro in 1 4; do
    timeout "${TRAIN_TIMEOUT:-150}" python3 scripts/profile_train.py --impls megamoe,megamoe-fp8,grouped_mm \
        --by-module --example-args "--micro-batches $micro" >"$OUT/train-micro$micro.log" 2>&1
    echo "train, $micro micro-batches: exit $?"
    grep -E "^==|^  [a-zA-Z/ ]+ [0-9.]+ ms|^  by part|^ +[0-9.]+ ms +[0-9.]+%" "$OUT/train-micro$micro.log" | head -80
done
