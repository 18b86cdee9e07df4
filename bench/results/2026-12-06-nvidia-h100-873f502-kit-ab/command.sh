set -o pipefail
for f in .carry/*.xz; do xz -dkf $f; done; chmod +x .carry/megamoe_tests .carry/megamoe_fp8_layer_timing
cp .carry/libmegamoe.so .carry/lib-main.so
nvidia-smi -L
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts MEGAMOE_LIBRARY=$PWD/.carry/libmegamoe.so
timeout 250 .carry/megamoe_tests > $OUT/gtest.log 2>&1; echo "gtest rc=$?"; grep -E "^\[  (PASSED|FAILED)|^\[  FAILED|tests ran" $OUT/gtest.log | head -20
SHAPES=qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b ROUNDS=1 DIGEST_TIMEOUT=140 ROUND_TIMEOUT=110 OUT=$OUT bash scripts/gpu_ab_libs.sh base main; echo "ab rc=$?"
tail -3 $OUT/main-digests.log
