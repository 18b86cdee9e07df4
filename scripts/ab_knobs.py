"""Variants of the sm_90a kernels (sm90/knobs.h: environment switches) side by side in one process, on the same
inputs, alternated round by round so that the machine's drift shows as spread rather than as a difference: per
variant, the fwd+bwd / forward / backward medians by CUDA events, fwd+bwd replayed from a CUDA graph and eager back
to back (where programmatic dependent launch can show), and every kernel's median time (torch.profiler) of
one forward and one backward, with the grouped GEMMs labelled and their TFLOP/s. Keep-h mode unless --modes says so.
Each variant's outputs (y, dx, d topk_weights, dw13, dw2) are compared with the first variant's: bitwise equal, or the
largest relative error of any of them (timing.rel_diff: ||got - ref|| / ||ref||).

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python:bench python3 scripts/ab_knobs.py \
        --shapes qwen3-30b-a3b,deepseek-v3 --variants "default;fast=MEGAMOE_SM90_DSWIGLU_MATH:fast" --rounds 2

A variant is NAME or NAME=VAR:VALUE,VAR:VALUE; every VAR any variant names is unset for the others.
"""
import argparse
import math
import os

import torch

import megamoe
import workloads
from profile_backward import GEMM_LABELS, RECOMPUTE_LABEL, backward_kernels, pass_times
from timing import CudaTimer, back_to_back, graph_replay, rel_diff

FORWARD_LABELS = [("up", 4.0), ("down", 2.0)]  # x T topk H I


def parse_variants(spec):
    variants = []
    for item in spec.split(";"):
        name, _, env = item.partition("=")
        settings = {}
        for pair in filter(None, env.split(",")):
            var, _, value = pair.partition(":")
            settings[var] = value
        variants.append((name, settings))
    return variants


def apply(settings, all_vars):
    for var in all_vars:
        os.environ.pop(var, None)
    os.environ.update(settings)


def outputs(inputs, dy, keep_h):
    y, h = megamoe.moe_forward(*inputs, keep_h)
    return (y, *megamoe.moe_backward(dy, *inputs, h if keep_h else None)[:4])


def compare(reference, candidate):
    """'bitwise equal', or the largest relative error of any output against the reference's (timing.rel_diff)."""
    if all(torch.equal(ref, got) for ref, got in zip(reference, candidate)):
        return "bitwise equal"
    worst = max(rel_diff(got, ref) for ref, got in zip(reference, candidate))
    return f"differs: largest relative error {worst:.2e}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b")
    p.add_argument("--routing", default="balanced")
    p.add_argument("--variants", required=True)
    p.add_argument("--modes", default="keep-h")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    variants = parse_variants(args.variants)
    all_vars = {var for _, settings in variants for var in settings}
    for shape in args.shapes.split(","):
        T, H, I, E, topk = workloads.SHAPES[shape]
        unit = 1.0 * T * topk * H * I
        case = workloads.make_case(shape, (T, H, I, E, topk), args.routing, "cuda")
        inputs = [t.detach() for t in (case.x, case.ids, case.s, case.w13, case.w2)]
        dy = case.dy.detach()
        for mode in args.modes.split(","):
            keep_h = mode == "keep-h"
            with torch.no_grad():
                apply(variants[0][1], all_vars)
                reference = outputs(inputs, dy, keep_h)
                for name, settings in variants[1:]:
                    apply(settings, all_vars)
                    print(f"{shape} {mode} {name}: {compare(reference, outputs(inputs, dy, keep_h))}")
                del reference
                for round_idx in range(args.rounds):
                    for name, settings in variants:
                        apply(settings, all_vars)
                        report(shape, mode, name, round_idx, inputs, dy, keep_h, unit, args.runs)
        del case, inputs, dy
        torch.cuda.empty_cache()


def report(shape, mode, name, round_idx, inputs, dy, keep_h, unit, runs):
    (forward, backward, _), (fwd, bwd, both) = pass_times(inputs, dy, keep_h, runs)
    print(f"\n== {shape} {mode} {name} round {round_idx}: fwd+bwd {both:.3f} ms ({18 * unit / both / 1e9:.0f} "
          f"TFLOP/s), forward {fwd:.3f}, backward {bwd:.3f}")
    step = lambda: outputs(inputs, dy, keep_h)  # noqa: E731
    timer = CudaTimer()
    graph_ms = graph_replay(step, timer, 3, 2 * runs, math.inf)["graph_ms"]
    b2b_ms = back_to_back(step, timer, 2 * runs)["b2b_ms"]
    print(f"  fwd+bwd CUDA-graph replay {graph_ms:.3f} ms, eager back to back {b2b_ms:.3f} ms")
    labels = GEMM_LABELS if keep_h else [RECOMPUTE_LABEL, *GEMM_LABELS]
    rows = backward_kernels(forward, runs, FORWARD_LABELS) + backward_kernels(backward, runs, labels)
    for label, ms, kname in rows:
        rate = f"  {label[1] * unit / ms / 1e9:.0f} TFLOP/s ({label[0]})" if label else ""
        print(f"  {ms:8.3f} ms  {kname[:90]}{rate}")
    print(f"  sum of kernels {sum(ms for _, ms, _ in rows):.3f} ms")


if __name__ == "__main__":
    main()
