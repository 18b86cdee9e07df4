# The second device call (the machine still warm from the first): base and main alternated, 7 rounds, 15 timed calls
# per number, every reference shape. Reads the builds from the git-ignored .carry/.
for f in .carry/lib-base.so.xz .carry/lib-main.so.xz; do xz -dkf $f; done; mkdir -p /tmp/t
(OUT=/tmp/t SHAPES=qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,mixtral-8x7b DIGESTS=none ROUNDS=7 RUNS=15 ROUND_TIMEOUT=60 \
    timeout 420 bash scripts/gpu_ab_libs.sh base main > /tmp/t/summary.log 2>&1)
python3 scripts/ab_libs.py --timings /tmp/t/base-r*.log /tmp/t/main-r*.log > /tmp/t/timings.md
tar -cJf $OUT/rounds.tar.xz -C /tmp t
