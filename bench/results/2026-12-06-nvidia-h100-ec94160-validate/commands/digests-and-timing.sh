set -o pipefail
for f in .carry/lib-*.xz; do xz -dkf $f; done
nvidia-smi -L
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts
R=/tmp/r3; mkdir -p $R
start=$(date +%s)
S=qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b
for n in base main; do MEGAMOE_LIBRARY=$PWD/.carry/lib-$n.so timeout 150 python3 scripts/ab_libs.py --name $n --shapes $S > $R/$n-digests.log 2>&1; echo "digests $n rc=$? $(( $(date +%s) - start )) s" | tee -a $R/rc.txt; done
python3 scripts/ab_libs.py --compare $R/base-digests.log $R/main-digests.log > $R/digest-compare.log 2>&1; echo "compare rc=$?" >> $R/rc.txt; tail -5 $R/digest-compare.log
for round in 1 2 3; do for n in main base; do
  left=$(( 540 - ($(date +%s) - start) )); [ $left -lt 40 ] && break 2
  MEGAMOE_LIBRARY=$PWD/.carry/lib-$n.so timeout $(( left < 110 ? left : 110 )) python3 scripts/ab_libs.py --name $n --shapes $S --digests none --rounds 1 --round-offset $round > $R/$n-r$round.log 2>&1
  grep -E "^== " $R/$n-r$round.log | cut -c1-170
done; done
tar -cJf $OUT/results.tar.xz -C /tmp r3
echo "total $(( $(date +%s) - start )) s"
