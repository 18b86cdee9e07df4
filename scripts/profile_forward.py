"""Per-kernel GPU times of megamoe's forward at the reference shapes (torch.profiler), on the fused sm_90a path
and on the portable one (MEGAMOE_DISABLE_SM90=1), with the forward's median time by CUDA events, its CUDA-graph
replay time (no host-side launch work), the host time of one call and the sum of its kernels' times; the combine
(gather_sum) as GB/s against a device-to-device copy measured in the same run.

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python:bench python3 scripts/profile_forward.py \
        [--shapes qwen3-30b-a3b,...] [--routing balanced] [--runs 10] [--paths sm90,portable]

A path named portable* runs with MEGAMOE_DISABLE_SM90=1, any other with 0; one extra environment setting per
path can be given as name=VAR:value.
"""
import argparse
import math
import os
import re
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe
import workloads
from timing import cuda_time


def short_name(name):
    name = name.replace("(anonymous namespace)::", "").replace("megamoe::", "")
    name = re.sub(r"^void ", "", name)
    cut = name.rfind(">(")
    name = name[:cut + 1] if cut >= 0 else name.split("(")[0]
    return name[:110]


def gemm_kind(name):
    """'up' / 'down' for the forward's grouped GEMM kernels (by their epilogue template argument), else None."""
    if "m_grouped_gemm_sm90_kernel" in name:  # epilogue policies (an enum before 2026-12-01: Epilogue)0 = SwiGLU)
        return "up" if ("Epilogue)0" in name or "::SwiGLUEpilogue" in name or "::GatedEpilogue" in name) else "down"
    if "m_grouped_gemm_kernel" in name:
        return "up" if "Epilogue)2" in name else "down"
    return None


def parse_path(spec):
    name, _, env = spec.partition("=")
    settings = {"MEGAMOE_DISABLE_SM90": "1" if name.startswith("portable") else "0"}
    if env:
        var, _, value = env.partition(":")
        settings[var] = value
    return name, settings


def host_and_graph_times(fn, runs):
    """(median host time of one call in us, not waiting for the GPU; median CUDA-graph replay time in ms): the
    forward's CUDA-event time minus the graph replay's is what the host-side launch work costs."""
    host = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        host.append(1e6 * (time.perf_counter() - start))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return statistics.median(host), cuda_time(graph.replay, 3, runs, math.inf)["ms"]


def time_forward(case, runs):
    def forward():
        return megamoe.moe_forward(case.x, case.ids, case.s, case.w13, case.w2)

    median = cuda_time(forward, 3, runs, math.inf)["ms"]
    host_us, graph_ms = host_and_graph_times(forward, runs)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            forward()
        torch.cuda.synchronize()
    kernels = []
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if total > 0 and evt.count > 0:
            kernels.append((short_name(evt.key), total / evt.count / 1000.0, evt.count))
    return median, host_us, graph_ms, sorted(kernels, key=lambda k: -k[1])


def copy_bandwidth_gbps(runs, num_bytes=2**30):
    """GB/s of a device-to-device copy of num_bytes (read + written), median of `runs`."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = cuda_time(lambda: dst.copy_(src), 3, runs, math.inf)["ms"]
    return 2.0 * num_bytes / ms / 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(workloads.SHAPES))
    p.add_argument("--routing", default="balanced")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--paths", default="sm90,portable")
    args = p.parse_args()
    paths = [parse_path(spec) for spec in args.paths.split(",")]
    copy_gbps = copy_bandwidth_gbps(args.runs)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (bytes read + written; the combine's ceiling)")
    for name in args.shapes.split(","):
        T, H, I, E, topk = workloads.SHAPES[name]
        up_flops, down_flops = 4.0 * T * topk * H * I, 2.0 * T * topk * H * I
        combine_bytes = 2.0 * (T * topk * H + T * H)  # o rows read, y written (bf16)
        case = workloads.make_case(name, (T, H, I, E, topk), args.routing, "cuda")
        with torch.no_grad():
            for path, settings in paths:
                os.environ.update(settings)
                ms, host_us, graph_ms, kernels = time_forward(case, args.runs)
                kernels_ms = sum(kms * count / args.runs for _, kms, count in kernels)
                print(f"\n{name} [{args.routing}] {path}: forward {ms:.3f} ms "
                      f"({(up_flops + down_flops) / ms / 1e9:.0f} TFLOP/s); CUDA-graph replay {graph_ms:.3f} ms; "
                      f"host {host_us:.0f} us per call; kernels' sum {kernels_ms:.3f} ms")
                for kname, kms, count in kernels:
                    kind = gemm_kind(kname)
                    flops = {"up": up_flops, "down": down_flops}.get(kind, 0.0)
                    rate = f"  {flops / kms / 1e9:.0f} TFLOP/s ({kind})" if kind else ""
                    if "gather_sum" in kname:
                        gbps = combine_bytes / kms / 1e6
                        rate = f"  {gbps:.0f} GB/s ({100 * gbps / copy_gbps:.0f}% of the copy)"
                    print(f"  {kms:8.3f} ms  x{count // args.runs:<3d} {kname}{rate}")
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
