set -o pipefail
for f in .carry/*.xz; do xz -dkf $f; done; chmod +x .carry/megamoe_tests
mkdir -p .carry/plain && cp .carry/megamoe_tests .carry/libmegamoe.so .carry/plain/
nvidia-smi -L
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts MEGAMOE_LIBRARY=$PWD/.carry/libmegamoe.so
L=$OUT
start=$(date +%s)
FILTER='Routing.*:Cuda.RaggedShapesMatchReference:LayoutKernels.*:Sm90Forward.RaggedShapesMatchReference:Sm90Backward.WeightGradKernelMatchesReference:Fp8GemmSm90.*:Fp8BackwardSm90.DHiddenMatchesReference:Fp8QuantCuda.*:SeparateSm90.*'
for tool in memcheck racecheck synccheck initcheck; do
  (CARRY=.carry/plain TOOLS=$tool SANITIZE_TIMEOUT=140 OUT=$L bash scripts/gpu_sanitize.sh "$FILTER" > /tmp/sanitize-$tool.out 2>&1; echo "$tool rc=$?" >> $L/rc.txt) &
done
(timeout 140 .carry/megamoe_tests --gtest_filter='Fp8LayerCuda.*:LayoutKernels.*:Routing.*:Cuda.*:LayoutsCuda.*:Sm90Forward.*:Sm90Backward.*:SeparateSm90.*:Fp8GemmSm90.*' > $L/gtest.log 2>&1; echo "gtest rc=$?" >> $L/rc.txt) &
timeout 145 python3 scripts/ab_libs.py --name main --shapes qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b > $L/main-digests.log 2>&1; echo "digests rc=$?" >> $L/rc.txt
python3 scripts/ab_libs.py --compare .carry/base-digests.log $L/main-digests.log > $L/digest-compare.log 2>&1; tail -4 $L/digest-compare.log
wait; cat $L/rc.txt; grep -E "^\[  (PASSED|FAILED)|^\[  FAILED" $L/gtest.log | head; grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" $L/sanitize-*.log
echo "total $(( $(date +%s) - start )) s" | tee -a $L/rc.txt
