#!/usr/bin/env bash
# The pytest files a GPU run takes (scripts/gpu_validate.sh, scripts/gpu_wheel_check.sh): those under tests/python that
# touch CUDA; the rest are CPU tests, which CI runs (the whole suite is too long for one device call).
# test_bench.py only mentions cuda to skip its CPU demo where a GPU is present (its tests are CI's).
cd "$(dirname "$0")/../tests/python" && grep -l "cuda" test_*.py | grep -v "^test_bench.py$" | tr '\n' ' '
