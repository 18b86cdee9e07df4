#!/usr/bin/env bash
# One device call that validates a build on a GPU machine: the GoogleTest suite, pytest (GPU tests
# included), the benchmark and (optional) the training example with megamoe and HF grouped_mm.
# Inputs: a library and test binary built elsewhere (CARRY, default .carry/), OUT for the results.
#   MEGAMOE_COMMIT=<sha> OUT=/tmp/out bash scripts/gpu_validate.sh [--train STEPS]
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.carry}
OUT=${OUT:-/tmp/megamoe-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so PYTHONPATH=$PWD/python
status=0
nvidia-smi -L
"$CARRY/megamoe_tests" >"$OUT/gtest.log" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$OUT/gtest.log"
(cd tests/python && timeout 420 python3 -m pytest -q -rs . >"$OUT/pytest.log" 2>&1) || status=1
tail -n 3 "$OUT/pytest.log"
grep -E "^FAILED" "$OUT/pytest.log" | head -20
timeout 300 python3 bench/bench.py --out "$OUT" --routing balanced,skewed >"$OUT/bench.log" 2>&1 || status=1
tail -n 19 "$OUT/bench.log"
if [ "${1:-}" = "--train" ]; then
    for impl in megamoe grouped_mm; do
        timeout 240 python3 examples/train_qwen3_moe.py --experts-impl "$impl" --steps "$2" \
            --log-json "$OUT/train-$impl.json" >"$OUT/train-$impl.log" 2>&1 || status=1
        tail -n 4 "$OUT/train-$impl.log"
    done
    python3 examples/compare_losses.py "$OUT/train-megamoe.json" "$OUT/train-grouped_mm.json" \
        --out "$OUT/train-losses.png" 2>&1 | tail -n 3
fi
exit $status
