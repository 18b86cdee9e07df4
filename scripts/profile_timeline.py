"""Where a megamoe forward+backward's CUDA-event time goes beyond its kernels: one pass as the bench times it (events
around `moe(...).backward(dy)`, the GPU idle before it), traced by torch.profiler with host and device activities.
Prints the GPU timeline of the median pass: each kernel / memset / copy with its start after the pass's first host
op, its duration and the idle gap before it, and the host op that launched it; then the totals: event time, the
kernels' sum, idle time before the first kernel (host prologue), idle time between kernels (launch gaps), and the
same pass's times back to back (N passes between two events) and as a CUDA-graph replay.

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python:bench python3 scripts/profile_timeline.py \
        [--shapes qwen3-30b-a3b] [--modes keep-h,recompute] [--runs 10] [--precision fp8] [--trace-dir DIR]
"""
import argparse
import math
import os
import statistics

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import megamoe
import workloads
from timing import CudaTimer, back_to_back, cuda_time, graph_replay
from profile_forward import short_name


def make_pass(case, recompute, precision):
    """One forward+backward as the bench runs it (fresh gradients each time)."""

    def run():
        case.clear_grads()
        megamoe.moe(case.x, case.ids, case.s, case.w13, case.w2, recompute=recompute,
                    precision=precision).backward(case.dy)

    return run


def graph_step(case, recompute, precision):
    """forward+backward with torch.autograd.grad (no .grad accumulation, so a captured step replays as it is)."""
    leaves = list(case.leaves())

    def step():
        y = megamoe.moe(case.x, case.ids, case.s, case.w13, case.w2, recompute=recompute, precision=precision)
        return torch.autograd.grad(y, leaves, case.dy)

    return step


def traced_passes(run, runs, trace_path):
    """Per pass: (host start us, device events [(start us, dur us, name, launcher)])."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            torch.cuda.synchronize()
            with torch.profiler.record_function("megamoe_pass"):
                run()
            torch.cuda.synchronize()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    events = prof.events()
    passes = sorted((e for e in events if e.name == "megamoe_pass" and e.device_type == DeviceType.CPU),
                    key=lambda e: e.time_range.start)
    host_ops = {e.id: e.name for e in events if e.device_type == DeviceType.CPU}  # by correlation id

    def launcher(e):  # the PyTorch op that a device event was launched under
        return host_ops.get(getattr(e, "linked_correlation_id", 0), "")
    device = sorted((e for e in events if e.device_type == DeviceType.CUDA and e.name != "megamoe_pass"),
                    key=lambda e: e.time_range.start)
    out = []
    for idx, p in enumerate(passes):
        end = passes[idx + 1].time_range.start if idx + 1 < len(passes) else math.inf
        mine = [e for e in device if p.time_range.start <= e.time_range.start < end]
        out.append((p.time_range.start, [(e.time_range.start, e.time_range.elapsed_us(), short_name(e.name),
                                          launcher(e)) for e in mine]))
    return out


def summarize(host_start, kernels):
    busy, idle_first, idle_between, last_end = 0.0, 0.0, 0.0, None
    rows = []
    for start, dur, name, launcher in kernels:
        gap = start - (last_end if last_end is not None else host_start)
        if last_end is None:
            idle_first = gap
        else:
            idle_between += max(gap, 0.0)
        rows.append((start - host_start, dur, max(gap, 0.0), name, launcher))
        busy += dur
        last_end = max(last_end or 0.0, start + dur)
    span = (last_end - host_start) if last_end is not None else 0.0
    return rows, {"span_us": span, "busy_us": busy, "idle_first_us": idle_first, "idle_between_us": idle_between}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b")
    p.add_argument("--routing", default="balanced")
    p.add_argument("--modes", default="keep-h,recompute")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--precision", default="bf16", help="bf16 or fp8 (the FP8 weights cached by the first pass)")
    p.add_argument("--trace-dir", default="")
    args = p.parse_args()
    for name in args.shapes.split(","):
        case = workloads.make_case(name, workloads.SHAPES[name], args.routing, "cuda")
        for mode in args.modes.split(","):
            run = make_pass(case, mode == "recompute", args.precision)
            event_ms = cuda_time(run, 3, args.runs, math.inf)["ms"]
            b2b = back_to_back(run, CudaTimer(), args.runs)["b2b_ms"]
            try:
                replay = graph_replay(graph_step(case, mode == "recompute", args.precision), CudaTimer(), 3, args.runs,
                                      math.inf)["graph_ms"]
            except RuntimeError as err:  # reported, not fatal: the timeline below is the point
                print(f"graph replay failed: {err}")
                replay = math.nan
            trace = os.path.join(args.trace_dir, f"timeline-{name}-{mode}.json") if args.trace_dir else ""
            passes = traced_passes(run, args.runs, trace)
            summaries = [summarize(*pass_) for pass_ in passes]
            median_idx = sorted(range(len(summaries)), key=lambda i: summaries[i][1]["span_us"])[len(summaries) // 2]
            rows, totals = summaries[median_idx]
            print(f"\n{name} [{args.routing}] {args.precision} {mode}: event {event_ms:.3f} ms per call, back-to-back {b2b:.3f} ms, "
                  f"graph replay {replay:.3f} ms; traced pass {totals['span_us'] / 1e3:.3f} ms = kernels "
                  f"{totals['busy_us'] / 1e3:.3f} + idle before the first {totals['idle_first_us'] / 1e3:.3f} + "
                  f"idle between {totals['idle_between_us'] / 1e3:.3f} (median of {len(summaries)} traced passes: "
                  f"kernels {statistics.median(s[1]['busy_us'] for s in summaries) / 1e3:.3f} ms)")
            print(f"  {'start us':>9} {'dur us':>8} {'gap us':>7}  kernel  [launched by]")
            for start, dur, gap, kname, launcher in rows:
                print(f"  {start:9.1f} {dur:8.1f} {gap:7.1f}  {kname[:80]}  [{launcher}]")
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
