"""One forward + backward of megamoe at a reference shape, for Nsight Compute (one launch of each kernel after a
warm-up pass). Example, the M-grouped kernels (up, down, dH, dX) at qwen3-30b-a3b:

    ncu --clock-control none --set full -k regex:m_grouped --launch-skip 4 --launch-count 4 -o up_down \
        python3 scripts/ncu_moe.py --shape qwen3-30b-a3b

--precision fp8 runs the FP8 layer (megamoe.fp8's cached weights, quantized in the first pass, so the second pass
launches only the layer's kernels).
"""
import argparse

import torch

import megamoe
import workloads


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--routing", default="balanced")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"))
    args = p.parse_args()
    case = workloads.make_case(args.shape, workloads.SHAPES[args.shape], args.routing, "cuda")
    for _ in range(2):  # the first pass warms up; profile with --launch-skip (kernels per pass)
        y = megamoe.moe(case.x, case.ids, case.s, case.w13, case.w2, recompute=args.recompute,
                        precision=args.precision)
        y.backward(case.dy)
        case.clear_grads()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
