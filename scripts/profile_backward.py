"""Per-kernel GPU times of megamoe's backward at the reference shapes (torch.profiler, launches in order), on the
sm_90a path (weight gradients on the sm_90a K-grouped kernel), on it with the portable weight-gradient kernel
(sm90-portable-wgrad: the test override TEST_PORTABLE_WEIGHT_GRADS) and on the portable path (MEGAMOE_DISABLE_SM90=1), with forward,
backward and forward+backward median times by CUDA events, in both memory modes (keep-h: the forward writes h
and the backward reads it; recompute: the backward recomputes h). Keep-h's backward consumes h (dh is written over
it), so each timed backward first restores h from a copy (a device-to-device copy, timed on its own and subtracted;
left out of the per-kernel list).

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python:bench python3 scripts/profile_backward.py \
        [--shapes qwen3-30b-a3b,...] [--routing balanced] [--runs 10] [--paths sm90,sm90-portable-wgrad,portable] \
        [--modes keep-h,recompute]

The backward's grouped GEMMs run in a fixed order: up (recompute mode only), dH (with dSwiGLU), dW2 (K-grouped),
dX (M-grouped), dW13 (K-grouped); they are labelled by that order and their TFLOP/s counted from section 1's FLOPs.
"""
import argparse
import math
import os
import statistics

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import megamoe
from megamoe import _lib
import workloads
from timing import cuda_time
from profile_forward import short_name

GEMM_LABELS = [("dH", 2.0), ("dW2", 2.0), ("dX", 4.0), ("dW13", 4.0)]  # x T topk H I
RECOMPUTE_LABEL = ("up (recompute)", 4.0)


def kernel_times(run, runs):
    """[(short name, median ms)] of the CUDA kernels of one run() call, in launch order (copies and memsets left out),
    from `runs` calls under torch.profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and "emcpy" not in e.name
                     and "emset" not in e.name), key=lambda e: e.time_range.start)
    per_run = len(events) // runs
    return [(short_name(events[pos].name),
             statistics.median(events[r * per_run + pos].time_range.elapsed_us() / 1000.0 for r in range(runs)))
            for pos in range(per_run)]


def backward_kernels(backward, runs, labels):
    """(label, median ms, name) of each kernel launch of one backward, in launch order: the grouped GEMMs take
    `labels` in turn."""
    rows, gemm_idx = [], 0
    for name, ms in kernel_times(backward, runs):
        label = None
        if "grouped_gemm" in name and gemm_idx < len(labels):
            label = labels[gemm_idx]
            gemm_idx += 1
        rows.append((label, ms, name))
    return rows


def passes(inputs, dy, keep_h):
    """(forward, backward, step, restore) closures of one case: keep-h's backward consumes h (dh is written over it),
    so `backward` first restores it from a copy (`restore`, timed on its own to be subtracted)."""
    saved = megamoe.moe_forward(*inputs, keep_h)[1] if keep_h else None
    pristine = saved.clone() if keep_h else None
    forward = lambda: megamoe.moe_forward(*inputs, keep_h)  # noqa: E731
    restore = (lambda: saved.copy_(pristine)) if keep_h else (lambda: None)  # noqa: E731

    def backward():
        restore()
        megamoe.moe_backward(dy, *inputs, saved)

    def step():
        _, h = forward()
        megamoe.moe_backward(dy, *inputs, h if keep_h else None)
    return forward, backward, step, restore


def pass_times(inputs, dy, keep_h, runs):
    """(forward, backward, step) closures and their median ms (the backward's without the restore copy)."""
    forward, backward, step, restore = passes(inputs, dy, keep_h)
    fwd, bwd, both, copy = (cuda_time(fn, 3, runs, math.inf)["ms"] for fn in (forward, backward, step, restore))
    return (forward, backward, step), (fwd, bwd - (copy if keep_h else 0.0), both)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(workloads.SHAPES))
    p.add_argument("--routing", default="balanced")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--paths", default="sm90,portable")
    p.add_argument("--modes", default="keep-h,recompute")
    args = p.parse_args()
    for name in args.shapes.split(","):
        T, H, I, E, topk = workloads.SHAPES[name]
        unit = 1.0 * T * topk * H * I
        case = workloads.make_case(name, (T, H, I, E, topk), args.routing, "cuda")
        inputs = [t.detach() for t in (case.x, case.ids, case.s, case.w13, case.w2)]
        dy = case.dy.detach()
        with torch.no_grad():
            for path, mode in [(p_, m_) for p_ in args.paths.split(",") for m_ in args.modes.split(",")]:
                os.environ["MEGAMOE_DISABLE_SM90"] = "1" if path.startswith("portable") else "0"
                _lib.set_test_overrides(_lib.TEST_PORTABLE_WEIGHT_GRADS if path == "sm90-portable-wgrad" else 0)
                keep_h = mode == "keep-h"
                (_, backward, _), (fwd, bwd, both) = pass_times(inputs, dy, keep_h, args.runs)
                print(f"\n{name} [{args.routing}] {path} {mode}: forward {fwd:.3f} ms, backward {bwd:.3f} ms "
                      f"({12 * unit / bwd / 1e9:.0f} TFLOP/s), forward+backward {both:.3f} ms "
                      f"({18 * unit / both / 1e9:.0f} TFLOP/s)")
                labels = GEMM_LABELS if keep_h else [RECOMPUTE_LABEL, *GEMM_LABELS]
                for label, ms, kname in backward_kernels(backward, args.runs, labels):
                    rate = f"  {label[1] * unit / ms / 1e9:.0f} TFLOP/s ({label[0]})" if label else ""
                    print(f"  {ms:8.3f} ms  {kname}{rate}")
                del backward
        del case, inputs, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
