set -o pipefail
for f in .carry/*.xz; do xz -dkf $f; done; chmod +x .carry/megamoe_tests
cp .carry/libmegamoe.so .carry/lib-main.so
mkdir -p .carry/plain && cp .carry/megamoe_tests .carry/libmegamoe.so .carry/plain/
nvidia-smi -L
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts MEGAMOE_LIBRARY=$PWD/.carry/libmegamoe.so
start=$(date +%s)
FILTER='Routing.*:Cuda.RaggedShapesMatchReference:LayoutKernels.*:Sm90Forward.RaggedShapesMatchReference:Sm90Backward.WeightGradKernelMatchesReference:Fp8GemmSm90.*:Fp8BackwardSm90.DHiddenMatchesReference:Fp8QuantCuda.*:SeparateSm90.*'
# correctness, side by side on the one GPU (no timing here)
(timeout 260 .carry/megamoe_tests > $OUT/gtest.log 2>&1; echo "gtest rc=$?" > $OUT/gtest.rc) &
for tool in memcheck racecheck synccheck initcheck; do
  (CARRY=.carry/plain TOOLS=$tool SANITIZE_TIMEOUT=270 OUT=$OUT bash scripts/gpu_sanitize.sh "$FILTER" > $OUT/sanitize-$tool.out 2>&1; echo "$tool rc=$?" > $OUT/sanitize-$tool.rc) &
done
(MEGAMOE_LIBRARY=$PWD/.carry/lib-main.so timeout 200 python3 scripts/ab_libs.py --name main --shapes qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b > $OUT/main-digests.log 2>&1; echo "digests rc=$?" > $OUT/digests.rc; python3 scripts/ab_libs.py --compare .carry/base-digests.log $OUT/main-digests.log > $OUT/digest-compare.log 2>&1; echo "compare rc=$?" >> $OUT/digests.rc) &
(cd tests/python && timeout 270 python3 -m pytest -q -p no:cacheprovider $(bash ../../scripts/gpu_pytest_files.sh) > $OUT/pytest.log 2>&1; echo "pytest rc=$?" > $OUT/pytest.rc) &
wait
echo "phase 1 $(( $(date +%s) - start )) s"; cat $OUT/*.rc; grep -E "^\[  (PASSED|FAILED)|^\[  FAILED|tests ran" $OUT/gtest.log | head; grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" $OUT/sanitize-*.log; tail -3 $OUT/digest-compare.log; tail -2 $OUT/pytest.log
# timing: the 58e7f51 build against this one, alternated
for round in 1 2; do for name in base main; do MEGAMOE_LIBRARY=$PWD/.carry/lib-$name.so timeout 90 python3 scripts/ab_libs.py --name $name --shapes mixtral-8x7b,qwen3-30b-a3b --digests none --rounds 1 --round-offset $round > $OUT/$name-r$round.log 2>&1; grep -E "^== |kernel" $OUT/$name-r$round.log | cut -c1-170; done; done
echo "total $(( $(date +%s) - start )) s"
