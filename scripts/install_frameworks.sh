#!/usr/bin/env bash
# Installs the training frameworks whose own modules the adapter tests compare megamoe against
# (tests/python/test_frameworks_*.py), each release into its own folder .frameworks/<package>-<version> with
# `pip install --no-deps --target`: the torch that scripts/test.sh installed (and everything else already there) is
# never replaced, and only the few pure-Python packages their MoE modules import come along. .frameworks/manifest.tsv
# lists per package the releases tested (pinned, previous, and the newest on PyPI, resolved now), each with "ok" or
# why it could not install; tests of a release that could not install skip, showing that reason.
# Usage: bash scripts/install_frameworks.sh [python]   (default: $PYTHON, else python3)
set -uo pipefail  # not -e: a release that cannot install is recorded in the manifest, the others still install
cd "$(dirname "$0")/.."
PYTHON=${1:-${PYTHON:-python3}}
DEST=.frameworks

# torchtitan 0.3.0: torchtitan/models/common/moe.py (MoE.routed_experts called with [B, L, .]); 0.2.2:
# torchtitan/models/moe/moe.py (MoE.experts a GroupedExperts of w1 / w2 / w3). Their MoE modules import these:
TORCHTITAN_PINNED=0.3.0
TORCHTITAN_PREVIOUS=0.2.2
# (tokenizers: torchtitan's package itself imports it; transformers brings it where installed, a bare venv has none)
TORCHTITAN_DEPS=(spmd_types==0.2.3 tyro docstring-parser typeguard tokenizers==0.23.3)
# and torchtitan's trainer module (tests/python/test_torchtitan_trainer.py, test_torchtitan_parallel.py; its
# `datasets` import gets bench/titan_data.py's stand-in where that package is absent):
TORCHTITAN_TRAINER_DEPS=(torchdata==0.11.0 tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1)
# megatron-core 0.16.1: the newest pip installs on Python 3.11 (0.17 and later declare Requires-Python >= 3.12; their
# MoE code is pure Python, so the newest is unpacked from its wheel where this Python is older than it declares).
MEGATRON_PINNED=0.16.1
NEWEST_PYTHON=3.13  # the Python whose wheels say which megatron-core release is the newest

quiet_pip() { "$PYTHON" -m pip --disable-pip-version-check -q "$@"; }
record() { printf '%s\t%s\t%s\t%s\n' "$@" >>"$DEST/manifest.tsv"; }  # package role version status

# into FOLDER SPEC...: pip install --no-deps --target FOLDER (kept when complete); on failure pip's error in $why.
into() {
    local folder=$1 log
    shift
    [ -f "$folder/.complete" ] && [ "$(cat "$folder/.complete")" = "$*" ] && return 0  # complete, same specs
    rm -rf "$folder"
    if ! log=$(quiet_pip install --no-deps --target "$folder" "$@" 2>&1); then
        why="pip could not install it: $(grep -m1 ERROR <<<"$log" || tail -1 <<<"$log")"
        return 1
    fi
    echo "$*" >"$folder/.complete"
}

# install ROLE PACKAGE VERSION [DEPS...]: the release and DEPS into $DEST/PACKAGE-VERSION, recorded.
install() {
    local role=$1 package=$2 version=$3
    shift 3
    if into "$DEST/$package-$version" "$package==$version" "$@"; then
        record "$package" "$role" "$version" ok
    else
        record "$package" "$role" "$version" "$why"
    fi
}

# newest PACKAGE [PIP DOWNLOAD OPTIONS...]: the path of the newest release's wheel, downloaded (empty: none).
newest() {
    local package=$1 tmp
    shift
    tmp=$(mktemp -d)
    quiet_pip download --no-deps --only-binary=:all: -d "$tmp" "$@" "$package" >/dev/null 2>&1
    ls "$tmp"/*.whl 2>/dev/null | head -1
}

version_of() { basename "$1" | cut -d- -f2; }

rm -rf "$DEST/manifest.tsv"
mkdir -p "$DEST"
printf 'package\trole\tversion\tstatus\n' >"$DEST/manifest.tsv"

install pinned torchtitan "$TORCHTITAN_PINNED" "${TORCHTITAN_DEPS[@]}" "${TORCHTITAN_TRAINER_DEPS[@]}"
install previous torchtitan "$TORCHTITAN_PREVIOUS" "${TORCHTITAN_DEPS[@]}" "${TORCHTITAN_TRAINER_DEPS[@]}"
wheel=$(newest torchtitan)
if [ -z "$wheel" ]; then
    record torchtitan newest - "pip could not download the newest torchtitan"
elif [ "$(version_of "$wheel")" = "$TORCHTITAN_PINNED" ]; then
    record torchtitan newest "$TORCHTITAN_PINNED" "the newest release on PyPI is the pinned one"
else
    install newest torchtitan "$(version_of "$wheel")" "${TORCHTITAN_DEPS[@]/#spmd_types==*/spmd_types}"  # unpinned
fi

install pinned megatron-core "$MEGATRON_PINNED"
wheel=$(newest megatron-core --python-version "$NEWEST_PYTHON")
version=$([ -n "$wheel" ] && version_of "$wheel")
if [ -z "$wheel" ]; then
    record megatron-core newest - "pip could not download the newest megatron-core"
elif [ "$version" = "$MEGATRON_PINNED" ]; then
    record megatron-core newest "$version" "the newest release on PyPI is the pinned one"
elif into "$DEST/megatron-core-$version" "megatron-core==$version"; then
    record megatron-core newest "$version" ok
else
    # This Python is older than the release declares: its MoE code is pure Python, so unpack the wheel (its one
    # compiled module, megatron/core/datasets/helpers_cpp, is for the datasets and is not imported by the tests).
    folder="$DEST/megatron-core-$version"
    rm -rf "$folder"
    if "$PYTHON" -m zipfile -e "$wheel" "$folder" && echo "megatron-core==$version" >"$folder/.complete"; then
        record megatron-core newest "$version" "ok"
    else
        record megatron-core newest "$version" "$why; could not unpack $(basename "$wheel") either"
    fi
fi
column -t -s $'\t' "$DEST/manifest.tsv" 2>/dev/null || cat "$DEST/manifest.tsv"
