set -o pipefail
for f in .carry/lib-*.xz; do xz -dkf $f; done
nvidia-smi -L
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts
R=/tmp/r4; mkdir -p $R
start=$(date +%s)
S=qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b
for round in 4 5 6 7; do for n in base main; do
  left=$(( 150 - ($(date +%s) - start) )); [ $left -lt 25 ] && break 2
  MEGAMOE_LIBRARY=$PWD/.carry/lib-$n.so timeout $(( left < 40 ? left : 40 )) python3 scripts/ab_libs.py --name $n --shapes $S --digests none --rounds 1 --round-offset $round > $R/$n-r$round.log 2>&1
  grep -E "^== " $R/$n-r$round.log | cut -c1-150
done; done
echo "timing $(( $(date +%s) - start )) s"
export MEGAMOE_LIBRARY=$PWD/.carry/lib-main.so
left=$(( 290 - ($(date +%s) - start) ))
(cd tests/python && timeout $left python3 -m pytest -v -p no:cacheprovider -rs test_argument_errors.py test_bad_input.py test_fp8_api.py test_cuda.py test_batch_invariance_cuda.py test_grouped_cuda.py test_accumulate_cuda.py test_layouts_cuda.py test_adapters_cuda.py test_modules.py test_fp8_reference.py test_ep_cuda.py test_hf.py test_hf_models.py test_profile_scripts.py > $R/pytest.log 2>&1; echo "pytest rc=$?")
echo "pytest: $(grep -c ' PASSED' $R/pytest.log) passed, $(grep -c ' FAILED' $R/pytest.log) failed, $(grep -c ' SKIPPED' $R/pytest.log) skipped, $(grep -c ' ERROR' $R/pytest.log) errors"; grep -E " FAILED| ERROR" $R/pytest.log | head; tail -2 $R/pytest.log | cut -c1-200
tar -cJf $OUT/results.tar.xz -C /tmp r4
echo "total $(( $(date +%s) - start )) s"
