"""megamoe benchmark: megamoe.moe side by side with its peers (SonicMoE with QuACK's default GEMM configs and with
its autotuned ones, the torch `_grouped_mm` path under torch.compile and eager) and a dense bf16 GEMM of the same
FLOPs, on the reference shapes of DESIGN.md §4, measured as DESIGN.md §5 says: every implementation checked against an
fp32 reference before it is timed, then each pass timed per call, back to back and as a CUDA-graph replay, with its
activation memory. On an sm_90+ GPU also FP8:
megamoe.moe(precision="fp8") with its cached weight copies (megamoe-fp8) and with the weights quantized in every call
(megamoe-fp8+wq), beside torchao's rowwise FP8 grouped GEMMs in the torch path (the peer torchao-fp8), each held to
impls.FP8_TOLERANCE against the fp32 reference.

    python bench/bench.py [--shapes qwen3-30b-a3b,...] [--routing balanced,skewed] [--passes fwd,fwdbwd]
                          [--peers sonicmoe,sonicmoe-tuned,torch_compiled,torchao-fp8 | --no-peers] [--no-fp8]
                          [--timings per_call,back_to_back,graph]
                          [--iters N] [--warmup N] [--quick] [--stop-after SECONDS] [--out DIR]

On a CUDA GPU: progress and each case's wall time on stderr, the tables (last) on stdout, and
<out>/<date>-<gpu>-<commit>.{json,md,png}, rewritten after every case. Exits non-zero if megamoe failed a correctness
check or anything but a peer errored (a failing or missing peer is reported and not timed, a failed graph capture is
recorded in its cell: neither fails the run; a failing FP8 variant of megamoe fails the case but the others are still
timed, a missing one (no compute capability 9.0 GPU, no FP8 API in this megamoe) or one raising NotImplementedError
fails nothing). Without a
GPU: a small CPU demo of the reference path; `--device cpu` runs the whole benchmark flow on the CPU instead (for
testing it: `--device cpu --shapes tiny --out /tmp/x`).
"""
import argparse
import datetime
import gc
import os
import platform
import shlex
import subprocess
import sys
import time

import torch

import impls
import peers
import report
import timing
import workloads
from reference import FWD_KEYS, FWDBWD_KEYS, compare, path_outputs, reference_outputs
from torch_moe_baseline import moe_grouped

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = ("megamoe", "megamoe_recompute")  # a failed check of these fails the case; peers only drop out
FP8 = impls.FP8  # megamoe's FP8 variants: a failed check fails the case without stopping the others' timing
PASSES = ("fwd", "fwdbwd")


def _names(p, value, known, what):
    names = [n for n in value.split(",") if n]
    for n in names:
        if n not in known:
            p.error(f"unknown {what} {n!r}; known: {', '.join(known)}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    all_shapes = {**workloads.SHAPES, **workloads.TEST_SHAPES}
    p.add_argument("--shapes", default=",".join(workloads.SHAPES),
                   help="comma-separated names of DESIGN §4 shapes (or 'tiny', for --device cpu)")
    p.add_argument("--routing", default="balanced", help="comma-separated: balanced, skewed")
    p.add_argument("--passes", default="fwd,fwdbwd", help="comma-separated: fwd, fwdbwd")
    p.add_argument("--skip-fwdbwd", action="store_true", help="forward only (same as --passes fwd)")
    p.add_argument("--peers", default=",".join(peers.DEFAULT_PEERS),
                   help="comma-separated: " + ", ".join(peers.PEERS) + " (default: all but sonicmoe-tuned, which"
                        " autotunes QuACK's GEMMs for minutes a shape)")
    p.add_argument("--no-peers", action="store_true", help="megamoe, the eager torch path and dense only")
    p.add_argument("--no-fp8", action="store_true", help="without megamoe's FP8 variants (" + ", ".join(FP8) + ")")
    p.add_argument("--timings", default=",".join(timing.TIMINGS),
                   help="comma-separated: per_call (always measured), back_to_back, graph")
    p.add_argument("--iters", type=int, default=20, help="timed runs per number (median); back-to-back window")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="stop timing a number after this many seconds (at least 3 runs)")
    p.add_argument("--check-tokens", type=int, default=1024, help="tokens in the correctness check subset")
    p.add_argument("--quick", action="store_true", help="warm-up 1, 5 runs, at most 2 s a number, 256 check tokens")
    p.add_argument("--stop-after", type=float, metavar="SECONDS",
                   help="start no case but the first after this many seconds (the rest are listed as skipped)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"), help="directory for the result files")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: the benchmark on CUDA, else the CPU demo; cpu: the benchmark flow on the CPU (testing)")
    args = p.parse_args(argv)
    args.shapes = _names(p, args.shapes, all_shapes, "shape")
    args.routing = _names(p, args.routing, workloads.ROUTINGS, "routing")
    args.passes = ["fwd"] if args.skip_fwdbwd else [x for x in PASSES if x in _names(p, args.passes, PASSES, "pass")]
    args.peers = [] if args.no_peers else _names(p, args.peers, peers.PEERS, "peer")
    args.timings = sorted({"per_call", *_names(p, args.timings, timing.TIMINGS, "timing")}, key=timing.TIMINGS.index)
    if not args.passes:
        p.error("--passes: nothing to run")
    if args.quick:
        args.warmup, args.iters, args.check_tokens = 1, 5, 256
        args.max_seconds = min(args.max_seconds, 2.0)
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


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def stage(res, name, fn, *args, errors="errors"):
    """fn(*args), or None with the error recorded in res[errors][name] (a failing stage never stops the run); logs
    its wall time. errors="peer_errors" for a peer's stages, which fail nothing."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    except Exception as ex:  # noqa: BLE001 - reported in the table and the JSON
        res.setdefault(errors, {})[name] = timing.short(ex)
        log(f"  error in {res['shape']}/{res['routing']} {name}: {timing.short(ex)}")
        return None
    finally:
        log(f"  {name}: {time.perf_counter() - t0:.1f} s")


# ---------------------------------------------------------------------------------------------------- correctness

def check_case(case, case_impls, passes, n_tokens, res):
    """Checks every implementation on the check subsets against the fp32 reference, the bf16 torch path's error
    setting the tolerance (reference.compare): megamoe into res["check"][pass] with its bitwise repeatability, the
    others into res["check"]["impls"][name][pass]. Returns {pass: names that may be timed there}: nothing if megamoe
    failed (the peers are then not checked either: their first calls compile for minutes); a peer that failed or
    raised (res["peer_errors"]) is left out of that pass. The check calls run the full case (its forward, and in
    fwd+bwd its backward): they are every implementation's first calls of the shape, so what they compile (and, for
    sonicmoe-tuned, QuACK's autotuning of each forward and backward GEMM) happens here, before anything is timed."""
    tokens, experts = workloads.check_subsets(case.ids, case.dims[3], n_tokens)
    check = res["check"] = {"tokens": int(tokens.numel()), "experts": experts, "bitwise_repeatable": {}, "impls": {}}
    ref = reference_outputs(case, tokens, experts, torch.float32, backward="fwdbwd" in passes)
    timed, ours_ok = {}, True
    for p in passes:
        want = {k: ref[k] for k in (FWDBWD_KEYS if p == "fwdbwd" else FWD_KEYS)}
        floor = path_outputs(moe_grouped, case, tokens, experts, p == "fwdbwd")
        timed[p] = {"torch"}
        for impl in case_impls:
            if p not in impl.passes or impl.name == "torch" or not (ours_ok or impl.name in OURS):
                continue
            errs = check_impl(impl, case, tokens, experts, p, want, floor, res)
            if errs is not None:
                (check if impl.name == "megamoe" else check["impls"].setdefault(impl.name, {}))[p] = errs
            bad = sorted(k for k, v in (errs or {}).items() if not v["pass"])
            allowed = "5x + 1e-3" if impl.tolerance is None else f"{impl.tolerance:g}"
            for k in bad:
                v = errs[k]
                log(f"FAIL: {impl.name} {res['shape']}/{res['routing']} {p} {k}: rel err {v[impl.name]:.3e} vs"
                    f" torch bf16 {v['torch_bf16']:.3e} (allowed: {allowed}); not timing it")
            if errs is not None and not bad:
                timed[p].add(impl.name)
            elif impl.name in OURS:
                ours_ok = False
    return timed if ours_ok else {p: set() for p in passes}


def check_impl(impl, case, tokens, experts, p, want, floor, res):
    """compare() of one implementation's outputs (against its own tolerance, if it has one); megamoe also runs twice
    for bitwise repeatability. A peer's exception is recorded (None returned), an FP8 variant's too but as an error
    (the case fails) unless it is NotImplementedError (megamoe.moe's documented FP8 limits: a peer error); those of
    OURS propagate (the case fails, nothing is timed)."""
    t0 = time.perf_counter()
    if impl.name in peers.PEERS:
        also = peers.FIRST_CALL.get(impl.name)
        log(f"  check {p}/{impl.name} (a peer's first call of a shape compiles its kernels"
            + (f", and {also}" if also else "") + ": minutes) ...")
    try:
        mine = path_outputs(impl, case, tokens, experts, p == "fwdbwd")
        if impl.name == "megamoe":
            again = path_outputs(impl, case, tokens, experts, p == "fwdbwd")
            res["check"]["bitwise_repeatable"][p] = all(torch.equal(mine[k], again[k]) for k in want)
        return compare(mine, floor, want, label=impl.name, tolerance=impl.tolerance)
    except Exception as ex:  # noqa: BLE001 - a peer's failure is its own
        if impl.name in OURS:
            raise
        tolerated = impl.name not in FP8 or isinstance(ex, NotImplementedError)  # megamoe FP8: documented limits
        res.setdefault("peer_errors" if tolerated else "errors", {})[f"check/{p}/{impl.name}"] = timing.short(ex)
        log(f"  {impl.name} {p} check raised {timing.short(ex)}; not timing it")
        return None
    finally:
        log(f"  check {p}/{impl.name}: {time.perf_counter() - t0:.1f} s")


# ---------------------------------------------------------------------------------------------------- one case

def time_impl(impl, case, pass_name, flop, ctx):
    r = timing.time_step(impl.step(case, pass_name), ctx.timer, ctx.args, ctx.args.timings)
    r["tflops"] = flop / r["ms"] / 1e9
    return r


def time_graphs(ctx, case, cells, impls):
    """Adds the CUDA-graph replay time (or the capture's error) to every timed cell: after all other timings of the
    case, megamoe's first and the peers' last, so a capture that goes wrong costs as few other numbers as can be."""
    for impl in impls:
        for p, cell in cells.items():
            if isinstance(cell.get(impl.name), dict):
                t0 = time.perf_counter()
                cell[impl.name].update(timing.time_graph(impl.step(case, p), ctx.timer, ctx.args))
                log(f"  {p}/{impl.name} graph: {time.perf_counter() - t0:.1f} s"
                    + (f" ({cell[impl.name]['graph_error']})" if "graph_error" in cell[impl.name] else ""))


def time_dense(case, flop_fwd, ctx):
    """The ceiling: a dense bf16 GEMM [T*topk, H] x [H, 3I] (the forward's FLOPs), as the baseline file does."""
    T, H, I, E, topk = case.dims
    a = torch.randn(T * topk, H, device=ctx.device, dtype=torch.bfloat16)  # [T*topk, H]
    b = torch.randn(H, 3 * I, device=ctx.device, dtype=torch.bfloat16)  # [H, 3I]
    r = timing.time_step(lambda: a @ b, ctx.timer, ctx.args, ctx.args.timings)
    r.pop("peak_extra_gib")
    if "graph" in ctx.args.timings:
        r.update(timing.time_graph(lambda: a @ b, ctx.timer, ctx.args))
    r["tflops"] = flop_fwd / r["ms"] / 1e9
    return r


def case_fp8(ctx, case):
    """The Impls of megamoe's FP8 variants that can run here, for this case."""
    return [v.for_case(case) for v in ctx.fp8 if not v.missing]


def case_peers(ctx, case, res):
    """The Impls of the run's available peers for this case (SonicMoE copies its weights here)."""
    built = []
    for peer in ctx.peers:
        if not peer.missing:
            impl = stage(res, f"build/{peer.name}", peer.for_case, case, errors="peer_errors")
            built += [impl] if impl else []
    return built


def bench_case(ctx, name, routing, res):
    """Fills res with one (shape, routing) case: check every implementation, then time dense and, per pass, each
    implementation that passed."""
    dims = workloads.SHAPES.get(name) or workloads.TEST_SHAPES[name]
    T, H, I, E, topk = dims
    flop_fwd, flop_fwdbwd = workloads.flops(T, H, I, topk)
    ws = workloads.working_set_bytes(T, H, I, E)
    res.update(T=T, H=H, I=I, E=E, topk=topk, flops_fwd=flop_fwd, flops_fwdbwd=flop_fwdbwd,
               working_set_mb=ws / 1e6, input_sets=1,
               input_note="one input set: the working set exceeds the 60 MB L2" if ws > workloads.L2_BYTES
               else "one input set although the working set fits in L2: timings are optimistic")
    case = workloads.make_case(name, dims, routing, ctx.device)
    res["grad_gib"] = sum(t.numel() * t.element_size() for t in case.leaves()) / 2**30
    peer_impls = case_peers(ctx, case, res)
    fp8_impls = case_fp8(ctx, case)
    case_impls = ctx.ours + fp8_impls + peer_impls + [ctx.torch]
    try:
        timed = stage(res, "check", check_case, case, case_impls, ctx.args.passes, ctx.args.check_tokens, res)
        if not timed or not any(timed.values()):
            return
        res["dense"] = stage(res, "dense", time_dense, case, flop_fwd, ctx)
        for p in ctx.args.passes:
            flop = flop_fwd if p == "fwd" else flop_fwdbwd
            res[p] = {}
            for impl in case_impls:
                if impl.name in timed[p] and p in impl.passes:
                    errors = "peer_errors" if impl in peer_impls else "errors"
                    res[p][impl.name] = stage(res, f"{p}/{impl.name}", time_impl, impl, case, p, flop, ctx,
                                              errors=errors)
        if "graph" in ctx.args.timings:
            time_graphs(ctx, case, {p: res[p] for p in ctx.args.passes},
                        ctx.ours + fp8_impls + [ctx.torch] + peer_impls)
    finally:
        for impl in fp8_impls + peer_impls:
            impl.close()


def case_ok(res):
    checks = [v for p in PASSES for v in res.get("check", {}).get(p, {}).values()]
    checks += [v for name in ("megamoe_recompute", *FP8)
               for per_pass in res.get("check", {}).get("impls", {}).get(name, {}).values() for v in per_pass.values()]
    return not res["errors"] and all(v["pass"] for v in checks)


def device_name(device):
    return torch.cuda.get_device_name() if device == "cuda" else f"cpu {platform.machine()}"


def run_case(ctx, name, routing):
    """One case's results, derived; its wall time logged."""
    t0 = time.perf_counter()
    res = {"shape": name, "routing": routing, "errors": {}}
    log(f"{name} / {routing} ...")
    stage(res, "run", bench_case, ctx, name, routing, res)
    gc.collect()
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    res["wall_s"] = time.perf_counter() - t0
    log(f"{name} / {routing}: {res['wall_s']:.1f} s wall")
    return report.derive(res)


def run_bench(megamoe, args, device, timer):
    """The benchmark on `device` ('cuda', or 'cpu' to exercise the flow), timed by `timer` (timing.py)."""
    commit, dirty = git_commit()
    ctx = argparse.Namespace(args=args, device=device, timer=timer, peers=peers.load_peers(args.peers),
                             ours=impls.megamoe_impls(megamoe), torch=impls.torch_eager(),
                             fp8=[] if args.no_fp8 else impls.megamoe_fp8_variants(megamoe, device))
    for peer in ctx.peers:
        log(f"peer {peer.name}: {peer.missing or peer.about}")
    for variant in ctx.fp8:
        log(f"{variant.name}: {'missing: ' + variant.missing if variant.missing else variant.about}")
    results = {
        "date": datetime.date.today().isoformat(), "gpu": device_name(device),
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "megamoe_version": getattr(megamoe, "__version__", "unknown"), "commit": commit, "git_dirty": dirty,
        "command": shlex.join(sys.orig_argv), "graphs": timer.graphs,
        "settings": {"warmup": args.warmup, "iters": args.iters, "max_seconds": args.max_seconds,
                     "check_tokens": args.check_tokens, "routing": args.routing, "passes": args.passes,
                     "skip_fwdbwd": args.passes == ["fwd"], "peers": args.peers, "timings": args.timings,
                     "stop_after": args.stop_after, "fp8": not args.no_fp8,
                     "fp8_tolerance": impls.FP8_TOLERANCE},
        "peers": peers.describe(ctx.peers), "fp8": peers.describe(ctx.fp8), "cases": []}
    os.makedirs(args.out, exist_ok=True)
    path, written, failed = report.results_path(results, args.out), [], []
    start = time.perf_counter()
    for name in args.shapes:
        for routing in args.routing:
            if results["cases"] and args.stop_after is not None and time.perf_counter() - start > args.stop_after:
                results.setdefault("skipped", []).append(f"{name}/{routing}")
                log(f"{name} / {routing}: skipped (--stop-after {args.stop_after:g} s)")
                continue
            results["cases"].append(run_case(ctx, name, routing))
            results["peers"] = peers.describe(ctx.peers)  # the compiled path's fullgraph fallback, once it happened
            written = save(results, path, failed)
    if results.get("skipped"):
        written = save(results, path, failed)
    failed += [f"{c['shape']}/{c['routing']}" for c in results["cases"] if not case_ok(c)]
    if written:
        print("wrote " + ", ".join(written))
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    if results.get("skipped"):
        print(f"skipped (--stop-after): {', '.join(results['skipped'])}")
    print(report.text_table(results))
    return 1 if failed else 0


def save(results, path, failed):
    """Writes the run so far (JSON, markdown, plot); a failure to write is noted in `failed` once."""
    try:
        return report.write(results, path)
    except Exception as ex:  # noqa: BLE001 - the table on stdout still shows the run
        note = f"writing results ({timing.short(ex)})"
        if note not in failed:
            failed.append(note)
        return []


# ---------------------------------------------------------------------------------------------------- CPU demo

def run_cpu_demo(megamoe):
    """Tiny shape through megamoe's CPU path, forward and forward+backward, against a float64 autograd reference
    of DESIGN §1 (and a bf16 torch computation of the same math as the tolerance floor), with dropped slots."""
    print("no CUDA GPU found: running a small CPU demo of the reference")
    dims = workloads.TEST_SHAPES["tiny"]
    T, H, I, E, topk = dims
    case = workloads.make_case("cpu-demo", dims, "balanced", "cpu")
    case.ids[::8, topk - 1] = -1  # dropped slots: contribute nothing
    tokens, experts = torch.arange(T), list(range(E))
    ref = reference_outputs(case, tokens, experts, torch.float64)
    floor = reference_outputs(case, tokens, experts, torch.bfloat16)
    build = "" if megamoe._lib.has_cuda() else " (a CPU-only build: no CUDA code)"
    print(f"T={T} H={H} I={I} E={E} topk={topk}, bf16 inputs, {int((case.ids < 0).sum())} dropped slots; "
          f"megamoe {getattr(megamoe, '__version__', 'unknown')}{build}, torch {torch.__version__}")
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
    if ok:
        print("\n".join(NEXT_STEPS).format(docs=megamoe.docs_path() if hasattr(megamoe, "docs_path") else "docs/"))
    return 0 if ok else 1


NEXT_STEPS = (
    "Next steps:",
    "  python bench/bench.py --device cpu --shapes tiny --out /tmp/megamoe-bench   # the benchmark's flow on the CPU",
    "  the Python API (megamoe.moe, MoEBlock, layouts, adapters): {docs}/python.md",
    "  on an NVIDIA GPU (a Hopper one for the fused kernels) with the CUDA toolkit, the same install builds the GPU",
    "  kernels and `python bench/bench.py` times megamoe against SonicMoE and torch on four model shapes",
)


def main(argv=None):
    args = parse_args(argv)
    megamoe = import_megamoe()
    if args.device == "cpu":
        return run_bench(megamoe, args, "cpu", timing.HostTimer())
    if not torch.cuda.is_available():
        if args.device == "cuda":
            sys.exit("--device cuda: no CUDA GPU found")
        return run_cpu_demo(megamoe)
    if not megamoe._lib.has_cuda():
        message = ("this megamoe was built without CUDA (no nvcc when it was built): its library runs CPU tensors "
                   "only. Install the CUDA toolkit 12.4+ (nvcc on PATH) and reinstall for the GPU benchmark")
        if args.device == "cuda":
            sys.exit(f"--device cuda: {message}")
        print(f"warning: {message}; running the CPU demo")
        return run_cpu_demo(megamoe)
    return run_bench(megamoe, args, "cuda", timing.CudaTimer())


if __name__ == "__main__":
    sys.exit(main())
