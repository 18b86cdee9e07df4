"""megamoe benchmark: megamoe.moe side by side with the torch `_grouped_mm` path and a dense bf16 GEMM of the same
FLOPs, on the reference shapes of DESIGN.md §4, measured as DESIGN.md §5 says. Correctness is checked before timing.

    python bench/bench.py [--shapes qwen3-30b-a3b,...] [--routing balanced,skewed] [--iters N] [--warmup N]
                          [--quick] [--skip-fwdbwd] [--out DIR]

On a CUDA GPU: prints a table (last) and writes <out>/<date>-<gpu>-<commit>.{json,md,png}; exits non-zero if any
shape failed its correctness check or errored. Without a GPU: a small CPU demo of the reference path.
"""
import argparse
import datetime
import gc
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch

import report
import workloads
from reference import FWD_KEYS, FWDBWD_KEYS, compare, path_outputs, reference_outputs
from torch_moe_baseline import moe_grouped

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda"
CPU_DEMO_DIMS = (64, 128, 96, 8, 2)  # T, H, I, E, topk


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(workloads.SHAPES), help="comma-separated names of DESIGN §4 shapes")
    p.add_argument("--routing", default="balanced", help="comma-separated: balanced, skewed")
    p.add_argument("--iters", type=int, default=20, help="timed runs per number (median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="stop timing a number after this many seconds (at least 3 runs)")
    p.add_argument("--check-tokens", type=int, default=1024, help="tokens in the correctness check subset")
    p.add_argument("--quick", action="store_true", help="warm-up 1, 5 runs, 256 check tokens")
    p.add_argument("--skip-fwdbwd", action="store_true", help="forward only")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"), help="directory for the result files")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.routing = [r for r in args.routing.split(",") if r]
    for name in args.shapes:
        if name not in workloads.SHAPES:
            p.error(f"unknown shape {name!r}; known: {', '.join(workloads.SHAPES)}")
    for r in args.routing:
        if r not in workloads.ROUTINGS:
            p.error(f"unknown routing {r!r}; known: {', '.join(workloads.ROUTINGS)}")
    if args.quick:
        args.warmup, args.iters, args.check_tokens = 1, 5, 256
    return args


def import_megamoe():
    try:
        import megamoe
    except ImportError as ex:
        sys.exit(f"cannot import megamoe ({ex}): build it and put python/ on PYTHONPATH, or pip install the repo")
    return megamoe


def git_commit():
    """($MEGAMOE_COMMIT, None) when set (a copy of the tree whose .git is stale, as on a lent GPU machine); else
    (short commit, dirty?) from git; else ('unknown', None)."""
    if os.environ.get("MEGAMOE_COMMIT"):
        return os.environ["MEGAMOE_COMMIT"], None

    def git(*cmd):
        return subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode == 0:
            dirty = git("status", "--porcelain", "--untracked-files=no")
            return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown", None


def short(ex):
    return f"{type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}"[:300]


def stage(res, name, fn, *args):
    """fn(*args), or None with the error recorded in res['errors'][name] (a failing stage never stops the run)."""
    try:
        return fn(*args)
    except Exception as ex:  # noqa: BLE001 - reported in the table and the JSON
        res.setdefault("errors", {})[name] = short(ex)
        print(f"  error in {res['shape']}/{res['routing']} {name}: {short(ex)}", file=sys.stderr, flush=True)
        return None


# ---------------------------------------------------------------------------------------------------- timing

def cuda_time(fn, warmup, iters, max_seconds):
    """Median of CUDA-event timings of fn() in ms, after warm-up; stops early (>= 3 runs) past max_seconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    while len(times) < iters and (len(times) < 3 or sum(times) < 1e3 * max_seconds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": len(times)}


def peak_extra_gib(fn, case):
    """GiB that torch.cuda.max_memory_allocated rises above the allocation before one fn()."""
    case.clear_grads()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    case.clear_grads()
    return peak / 2**30


def runner(moe_fn, case, pass_name):
    """A no-argument closure running one pass: forward under no_grad, or forward+backward with fresh grads."""
    args = (case.x, case.ids, case.s, case.w13, case.w2)
    if pass_name == "fwd":
        def run():
            with torch.no_grad():
                moe_fn(*args)
    else:
        def run():
            case.clear_grads()
            moe_fn(*args).backward(case.dy)
    return run


def time_path(moe_fn, case, pass_name, flop, args):
    run = runner(moe_fn, case, pass_name)
    try:
        r = cuda_time(run, args.warmup, args.iters, args.max_seconds)
        r["tflops"] = flop / r["ms"] / 1e9
        r["peak_extra_gib"] = peak_extra_gib(run, case)
    finally:
        case.clear_grads()
    return r


def time_dense(case, flop_fwd, args):
    """The ceiling: a dense bf16 GEMM [T*topk, H] x [H, 3I] (the forward's FLOPs), as the baseline file does."""
    T, H, I, E, topk = case.dims
    a = torch.randn(T * topk, H, device=DEVICE, dtype=torch.bfloat16)  # [T*topk, H]
    b = torch.randn(H, 3 * I, device=DEVICE, dtype=torch.bfloat16)  # [H, 3I]
    r = cuda_time(lambda: a @ b, args.warmup, args.iters, args.max_seconds)
    r["tflops"] = flop_fwd / r["ms"] / 1e9
    return r


# ---------------------------------------------------------------------------------------------------- correctness

def check(moe_fn, case, passes, n_tokens, res):
    """Compares megamoe and the bf16 torch path against the fp32 reference on the check subsets (see reference.py);
    records the errors and whether megamoe is bitwise repeatable; returns True if megamoe passes everything."""
    tokens, experts = workloads.check_subsets(case.ids, case.dims[3], n_tokens)
    res["check"] = {"tokens": int(tokens.numel()), "experts": experts, "bitwise_repeatable": {}}
    ref = reference_outputs(case, tokens, experts, torch.float32, backward="fwdbwd" in passes)
    ok = True
    for p in passes:
        keys = FWDBWD_KEYS if p == "fwdbwd" else FWD_KEYS
        mine = path_outputs(moe_fn, case, tokens, experts, p == "fwdbwd")
        again = path_outputs(moe_fn, case, tokens, experts, p == "fwdbwd")
        res["check"]["bitwise_repeatable"][p] = all(torch.equal(mine[k], again[k]) for k in keys)
        del again
        theirs = path_outputs(moe_grouped, case, tokens, experts, p == "fwdbwd")
        res["check"][p] = compare(mine, theirs, {k: ref[k] for k in keys})
        for k, v in res["check"][p].items():
            if not v["pass"]:
                ok = False
                print(f"FAIL: megamoe {res['shape']}/{res['routing']} {p} {k}: rel err {v['megamoe']:.3e} vs torch "
                      f"bf16 {v['torch_bf16']:.3e} (allowed: 5x + 1e-3); not timing this case",
                      file=sys.stderr, flush=True)
    return ok


# ---------------------------------------------------------------------------------------------------- one case

def bench_case(moe_fn, name, routing, args, res):
    """Fills res with one (shape, routing) case: check, then dense, then per pass megamoe and torch."""
    dims = workloads.SHAPES[name]
    T, H, I, E, topk = dims
    flop_fwd, flop_fwdbwd = workloads.flops(T, H, I, topk)
    ws = workloads.working_set_bytes(T, H, I, E)
    res.update(T=T, H=H, I=I, E=E, topk=topk, flops_fwd=flop_fwd, flops_fwdbwd=flop_fwdbwd,
               working_set_mb=ws / 1e6, input_sets=1,
               input_note="one input set: the working set exceeds the 60 MB L2" if ws > workloads.L2_BYTES
               else "one input set although the working set fits in L2: timings are optimistic")
    case = workloads.make_case(name, dims, routing, DEVICE)
    passes = ["fwd"] if args.skip_fwdbwd else ["fwd", "fwdbwd"]
    if not stage(res, "check", check, moe_fn, case, passes, args.check_tokens, res):
        return
    res["dense"] = stage(res, "dense", time_dense, case, flop_fwd, args)
    res["grad_gib"] = sum(t.numel() * t.element_size() for t in (case.x, case.s, case.w13, case.w2)) / 2**30
    for p in passes:
        flop = flop_fwd if p == "fwd" else flop_fwdbwd
        paths = [("megamoe", moe_fn), ("torch", moe_grouped)]
        if p == "fwdbwd":  # the other memory mode: only the inputs are kept, h is recomputed in the backward
            paths.insert(1, ("megamoe_recompute", lambda *a: moe_fn(*a, recompute=True)))
        res[p] = {path: stage(res, f"{p}/{path}", time_path, fn, case, p, flop, args) for path, fn in paths}


def case_ok(res):
    checks = [v for p in ("fwd", "fwdbwd") for v in res.get("check", {}).get(p, {}).values()]
    return not res["errors"] and all(v["pass"] for v in checks)


def run_gpu(megamoe, args):
    commit, dirty = git_commit()
    results = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "megamoe_version": getattr(megamoe, "__version__", "unknown"), "commit": commit, "git_dirty": dirty,
        "command": shlex.join(sys.orig_argv),
        "settings": {"warmup": args.warmup, "iters": args.iters, "max_seconds": args.max_seconds,
                     "check_tokens": args.check_tokens, "routing": args.routing, "skip_fwdbwd": args.skip_fwdbwd},
        "cases": []}
    for name in args.shapes:
        for routing in args.routing:
            t0 = time.perf_counter()
            res = {"shape": name, "routing": routing, "errors": {}}
            print(f"{name} / {routing} ...", file=sys.stderr, flush=True)
            stage(res, "run", bench_case, megamoe.moe, name, routing, args, res)
            gc.collect()
            torch.cuda.empty_cache()
            res["wall_s"] = time.perf_counter() - t0
            results["cases"].append(report.derive(res))
    failed = [f"{c['shape']}/{c['routing']}" for c in results["cases"] if not case_ok(c)]
    try:
        print("wrote " + ", ".join(report.write(results, args.out)))
    except Exception as ex:  # noqa: BLE001 - the table below still shows the run
        failed.append(f"writing results ({short(ex)})")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    print(report.text_table(results))
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------- CPU demo

def run_cpu_demo(megamoe):
    """Tiny shape through megamoe's CPU path, forward and forward+backward, against a float64 autograd reference
    of DESIGN §1 (and a bf16 torch computation of the same math as the tolerance floor), with dropped slots."""
    print("no CUDA GPU found: running a small CPU demo of the reference")
    T, H, I, E, topk = CPU_DEMO_DIMS
    case = workloads.make_case("cpu-demo", CPU_DEMO_DIMS, "balanced", "cpu")
    case.ids[::8, topk - 1] = -1  # dropped slots: contribute nothing
    tokens, experts = torch.arange(T), list(range(E))
    ref = reference_outputs(case, tokens, experts, torch.float64)
    floor = reference_outputs(case, tokens, experts, torch.bfloat16)
    print(f"T={T} H={H} I={I} E={E} topk={topk}, bf16 inputs, {int((case.ids < 0).sum())} dropped slots; "
          f"megamoe {getattr(megamoe, '__version__', 'unknown')}, torch {torch.__version__}")
    ok = True
    for p, keys in (("fwd", FWD_KEYS), ("fwd+bwd", FWDBWD_KEYS)):
        path_outputs(megamoe.moe, case, tokens, experts, p == "fwd+bwd")  # warm-up (first call loads the library)
        t0 = time.perf_counter()
        mine = path_outputs(megamoe.moe, case, tokens, experts, p == "fwd+bwd")
        ms = 1e3 * (time.perf_counter() - t0)
        errs = compare(mine, floor, {k: ref[k] for k in keys})
        print(f"{p}: {ms:.1f} ms (megamoe CPU path, after one warm-up call)")
        for k, v in errs.items():
            ok &= v["pass"]
            print(f"  {k:14s} rel err vs float64: megamoe {v['megamoe']:.2e}, torch bf16 {v['torch_bf16']:.2e}"
                  f"  {'ok' if v['pass'] else 'FAIL'}")
    print("CPU demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def main():
    args = parse_args()
    megamoe = import_megamoe()
    if not torch.cuda.is_available():
        return run_cpu_demo(megamoe)
    return run_gpu(megamoe, args)


if __name__ == "__main__":
    sys.exit(main())
