set -o pipefail
for f in .carry/*.xz; do xz -dkf $f; done; chmod +x .carry/megamoe_tests
cp .carry/libmegamoe.so .carry/lib-main.so
nvidia-smi -L
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts MEGAMOE_LIBRARY=$PWD/.carry/libmegamoe.so
timeout 60 .carry/megamoe_tests --gtest_filter='Fp8GemmSm90.*:Fp8BackwardSm90.*:SeparateSm90.*:Sm90Forward.*:LayoutsCuda.OnlyTheWantedGradients:Sm90Backward.KeepHMatchesRecompute' > $OUT/gtest.log 2>&1; echo "gtest rc=$?"; grep -E "^\[  (PASSED|FAILED)|^\[  FAILED" $OUT/gtest.log | head
SANITIZE_TIMEOUT=100 OUT=$OUT bash scripts/gpu_sanitize.sh 'Sm90Forward.RaggedShapesMatchReference:Sm90Backward.KeepHMatchesRecompute:SeparateSm90.*:Fp8GemmSm90.GatedMatchesReference:Fp8BackwardSm90.DHiddenMatchesReference:Fp8QuantCuda.*:LayoutKernels.GemmStepsEveryLayout:Cuda.DtypeVariantsMatchReference'; echo "sanitize rc=$?"
for round in 1 2; do for name in base main; do MEGAMOE_LIBRARY=$PWD/.carry/lib-$name.so timeout 80 python3 scripts/ab_libs.py --name $name --shapes qwen3-235b-a22b,mixtral-8x7b --digests none --rounds 1 --round-offset $round > $OUT/$name-r$round.log 2>&1; grep -E "^== " $OUT/$name-r$round.log | cut -c1-170; done; done
