#!/usr/bin/env bash
# QuACK's cache folder (QUACK_CACHE_DIR: SonicMoE's autotuning results, <key>/<gemm>.autotune.json, and the CuTe-DSL
# kernels it compiled, <fingerprint>/<hash>.o) carried between GPU machines as one tar.xz, so that the autotuning of
# the sonicmoe-tuned peer (minutes per shape) is paid once:
#   bash scripts/quack_cache.sh unpack TAR DIR   # TAR's files into DIR (kept: what DIR already holds), if TAR exists
#   bash scripts/quack_cache.sh pack DIR TAR     # DIR into TAR: everything, or, where that tar.xz would be over
#                                                # QUACK_CACHE_MAX_MB (default 4), the autotuning results alone
# The autotuning results are a few KiB per shape and are what saves the minutes (with them a later call compiles only
# the chosen config of each GEMM, as the untuned peer compiles its default one); the compiled kernels, far larger,
# save that compile. The default bound leaves the SonicMoE bundle (~57 MiB) room in a call's 64 MiB working tree.
# Unpacking merges, so runs of one shape per call accumulate every shape's tuning: pack after each and carry the
# newest tar.xz to the next call.
set -euo pipefail
cmd=${1:-}
case "$cmd" in
unpack)
    tar_file=$2 dir=$3
    mkdir -p "$dir"
    if [ -f "$tar_file" ]; then
        tar -xJf "$tar_file" -C "$dir"
        n=$(find "$dir" -name '*.autotune.json' | wc -l)
        echo "QuACK cache: $tar_file unpacked into $dir ($n autotuning results)" >&2
    else
        echo "QuACK cache: no $tar_file; $dir starts with what it holds" >&2
    fi
    ;;
pack)
    dir=$2 tar_file=$(realpath -m "$3")
    max_mb=${QUACK_CACHE_MAX_MB:-4}
    if [ ! -d "$dir" ]; then
        echo "QuACK cache: no $dir, nothing to pack" >&2
        exit 0
    fi
    mkdir -p "$(dirname "$tar_file")"
    export XZ_OPT=${XZ_OPT:--6 -T0}
    pack_files() {  # pack_files FIND_ARGS...: the files of $dir that match, into $tar_file.tmp
        rm -f "$tar_file.tmp"
        (cd "$dir" && find . -type f "$@" -print0 | sort -z | tar -cJf "$tar_file.tmp" --null -T -)
    }
    # the autotuning results first: a call cut short right after still carries them
    pack_files -name '*.autotune.json'
    mv "$tar_file.tmp" "$tar_file"
    what="the autotuning results alone"
    # then everything but QuACK's lock files, kept if it stays within the bound (not tried where the files alone are
    # over 4x the bound: compiled kernels do not shrink that much)
    raw=$(find "$dir" -type f ! -name lock ! -name '*.lock' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    if [ "$raw" -le $((4 * max_mb * 1024 * 1024)) ]; then
        pack_files ! -name lock ! -name '*.lock'
        if [ "$(stat -c %s "$tar_file.tmp")" -le $((max_mb * 1024 * 1024)) ]; then
            mv "$tar_file.tmp" "$tar_file"
            what="everything"
        fi
    fi
    rm -f "$tar_file.tmp"
    [ "$what" = everything ] || what="$what (all $((raw / 1024)) KiB of it would be over QUACK_CACHE_MAX_MB=$max_mb)"
    n=$(find "$dir" -name '*.autotune.json' | wc -l)
    echo "QuACK cache: $dir packed into $tar_file ($(du -k "$tar_file" | cut -f1) KiB: $what; $n autotuning" \
         "results)" >&2
    ;;
*)
    echo "usage: $0 unpack TAR DIR | pack DIR TAR" >&2
    exit 2
    ;;
esac
