"""One build of the library (MEGAMOE_LIBRARY) on fixed inputs, for comparing builds side by side: every output's digest
(bitwise comparison across builds and machines without moving tensors) and, with --rounds, the per-call, back-to-back
and CUDA-graph times with every kernel's median (torch.profiler) and the host's enqueue time of a call. Inputs are
seeded (workloads.make_case: the same bytes in every process), so two builds' digests are equal exactly when their
outputs are bitwise equal.

Digests cover y, dx, d topk_weights, dw13 and dw2 of the reference shapes (--shapes) in keep-h mode, bf16 and (on a
Hopper GPU) FP8, and of a ragged set (T = 1, topk = 1, one expert taking every slot, empty experts, dropped slots,
sizes off every tile, f16) on the default path and on the portable kernels (MEGAMOE_DISABLE_SM90=1), recompute mode
too. Each line: `digest <case> <what> <output> <sha256 prefix>`.

    MEGAMOE_LIBRARY=.carry/lib-base.so PYTHONPATH=python:bench:scripts python3 scripts/ab_libs.py --name base \\
        --shapes qwen3-30b-a3b,deepseek-v3 --rounds 1 > base.log
    python3 scripts/ab_libs.py --compare base.log main.log     # every digest equal, or the ones that differ
    python3 scripts/ab_libs.py --timings base-r*.log main-r*.log  # medians over the rounds, the first build as base
"""
import argparse
import hashlib
import math
import os
import re
import statistics
import sys
import time

import torch

DIGEST_OUTPUTS = ("y", "dx", "dtopk_weights", "dw13", "dw2")
RAGGED = [  # name, T, H, I, E, topk, routing, dtype (as tests/python/conftest.py's make_problem takes them)
    ("t1_topk1", 1, 64, 40, 4, 1, "random", torch.bfloat16),
    ("one_expert_takes_all", 300, 136, 72, 4, 1, "one_expert", torch.bfloat16),
    ("most_experts_empty", 5, 64, 40, 64, 2, "half_empty", torch.bfloat16),
    ("dropped_tails", 37, 200, 72, 5, 2, "dropped", torch.bfloat16),
    ("k_and_n_tails", 260, 520, 200, 8, 2, "random", torch.bfloat16),
    ("long_experts_odd_pairs", 600, 712, 392, 2, 2, "random", torch.bfloat16),
    ("f16_dropped", 97, 72, 48, 7, 2, "dropped", torch.float16),
    ("fp8_shaped", 300, 256, 384, 8, 2, "dropped", torch.bfloat16),
]


def digest(tensor):
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def outputs(megamoe, inputs, dy, keep_h, precision="bf16"):
    """y, dx, d topk_weights, dw13, dw2 of one forward and backward through the custom ops."""
    options = {}
    if precision == "fp8":
        options = dict(precision="fp8", fp8_experts=megamoe.fp8.quantize_experts(inputs[3], inputs[4]))
    x, ids, s, w13, w2 = inputs
    if precision == "bf16":
        y, h = megamoe.moe_forward(x, ids, s, w13, w2, keep_h)
        return (y, *megamoe.moe_backward(dy, x, ids, s, w13, w2, h if keep_h else None)[:4])
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    y = megamoe.moe(*leaves, recompute=not keep_h, **options)
    y.backward(dy)
    return (y.detach(), leaves[0].grad, leaves[2].grad, leaves[3].grad, leaves[4].grad)


def print_digests(case, what, values):
    for name, value in zip(DIGEST_OUTPUTS, values):
        print(f"digest {case} {what} {name} {digest(value)}", flush=True)


def reference_digests(megamoe, workloads, shapes, sm90):
    for shape in shapes:
        dims = workloads.SHAPES[shape]
        case = workloads.make_case(shape, dims, "balanced", "cuda")
        inputs = [t.detach() for t in (case.x, case.ids, case.s, case.w13, case.w2)]
        dy = case.dy.detach()
        with torch.no_grad():
            print_digests(shape, "bf16-keep-h", outputs(megamoe, inputs, dy, True))
        if sm90:
            print_digests(shape, "fp8-keep-h", outputs(megamoe, inputs, dy, True, "fp8"))
        del case, inputs, dy
        torch.cuda.empty_cache()


def ragged_digests(megamoe, make_problem, sm90):
    gen = torch.Generator().manual_seed(20261206)
    for name, T, H, I, E, topk, routing, dtype in RAGGED:
        problem = [t.detach().cuda() for t in make_problem(T, H, I, E, topk, routing, dtype=dtype, gen=gen)]
        inputs, dy = problem[:5], problem[5]
        for portable in (False, True):
            os.environ["MEGAMOE_DISABLE_SM90"] = "1" if portable else "0"
            path = "portable" if portable else "default"
            for keep_h in (True, False):
                with torch.no_grad():
                    values = outputs(megamoe, inputs, dy, keep_h)
                print_digests(name, f"{path}-{'keep-h' if keep_h else 'recompute'}", values)
        os.environ["MEGAMOE_DISABLE_SM90"] = "0"
        if sm90 and H % 128 == 0 and I % 128 == 0:
            print_digests(name, "fp8-keep-h", outputs(megamoe, inputs, dy, True, "fp8"))


def host_ms(fn, runs):
    """Median host time of one call of fn() with the GPU idle before it: what the library and the Python around it
    take to enqueue the work (no synchronization inside). A per-call time above the CUDA graph's is this time where the
    GPU waits for it."""
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def timings(megamoe, workloads, shapes, name, round_idx, runs):
    from profile_backward import GEMM_LABELS, backward_kernels, pass_times
    from timing import CudaTimer, back_to_back, graph_replay

    for shape in shapes:
        T, H, I, E, topk = dims = workloads.SHAPES[shape]
        unit = 1.0 * T * topk * H * I
        case = workloads.make_case(shape, dims, "balanced", "cuda")
        inputs = [t.detach() for t in (case.x, case.ids, case.s, case.w13, case.w2)]
        dy = case.dy.detach()
        with torch.no_grad():
            (forward, backward, _), (fwd, bwd, both) = pass_times(inputs, dy, True, runs)
            step = lambda: outputs(megamoe, inputs, dy, True)  # noqa: E731
            timer = CudaTimer()
            graph_ms = graph_replay(step, timer, 3, 2 * runs, math.inf)["graph_ms"]
            b2b_ms = back_to_back(step, timer, 2 * runs)["b2b_ms"]
            print(f"\n== {shape} {name} round {round_idx}: fwd+bwd {both:.3f} ms ({18 * unit / both / 1e9:.0f} "
                  f"TFLOP/s), forward {fwd:.3f}, backward {bwd:.3f}, CUDA-graph {graph_ms:.3f}, back to back "
                  f"{b2b_ms:.3f}", flush=True)
            print(f"  host {shape} {name} fwd+bwd {host_ms(step, runs):.3f} ms forward {host_ms(forward, runs):.3f} ms",
                  flush=True)
            rows = backward_kernels(forward, runs, [("up", 4.0), ("down", 2.0)])
            rows += backward_kernels(backward, runs, GEMM_LABELS)
            for label, ms, kname in rows:
                if label:
                    print(f"  kernel {shape} {name} {label[0]} {ms:.3f} ms {label[1] * unit / ms / 1e9:.0f} TFLOP/s")
        del case, inputs, dy
        torch.cuda.empty_cache()


def compare(logs, common=False):
    """Every digest of the first log against the others' (common: only the digests both logs have, the count of the
    others said); returns the process status (0: all equal)."""
    tables = []
    for log in logs:
        table = {}
        with open(log) as f:
            for line in f:
                if line.startswith("digest "):
                    _, case, what, output, value = line.split()
                    table[(case, what, output)] = value
        tables.append(table)
    status = 0
    for log, table in zip(logs[1:], tables[1:]):
        keys = sorted(set(tables[0]) & set(table) if common else set(tables[0]) | set(table))
        differ = [k for k in keys if tables[0].get(k) != table.get(k)]
        left_out = f" ({len(set(tables[0]) ^ set(table))} in one log only, not compared)" if common else ""
        print(f"{logs[0]} against {log}: {len(keys) - len(differ)} of {len(keys)} digests equal{left_out}")
        for case, what, output in differ:
            print(f"  DIFFER {case} {what} {output}: {tables[0].get((case, what, output))} against "
                  f"{table.get((case, what, output))}")
        status |= 1 if differ or not keys else 0
    return status


ROUND_LINE = re.compile(r"== (\S+) (\S+) round \d+: fwd\+bwd ([\d.]+) .*forward ([\d.]+), backward ([\d.]+), "
                        r"CUDA-graph ([\d.]+), back to back ([\d.]+)")
KERNEL_LINE = re.compile(r"\s+kernel (\S+) (\S+) (\S+) ([\d.]+) ms")
HOST_LINE = re.compile(r"\s+host (\S+) (\S+) fwd\+bwd ([\d.]+) ms forward ([\d.]+) ms")
ROUND_FIELDS = ("forward", "fwd+bwd", "CUDA graph", "back to back")


def timing_table(logs):
    """Markdown table of the median per build over the rounds in `logs` (the first build named is the base): per
    shape, forward, fwd+bwd (per call), CUDA-graph replay and back to back, the sum of the GEMM kernels' medians, then
    each GEMM kernel's median (`kernel <name>`, in the order the logs name them) and the host's enqueue time of a
    call (`host fwd+bwd`, `host forward`, where the logs have it); each build's median and base / build (above 1: the
    build is faster)."""
    rounds, kernels, hosts, builds = {}, {}, {}, []
    for log in logs:
        with open(log) as f:
            for line in f:
                if m := ROUND_LINE.match(line):
                    shape, build = m.group(1), m.group(2)
                    both, fwd, _, graph, b2b = (float(v) for v in m.groups()[2:])
                    rounds.setdefault((shape, build), []).append((fwd, both, graph, b2b))
                    builds += [build] if build not in builds else []
                elif m := KERNEL_LINE.match(line):
                    shape, build, kernel, ms = m.groups()
                    kernels.setdefault((shape, build), {}).setdefault(kernel, []).append(float(ms))
                elif m := HOST_LINE.match(line):
                    shape, build, step_ms, forward_ms = m.groups()
                    host = hosts.setdefault((shape, build), {})
                    host.setdefault("host fwd+bwd", []).append(float(step_ms))
                    host.setdefault("host forward", []).append(float(forward_ms))
    if len(builds) < 2:
        return "fewer than two builds in these logs"
    base = builds[0]
    lines = [f"| shape | what | {' | '.join(builds)} | {' | '.join(f'{base} / {b}' for b in builds[1:])} | rounds |",
             "|---|---|" + "---|" * (2 * len(builds))]
    for shape in dict.fromkeys(s for s, _ in rounds):
        if any((shape, b) not in rounds for b in builds):
            continue
        table = {b: [statistics.median(column) for column in zip(*rounds[(shape, b)])] for b in builds}
        gemm_sums = {b: sum(statistics.median(v) for v in kernels.get((shape, b), {}).values()) for b in builds}
        counts = "/".join(str(len(rounds[(shape, b)])) for b in builds)
        rows = [(what, [table[b][i] for b in builds]) for i, what in enumerate(ROUND_FIELDS)]
        rows.append(("GEMM kernels (sum of medians)", [gemm_sums[b] for b in builds]))
        for kernel in dict.fromkeys(k for b in builds for k in kernels.get((shape, b), {})):
            medians = [kernels.get((shape, b), {}).get(kernel) for b in builds]
            rows.append((f"kernel {kernel}", [statistics.median(v) if v else 0.0 for v in medians]))
        for what in dict.fromkeys(k for b in builds for k in hosts.get((shape, b), {})):
            rows.append((what, [statistics.median(hosts.get((shape, b), {}).get(what) or [0.0]) for b in builds]))
        for what, values in rows:
            ratios = " | ".join(f"{values[0] / v:.3f}" if v else "-" for v in values[1:])
            lines.append(f"| {shape} | {what} | {' | '.join(f'{v:.3f}' for v in values)} | {ratios} | {counts} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="main")
    p.add_argument("--shapes", default="qwen3-30b-a3b")
    p.add_argument("--digests", choices=["all", "shapes", "ragged", "none"], default="all")
    p.add_argument("--rounds", type=int, default=0, help="timing rounds in this process (0: digests only)")
    p.add_argument("--round-offset", type=int, default=0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--compare", nargs="+", metavar="LOG", help="compare the digests of two or more logs")
    p.add_argument("--common", action="store_true", help="with --compare: only the digests both logs have")
    p.add_argument("--timings", nargs="+", metavar="LOG", help="median table of the timing rounds in these logs")
    args = p.parse_args()
    if args.compare:
        sys.exit(compare(args.compare, args.common))
    if args.timings:
        print(timing_table(args.timings))
        return
    import megamoe
    import workloads

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
    from conftest import make_problem

    sm90 = torch.cuda.get_device_capability() == (9, 0)
    shapes = [s for s in args.shapes.split(",") if s]
    print(f"library {os.environ.get('MEGAMOE_LIBRARY', '(the package)')} on {torch.cuda.get_device_name()}")
    if args.digests in ("all", "shapes"):
        reference_digests(megamoe, workloads, shapes, sm90)
    if args.digests in ("all", "ragged"):
        ragged_digests(megamoe, make_problem, sm90)
    for round_idx in range(args.rounds):
        timings(megamoe, workloads, shapes, args.name, args.round_offset + round_idx, args.runs)


if __name__ == "__main__":
    main()
