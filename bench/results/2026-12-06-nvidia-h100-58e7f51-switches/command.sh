set -o pipefail
for f in .carry/*.xz; do xz -dkf $f; done; chmod +x .carry/megamoe_tests .carry/megamoe_fp8_layer_timing
nvidia-smi -L
export MEGAMOE_LIBRARY=$PWD/.carry/libmegamoe.so PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts PYTHONUNBUFFERED=1
timeout 100 .carry/megamoe_tests --gtest_filter='Sm90Backward.MGroupedLateDecode*:KGroupedFp8GemmCuda.*' > $OUT/gtest.log 2>&1; grep -E "^\[  (PASSED|FAILED)" $OUT/gtest.log
timeout 120 compute-sanitizer --tool racecheck --print-limit 20 .carry/megamoe_tests --gtest_filter='KGroupedFp8GemmCuda.*' > $OUT/racecheck-kfp8.log 2>&1; grep -E "RACECHECK SUMMARY|^\[  (PASSED|FAILED)" $OUT/racecheck-kfp8.log
timeout 330 python3 scripts/ab_knobs.py --shapes qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3 --variants "default;late=MEGAMOE_SM90_M_LATE_DECODE:1;pdl=MEGAMOE_SM90_PDL:1;sorted=MEGAMOE_SM90_SORTED_DY:1" --rounds 2 > $OUT/ab.log 2>&1; echo "ab rc=$?"
for s in qwen3-30b-a3b qwen3-235b-a22b deepseek-v3; do timeout 80 .carry/megamoe_fp8_layer_timing $s 2 >> $OUT/fp8-layer.log 2>&1; done
grep -E "round .*(bf16|fp8 |fp8-wgrad)|fp8-wgrad " $OUT/fp8-layer.log
grep -E "^(==|[a-z0-9-]+ [a-z-]+ [a-z0-9_+-]+: )|CUDA-graph|compare|bitwise|differs" $OUT/ab.log | cut -c1-160 | tail -60
