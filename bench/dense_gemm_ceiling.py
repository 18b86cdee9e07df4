"""The dense ceiling of the grouped GEMMs: torch's bf16 matmul and FP8 torch._scaled_mm (per-tensor and rowwise scales)
on one [rows, K] x [K, N] GEMM of the same FLOPs as each reference shape's up and down projections (rows = T * topk),
CUDA events, median of 10 after 3 warm-ups. Prints one line per GEMM: ms and TFLOP/s.

    python3 bench/dense_gemm_ceiling.py [--tokens 8192]
"""
import argparse

import torch

SHAPES = {  # name: (hidden, intermediate, topk)
    "qwen3-30b-a3b": (2048, 768, 8),
    "qwen3-235b-a22b": (4096, 1536, 8),
    "deepseek-v3": (7168, 2048, 8),
}


def median_ms(fn, warmup=3, runs=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, (hidden, inter, topk) in SHAPES.items():
        rows = args.tokens * topk
        for gemm, n, k in (("up", 2 * inter, hidden), ("down", hidden, inter)):
            flops = 2 * rows * n * k
            a16 = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            b16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            a8, b8 = a16.to(torch.float8_e4m3fn), b16.to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            row_scales, col_scales = torch.ones(rows, 1, device="cuda"), torch.ones(1, n, device="cuda")
            runs = {
                "bf16": lambda: a16 @ b16.t(),
                "fp8-tensor": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                "fp8-rowwise": lambda: torch._scaled_mm(a8, b8.t(), scale_a=row_scales, scale_b=col_scales,
                                                        out_dtype=torch.bfloat16),
            }
            for kind, fn in runs.items():
                try:
                    ms = median_ms(fn)
                    print(f"{name:16s} {gemm:4s} {kind:12s} {ms:8.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s")
                except RuntimeError as error:  # a scaling mode this torch does not take
                    print(f"{name:16s} {gemm:4s} {kind:12s} not run: {str(error).splitlines()[0]}")
            del a16, b16, a8, b8


if __name__ == "__main__":
    main()
