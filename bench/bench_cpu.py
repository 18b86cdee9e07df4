"""The CPU path's cost per call (the C++ reference behind megamoe.moe on CPU tensors), with torch in the process and
the default environment: a tiny call, where the fixed cost of a call dominates, and larger shapes, where the
arithmetic and its spread over the cores do. Prints one line per case: the median (and min) ms per call over 5
repeats.

    python bench/bench_cpu.py                # every case
    python bench/bench_cpu.py --cases tiny   # only the tiny forward

Not a test: timings depend on the machine and on what else runs on it.
"""
import argparse
import statistics
import time

import torch

import megamoe

# name -> (T, H, I, E, topk, dtype, with the backward)
CASES = {
    "tiny": (1, 64, 32, 8, 2, torch.float32, False),
    "tiny_fwd_bwd": (1, 64, 32, 8, 2, torch.float32, True),
    "medium": (256, 512, 256, 8, 2, torch.float32, False),
    "medium_fwd_bwd": (256, 512, 256, 8, 2, torch.float32, True),
    "wide_bf16_fwd_bwd": (32, 1024, 256, 16, 4, torch.bfloat16, True),
}


def problem(T, H, I, E, topk, dtype, grad):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to(dtype).requires_grad_(grad)
    topk_ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :topk].contiguous()
    topk_weights = torch.rand(T, topk, generator=gen).requires_grad_(grad)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype).requires_grad_(grad)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype).requires_grad_(grad)
    dy = torch.randn(T, H, generator=gen).to(dtype)
    return (x, topk_ids, topk_weights, w13, w2), dy


def step_of(args, dy, grad):
    if not grad:
        def forward():
            with torch.no_grad():
                megamoe.moe(*args)
        return forward

    def forward_backward():
        megamoe.moe(*args).backward(dy)
    return forward_backward


def time_ms(step, min_seconds):
    """(median, min) ms per call over 5 repeats, each running about min_seconds / 5 (after one warm-up call); the
    min is the steadier figure on a machine shared with other work."""
    step()
    start = time.perf_counter()
    step()
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(min_seconds / 5 / once))
    repeats = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        repeats.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(repeats), min(repeats), calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--seconds", type=float, default=2.0, help="time spent per case (default 2)")
    args = parser.parse_args()
    print(f"megamoe {megamoe.__version__}, torch {torch.__version__}, torch threads {torch.get_num_threads()}")
    for name in args.cases:
        T, H, I, E, topk, dtype, grad = CASES[name]
        median, fastest, calls = time_ms(step_of(*problem(T, H, I, E, topk, dtype, grad), grad), args.seconds)
        what = "forward+backward" if grad else "forward, no grad"
        print(f"{name:18s} T={T} H={H} I={I} E={E} topk={topk} {str(dtype)[6:]:8s} {what:16s} {median:9.3f} ms/call "
              f"(min {fastest:.3f}; {calls} calls x 5)")


if __name__ == "__main__":
    main()
