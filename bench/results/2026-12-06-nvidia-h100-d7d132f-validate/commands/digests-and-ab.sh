# One device call: main's digests against the 58e7f51 build's committed log; the digests of `both` (every build
# option under measurement on) against main's; then base, main, dh4 and pb8 timed in alternated rounds while the
# budget lasts (ab_libs.py, RUNS calls per number). Reads the builds from the git-ignored .carry/.
set -o pipefail
start=$(date +%s)
BUDGET=${BUDGET:-560}
nvidia-smi -L
for f in .carry/lib-*.xz; do xz -dkf "$f"; done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD/bench:$PWD/scripts
R=$OUT/r; mkdir -p "$R"
BASE_LOG=bench/results/2026-12-06-nvidia-h100-ec94160-validate/base-digests.log
S=qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b
elapsed() { echo $(( $(date +%s) - start )); }
MEGAMOE_LIBRARY=$PWD/.carry/lib-main.so timeout 200 python3 scripts/ab_libs.py --name main --shapes $S >"$R/main-digests.log" 2>&1
echo "digests main rc=$? $(elapsed) s"
python3 scripts/ab_libs.py --compare "$BASE_LOG" "$R/main-digests.log" >"$R/compare-base-main.log" 2>&1; echo "compare base main rc=$?"; tail -4 "$R/compare-base-main.log"
MEGAMOE_LIBRARY=$PWD/.carry/lib-both.so timeout 150 python3 scripts/ab_libs.py --name both --shapes ${BOTH_SHAPES:-qwen3-30b-a3b,mixtral-8x7b} >"$R/both-digests.log" 2>&1
echo "digests both rc=$? $(elapsed) s"
python3 scripts/ab_libs.py --compare "$R/main-digests.log" "$R/both-digests.log" --common >"$R/compare-main-both.log" 2>&1; echo "compare main both rc=$?"; tail -4 "$R/compare-main-both.log"
for round in 1 2 3 4 5 6; do
  order=${BUILDS:-base main dh4 pb8}; [ $((round % 2)) = 0 ] && order=$(echo $order | tr " " "\n" | tac | tr "\n" " ")
  for n in $order; do
    left=$(( BUDGET - $(elapsed) )); [ $left -lt 60 ] && break 2
    MEGAMOE_LIBRARY=$PWD/.carry/lib-$n.so timeout $(( left < 120 ? left : 120 )) python3 scripts/ab_libs.py --name $n \
      --shapes $S --digests none --rounds 1 --round-offset $round --runs ${RUNS:-15} >"$R/$n-r$round.log" 2>&1
    echo "round $round $n rc=$? $(elapsed) s"
  done
done
python3 scripts/ab_libs.py --timings $(for n in ${BUILDS:-base main dh4 pb8}; do ls $R/$n-r*.log 2>/dev/null; done) | tee "$R/timings.md"
echo "total $(elapsed) s"
