set -o pipefail
for f in .carry/*.xz; do xz -dkf $f; done; chmod +x .carry/megamoe_tests
mkdir -p .carry/plain && cp .carry/megamoe_tests .carry/libmegamoe.so .carry/plain/
nvidia-smi -L
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts
R=/tmp/r; mkdir -p $R
start=$(date +%s)
FILTER='Routing.*:Cuda.RaggedShapesMatchReference:LayoutKernels.*:Sm90Forward.RaggedShapesMatchReference:Sm90Backward.WeightGradKernelMatchesReference:Fp8GemmSm90.*:Fp8BackwardSm90.DHiddenMatchesReference:Fp8QuantCuda.*:SeparateSm90.*'
(for n in base main; do MEGAMOE_LIBRARY=$PWD/.carry/lib-$n.so timeout 120 python3 scripts/ab_libs.py --name $n --shapes qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b > $R/$n-digests.log 2>&1; echo "digests $n rc=$?" >> $R/rc.txt; done
 python3 scripts/ab_libs.py --compare $R/base-digests.log $R/main-digests.log > $R/digest-compare.log 2>&1; echo "compare rc=$?" >> $R/rc.txt) &
(MEGAMOE_LIBRARY=$PWD/.carry/libmegamoe.so timeout 240 .carry/megamoe_tests > $R/gtest.log 2>&1; echo "gtest rc=$?" >> $R/rc.txt) &
(CARRY=.carry/plain TOOLS=racecheck SANITIZE_TIMEOUT=240 OUT=$R bash scripts/gpu_sanitize.sh "$FILTER" > $R/sanitize-racecheck.out 2>&1; echo "racecheck rc=$?" >> $R/rc.txt) &
wait
echo "phase 1 $(( $(date +%s) - start )) s"; cat $R/rc.txt; tail -4 $R/digest-compare.log; grep -E "^\[  (PASSED|FAILED)|^\[  FAILED|tests ran" $R/gtest.log | head; grep -h "RACECHECK SUMMARY" $R/sanitize-racecheck.log; grep -c "^\[       OK" $R/sanitize-racecheck.log
RUNS="dsv3-torchtitan dsv3-megamoe qwen3-torchtitan" BUDGET=290 OUT=$R/titan bash scripts/gpu_torchtitan.sh 2>&1 | tail -14
tar -cJf $OUT/results.tar.xz -C /tmp r
echo "total $(( $(date +%s) - start )) s"
