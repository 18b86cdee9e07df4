#!/usr/bin/env bash
# torchtitan's own trainer with megamoe on one Hopper GPU (docs/torchtitan.md's table): the parity test
# (tests/python/test_torchtitan_batch_invariance_cuda.py), then runs of bench/titan_train.py on Qwen3-30B-A3B and
# DeepSeek-V3 16B (causal SDPA attention in place of its flex attention) cut to their first 4 layers, synthetic data:
# torchtitan's own experts, megamoe (the converter's command-line form), megamoe FP8, torchtitan's float8
# grouped-experts converter (torchao), compile off and on; then bench/titan_report.py's table (tokens/s, peak memory,
# the MoE layers' share of a step, loss agreement) and plot.
#
# The torchtitan release is the newest carried one whose trainer imports with the machine's torch: 0.3.0 needs a
# newer torch than 2.11 (torch.distributed.fsdp.DataParallelMeshDims, from 2.12), so on torch 2.11 it is 0.2.2 with
# megamoe's model converter (--model.converters megamoe) and torchao 0.16 (0.2.2's float8 MoE converter needs its
# MoETrainingConfig). The run prints which.
#
# Time: the whole call stays within about BUDGET seconds (default 420, so that it ends inside 8 minutes): the runs go
# in the order below (the two main ones first: 200 steps fit their 50 s caps), each stepping at most its cap (seconds
# after its first step; 200 steps at most) and skipped, saying so in the table, once the rest of the budget cannot
# hold its start-up. What one call leaves out, a second runs: RUNS="name ..." picks runs; bench/titan_report.py takes
# the JSONs of both calls (in their torchtitan_logs.tar.xz) for one table.
#
#   once, on the build machine (network):  bash scripts/gpu_torchtitan.sh fetch   # wheels into .whl-titan/ (~9 MB)
#   on the GPU machine:                    OUT=/path bash scripts/gpu_torchtitan.sh
#   a rehearsal of this script on a CPU:    REHEARSAL=1 OUT=/tmp/x bash scripts/gpu_torchtitan.sh
#     (the debug models, 2 layers, 3 steps of one 64-token sequence; compile and FP8 runs skipped, saying so)
# Inputs: .whl-titan/ (carried), CARRY (default .carry/) with libmegamoe.so[.xz]. Outputs in OUT (5 files):
# torchtitan_table.txt, torchtitan_results.json, torchtitan_losses.png, parity.log, torchtitan_logs.tar.xz.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl-titan

if [ "${1:-}" = fetch ]; then
    fetch() {  # fetch FOLDER SPEC...: CPython 3.12 manylinux wheels, no dependencies (the GPU machine has the rest)
        local folder=$WHEELS/$1
        shift
        mkdir -p "$folder"
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$folder" "$@"
    }
    fetch common tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0
    fetch titan-0.3 torchtitan==0.3.0 spmd_types==0.2.3 torchao==0.18.0
    fetch titan-0.2 torchtitan==0.2.2 torchao==0.16.0
    du -sh "$WHEELS"/* && du -sh "$WHEELS"
    exit 0
fi

OUT=${OUT:-/tmp/megamoe-out}
CARRY=${CARRY:-.carry}
BUDGET=${BUDGET:-420}
LOGS=/tmp/titan-runs
rm -rf "$LOGS"
mkdir -p "$OUT" "$LOGS"
if [ -f "$CARRY/libmegamoe.so.xz" ]; then xz -dkf "$CARRY/libmegamoe.so.xz"; fi
case "$CARRY" in /*) export MEGAMOE_LIBRARY=$CARRY/libmegamoe.so ;; *) export MEGAMOE_LIBRARY=$PWD/$CARRY/libmegamoe.so ;; esac
export PYTHONUNBUFFERED=1
for part in common titan-0.3 titan-0.2; do
    python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/$part" "$WHEELS/$part"/*.whl || exit 1
done
BASE=$PWD/python:$PWD/bench:/tmp/common${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}  # EXTRA_PYTHONPATH: what a rehearsal lacks
if PYTHONPATH=/tmp/titan-0.3:$BASE python3 -c "import titan_data; titan_data.install_datasets_stand_in(); \
        import torchtitan.trainer" >"$LOGS/import-torchtitan-0.3.log" 2>&1; then
    RELEASE=0.3 IMPORT_03="imports"
else
    RELEASE=0.2 IMPORT_03="does not import: $(tail -n 1 "$LOGS/import-torchtitan-0.3.log" | cut -c1-160)"
fi
RELEASE=${TORCHTITAN:-$RELEASE}  # TORCHTITAN=0.2 / 0.3 picks the release instead
export PYTHONPATH=/tmp/titan-$RELEASE:$BASE
echo "torch $(python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available() and \
    torch.cuda.get_device_name())'); torchtitan" \
    "$(python3 -c 'import torchtitan; print(torchtitan.__version__)') (torchtitan 0.3.0's trainer $IMPORT_03)"

timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_torchtitan_batch_invariance_cuda.py \
    >"$LOGS/parity.log" 2>&1
tail -n 4 "$LOGS/parity.log"
cp "$LOGS/parity.log" "$OUT/parity.log"

# name, model, experts, compile (0/1), cap (seconds of steps), torchtitan arguments. DeepSeek-V3: local batch 2 (its
# config's 4 x 4096 tokens does not leave room for 4 layers' optimizer state beside its activations on 80 GB). The
# -noac runs: no activation checkpointing (Qwen3's config checkpoints every block, so the experts' activations live
# one block at a time and the step's peak is the same for every experts implementation; without it they set it).
RUN_TABLE="
qwen3-torchtitan          qwen3_30b_a3b   torchtitan  0 50
qwen3-megamoe             qwen3_30b_a3b   megamoe     0 50
qwen3-megamoe-fp8         qwen3_30b_a3b   megamoe-fp8 0 15
qwen3-torchtitan-compile  qwen3_30b_a3b   torchtitan  1 12
qwen3-megamoe-compile     qwen3_30b_a3b   megamoe     1 12
qwen3-torchao-fp8-compile qwen3_30b_a3b   torchao-fp8 1 12
qwen3-megamoe-fp8-compile qwen3_30b_a3b   megamoe-fp8 1 12
dsv3-torchtitan           deepseek_v3_16b torchtitan  0 40 --training.local_batch_size 2
dsv3-megamoe              deepseek_v3_16b megamoe     0 40 --training.local_batch_size 2
qwen3-torchtitan-repeat   qwen3_30b_a3b   torchtitan  0 50
qwen3-torchtitan-noac     qwen3_30b_a3b   torchtitan  0 20 --activation_checkpoint.mode none
qwen3-megamoe-noac        qwen3_30b_a3b   megamoe     0 20 --activation_checkpoint.mode none
"
STARTUP_EAGER=60     # seconds: imports, the model's build and initialisation, the first steps
STARTUP_COMPILE=150  # and torch.compile of the blocks and the loss
SIZE=(--layers 4 --steps 200)
if [ -n "${REHEARSAL:-}" ]; then
    RUN_TABLE=$(sed -e 's/qwen3_30b_a3b /qwen3_moe_debug /; s/deepseek_v3_16b /deepseek_v3_debug /' \
        -e 's/ --training.local_batch_size 2//' <<<"$RUN_TABLE")
    SIZE=(--layers 2 --steps 3 --device cpu)
    REHEARSAL_ARGS="--training.local_batch_size 1 --training.seq_len 64"
fi
skipped() {  # skipped NAME MODEL EXPERTS COMPILE WHY: a JSON saying so, for the table
    printf '{"model": "%s", "experts_asked": "%s", "compile": %s, "steps_done": 0, "error": "%s"}\n' \
        "$2" "$3" "$([ "$4" = 1 ] && echo true || echo false)" "$5" >"$LOGS/$1.json"
    echo "$1: $5"
}
while read -r name model experts compile cap extra; do
    [ -z "$name" ] && continue
    if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then continue; fi
    startup=$STARTUP_EAGER
    flags=()
    # DeepSeek-V3's flavour has flex attention, which inductor autotunes for minutes at start-up: torchtitan's causal
    # SDPA attention instead, in every DeepSeek-V3 run alike
    [[ "$model" == deepseek_v3* ]] && flags=(--attention sdpa)
    if [ "$compile" = 1 ]; then
        startup=$STARTUP_COMPILE
        flags+=(--compile)
    fi
    if [ -n "${REHEARSAL:-}" ] && { [ "$compile" = 1 ] || [[ "$experts" == *fp8 ]]; }; then
        skipped "$name" "$model" "$experts" "$compile" "skipped: rehearsal on the CPU (compile, FP8: GPU only)"
        continue
    fi
    left=$((BUDGET - SECONDS))
    seconds=$((cap < left - startup ? cap : left - startup))
    if [ "$seconds" -lt 5 ]; then
        skipped "$name" "$model" "$experts" "$compile" "skipped: ${left} s of the ${BUDGET} s budget left"
        continue
    fi
    # SIGINT first: the driver writes its JSON (the steps done) on the way out
    timeout -s INT -k 20 $((startup + seconds + 30)) python3 bench/titan_train.py --model "$model" \
        --experts "$experts" "${SIZE[@]}" --seconds "$seconds" --experts-share "${flags[@]}" \
        --json "$LOGS/$name.json" -- $extra ${REHEARSAL_ARGS:-} >"$LOGS/$name.log" 2>&1
    status=$?
    [ -f "$LOGS/$name.json" ] || skipped "$name" "$model" "$experts" "$compile" \
        "failed (exit $status): $(tail -n 1 "$LOGS/$name.log" | tr -d '"\\' | cut -c1-200)"
    echo "$name: exit $status after $SECONDS s: $(tail -n 1 "$LOGS/$name.log" | cut -c1-220)"
done <<<"$RUN_TABLE"

python3 bench/titan_report.py "$LOGS" --json "$OUT/torchtitan_results.json" --table "$OUT/torchtitan_table.txt" \
    --plot "$OUT/torchtitan_losses.png" >"$LOGS/report.log" 2>&1
tar -cJf "$OUT/torchtitan_logs.tar.xz" -C /tmp titan-runs
cat "$LOGS/report.log"
