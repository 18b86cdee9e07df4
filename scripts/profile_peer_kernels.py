"""Per-kernel GPU times of megamoe, SonicMoE and the compiled torch `_grouped_mm` path side by side (torch.profiler),
on the same inputs in one process: one forward (no grad) and one forward+backward of each, rounds alternated between
them so that the machine's drift shows as spread. Each kernel of a pass is listed in launch order with its median time
over the profiled runs, the GEMMs labelled (megamoe's grouped GEMMs by launch order, SonicMoE's QuACK kernels by class:
GemmGated = up, Gemm, GemmDGated = dH; the torch path's grouped and dense GEMM kernels as "gemm"), with TFLOP/s where
the label's FLOPs are known; then each pass's sum of kernels and its CUDA-event median. At the end, a table per shape
and pass: the medians over the rounds of the event time, the kernels' sum, the GEMM kernels' sum and the rest (gathers,
activations, sorts, copies, reductions), so that a gap reads as GEMMs or glue. Each implementation's y and gradients
are checked against megamoe's before anything is timed.

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python:bench python3 scripts/profile_peer_kernels.py \
        [--shapes qwen3-30b-a3b,qwen3-235b-a22b,mixtral-8x7b,deepseek-v3] [--impls megamoe,sonicmoe,torch_compiled] \
        [--rounds 2] [--runs 5] [--out DIR]

SonicMoE needs `import sonicmoe` (scripts/gpu_bench_peers.sh installs the carried bundle); `sonicmoe` runs its QuACK
GEMMs with their default configs, `sonicmoe-tuned` (in --impls) with QuACK's autotuned ones (bench/peers.py: each
variant binds its GEMMs before each call, so both run in one process); they compile (and the tuned one autotunes, for
minutes unless QUACK_CACHE_DIR holds the shape's tuning) on first use, in the check, outside the timed runs.
A peer that is missing or fails its check is left out, saying why.
"""
import argparse
import json
import math
import pathlib
import re
import statistics

import torch

import megamoe
import workloads
from impls import Impl
from peers import SonicMoEPeer, SonicMoETunedPeer, TorchCompiledPeer
from profile_backward import kernel_times
from timing import cuda_time, rel_diff

# Labels of megamoe's grouped GEMMs in launch order per pass (keep-h), with their FLOPs in units of T topk H I.
MEGAMOE_GEMMS = {"fwd": [("up", 4.0), ("down", 2.0)],
                 "fwdbwd": [("up", 4.0), ("down", 2.0), ("dH", 2.0), ("dW2", 2.0), ("dX", 4.0), ("dW13", 4.0)]}


def label_rows(impl_name, pass_name, rows):
    """(label or None, FLOPs units or None, name, ms) for each kernel."""
    labelled, gemm_idx = [], 0
    megamoe_labels = MEGAMOE_GEMMS[pass_name]
    for name, ms in rows:
        label = units = None
        if impl_name == "megamoe" and "grouped_gemm" in name and gemm_idx < len(megamoe_labels):
            label, units = megamoe_labels[gemm_idx]
            gemm_idx += 1
        elif impl_name.startswith("sonicmoe") and "Gemm" in name:
            label = "GemmDGated" if "DGated" in name else "GemmGated" if "Gated" in name else "Gemm"
        elif impl_name == "torch_compiled" and TORCH_GEMM.search(name):
            label = "gemm"
        labelled.append((label, units, name, ms))
    return labelled


TORCH_GEMM = re.compile(r"grouped|gemm|Gemm|nvjet|sm90_xmma|cutlass")  # the torch path's GEMM kernels (cuBLAS, CUTLASS)


def summary(results):
    """Markdown table: per shape, pass and implementation, the medians over the rounds of the event time, the sum of
    kernels, the sum of the labelled GEMM kernels and the rest."""
    groups = {}
    for r in results:
        gemm = sum(k["ms"] for k in r["kernels"] if k["label"])
        total = sum(k["ms"] for k in r["kernels"])
        groups.setdefault((r["shape"], r["pass"], r["impl"]), []).append((r["event_ms"], total, gemm, total - gemm))
    lines = ["| shape | pass | implementation | event ms | kernels ms | GEMM kernels ms | other kernels ms | rounds |",
             "|---|---|---|---|---|---|---|---|"]
    for (shape, pass_name, impl), rows in groups.items():
        medians = [statistics.median(column) for column in zip(*rows)]
        lines.append(f"| {shape} | {pass_name} | {impl} | " + " | ".join(f"{v:.3f}" for v in medians)
                     + f" | {len(rows)} |")
    return "\n".join(lines)


def check(reference, candidate):
    """The largest relative error of any output against megamoe's (timing.rel_diff)."""
    return max(rel_diff(c, r) for r, c in zip(reference, candidate))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b,mixtral-8x7b,deepseek-v3")
    p.add_argument("--impls", default="megamoe,sonicmoe,torch_compiled",
                   help="megamoe and the peers to run beside it (of sonicmoe, sonicmoe-tuned, torch_compiled)")
    p.add_argument("--routing", default="balanced")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=None, help="directory for peer_kernels.json")
    args = p.parse_args()
    wanted = args.impls.split(",")
    peers = [cls() for cls in (SonicMoEPeer, SonicMoETunedPeer, TorchCompiledPeer) if cls.name in wanted]
    for peer in peers:
        print(f"{peer.name}: {peer.about or peer.missing}")
    peers = [peer for peer in peers if not peer.missing]
    results = []
    for shape in args.shapes.split(","):
        T, H, I, E, topk = workloads.SHAPES[shape]
        unit = 1.0 * T * topk * H * I
        case = workloads.make_case(shape, (T, H, I, E, topk), args.routing, "cuda")
        impls = [Impl("megamoe", megamoe.moe)] + [peer.for_case(case) for peer in peers]
        steps = {(impl.name, pass_name): impl.step(case, pass_name)
                 for impl in impls for pass_name in ("fwd", "fwdbwd")}
        reference, checked = None, []
        for impl in impls:  # compiles the peers' kernels; checks every output against megamoe's
            try:
                outputs = steps[(impl.name, "fwdbwd")]()
                with torch.no_grad():
                    y = impl(case)
            except Exception as ex:  # noqa: BLE001 - a peer that fails to run is left out, saying why
                print(f"{shape} {impl.name}: left out, it failed: {type(ex).__name__}: {str(ex)[:200]}")
                continue
            grads = [*outputs[:2], *impl.weight_grads(outputs[2], outputs[3], torch.arange(E, device="cuda"))]
            got = [y, *grads]
            if reference is None:
                reference = got
            else:
                print(f"{shape} {impl.name}: largest relative error against megamoe over y, dx, ds, dw13, dw2 = "
                      f"{check(reference, got):.2e}")
            checked.append(impl)
            del outputs, grads, got, y
        impls = checked
        del reference
        for round_idx in range(args.rounds):
            for impl in impls:
                for pass_name in ("fwd", "fwdbwd"):
                    run = steps[(impl.name, pass_name)]
                    ms = cuda_time(run, 2, args.runs, math.inf)["ms"]
                    rows = label_rows(impl.name, pass_name, kernel_times(run, args.runs))
                    print(f"\n== {shape} {impl.name} {pass_name} round {round_idx}: {ms:.3f} ms by events, "
                          f"sum of kernels {sum(r[3] for r in rows):.3f} ms")
                    for label, units, name, kms in rows:
                        rate = f"  {units * unit / kms / 1e9:.0f} TFLOP/s" if units else ""
                        print(f"  {kms:8.3f} ms  {(label or ''):10s} {name[:100]}{rate}")
                    results.append({"shape": shape, "impl": impl.name, "pass": pass_name, "round": round_idx,
                                    "event_ms": ms, "kernels": [{"label": r[0], "name": r[2], "ms": r[3]}
                                                                for r in rows]})
        for impl in impls:
            impl.close()
        del case, impls, steps
        torch.cuda.empty_cache()
    table = summary(results)
    print("\n" + table)
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(args.out) / "peer_kernels.json").write_text(json.dumps(results, indent=1))
        (pathlib.Path(args.out) / "peer_kernels.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
