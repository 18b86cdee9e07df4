"""Expert-parallel benchmark: tokens/s per GPU and the communication share of megamoe.ep.moe (for each num_chunks)
against a torchtitan-style baseline (all-to-all + torch `_grouped_mm`, bench/ep_baseline.py) in the same run, at
EP = 2, 4, 8 on the reference shapes (bench/workloads.py). Every GPU holds T tokens of the shape (its own batch) and
E / EP experts; with more GPUs than EP, world / EP groups run side by side. Before timing, each EP group's outputs
are checked against EP = 1 (megamoe.moe with the full weights, gathered from the shards, on the rank's tokens).

    torchrun --nproc-per-node 8 bench/bench_ep.py --out bench/results
    torchrun --nproc-per-node 2 bench/bench_ep.py --ep 2 --shapes qwen3-30b-a3b --out bench/results
    python3 -m torch.distributed.run --nproc-per-node 2 bench/bench_ep.py --device cpu --shapes tiny --ep 2 --iters 2

Times: per step, the ranks synchronised before it (barrier), the slowest rank's time, median over --iters. The
communication share is the time the step's row exchanges take alone (the same all_to_all_single sizes, forward: 2,
forward+backward: 4, one chunk) over the step's time: what the exchanges would cost unhidden, not the exposed part.
Rank 0 prints the table and writes <out>/<date>-<gpu>-<commit>-ep.{json,md}. Exits 1 if a check failed.
"""
import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ep_baseline
import workloads
from bench import device_name, git_commit, import_megamoe

CHECK_BOUND = 2e-2  # bf16 relative error against EP = 1 (a wrong row, expert or weight gives order 1)
PASSES = ("fwd", "fwdbwd")
_groups = {}  # EP size -> this rank's group of that size


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(workloads.SHAPES), help="comma-separated shape names, or 'tiny'")
    p.add_argument("--ep", default="2,4,8", help="comma-separated EP sizes (those that divide the world are run)")
    p.add_argument("--chunks", default="1,2,4", help="comma-separated num_chunks values for megamoe.ep.moe")
    p.add_argument("--routing", default="balanced", choices=workloads.ROUTINGS)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-check", action="store_true", help="skip the EP = 1 check (it holds the full weights)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--out", default=None, help="directory for the JSON / markdown results (rank 0)")
    args = p.parse_args(argv)
    shapes = {**workloads.SHAPES, **workloads.TEST_SHAPES}
    args.shapes = [s for s in args.shapes.split(",") if s]
    for s in args.shapes:
        if s not in shapes:
            p.error(f"unknown shape {s!r}; known: {', '.join(shapes)}")
    args.ep = [int(v) for v in args.ep.split(",") if v]
    args.chunks = [int(v) for v in args.chunks.split(",") if v]
    return args


def log(msg):
    if dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def slowest(value, device):
    """The maximum of a float over every rank of the world."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_step(fn, args, device):
    """Median over iters of the slowest rank's seconds for fn(), every rank starting together."""
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.iters):
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(slowest(time.perf_counter() - start, device))
    return statistics.median(times)


def make_rank_case(dims, ep, group, args, device):
    """This rank's tokens (its own seed) and its group's expert shard (seeded by the shard)."""
    T, H, I, E, topk = dims
    E_l = E // ep
    shard = workloads.make_case("shard", (1, H, I, E_l, 1), "balanced", device, seed=1000 + dist.get_rank(group))
    tokens = workloads.make_case("tokens", (T, H, 1, E, topk), args.routing, device, seed=dist.get_rank())  # I=1:
    # its weights go unused
    w13 = shard.w13.detach().requires_grad_()  # [E_l, 2I, H]
    w2 = shard.w2.detach().requires_grad_()  # [E_l, H, I]
    return tokens.x, tokens.ids, tokens.s, w13, w2, tokens.dy


def fwdbwd(fn, x, ids, s, w13, w2, dy):
    leaves = (x, s, w13, w2)
    y = fn(x, ids, s, w13, w2)
    return [y.detach()] + list(torch.autograd.grad(y, leaves, dy))


def gathered(shard, group):
    """The full [E, ...] weight from every rank's [E_l, ...] shard."""
    full = shard.new_empty((dist.get_world_size(group) * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_into_tensor(full, shard.detach().contiguous(), group=group)
    return full


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(megamoe, impls, case, group, device):
    """{impl: max over ranks of the worst relative error of y, dx, d topk_weights} against EP = 1."""
    x, ids, s, w13, w2, dy = case
    full13, full2 = gathered(w13, group), gathered(w2, group)
    want = fwdbwd(megamoe.moe, x, ids, s, full13.requires_grad_(), full2.requires_grad_(), dy)[:3]
    del full13, full2
    errors = {}
    for name, fn in impls.items():
        got = fwdbwd(fn, *case)[:3]
        errors[name] = slowest(max(rel_err(a, b) for a, b in zip(got, want)), device)
    return errors


def comm_alone(case, group, device, args):
    """(fwd, fwdbwd) seconds of the step's row exchanges alone: dispatch + combine, twice for fwd+bwd."""
    x, ids, _, w13, _, _ = case
    _, send_sizes, recv_sizes, _ = ep_baseline.route(ids, w13.shape[0], group)
    sent = x.new_empty(sum(send_sizes), x.shape[1])
    received = x.new_empty(sum(recv_sizes), x.shape[1])

    def exchanges(n):
        for _ in range(n):
            dist.all_to_all_single(received, sent, recv_sizes, send_sizes, group=group)
            dist.all_to_all_single(sent, received, send_sizes, recv_sizes, group=group)

    return time_step(lambda: exchanges(1), args, device), time_step(lambda: exchanges(2), args, device)


def bench_ep(megamoe, name, dims, ep, args, device):
    """The rows of one (shape, EP): one per implementation."""
    T, H, I, E, topk = dims
    if ep not in _groups:  # every rank takes part in making every subgroup, once per EP size
        _groups[ep] = dist.new_subgroups(group_size=ep)[0]
    group = _groups[ep]
    case = make_rank_case(dims, ep, group, args, device)
    impls = {f"megamoe C={c}": (lambda c: lambda *a: megamoe.ep.moe(*a, group=group, num_chunks=c))(c)
             for c in args.chunks}
    impls["torchtitan-style"] = lambda *a: ep_baseline.moe(*a, group=group)
    errors = {} if args.no_check else check(megamoe, impls, case, group, device)
    comm = dict(zip(PASSES, comm_alone(case, group, device, args)))
    rows = []
    for impl, fn in impls.items():
        row = {"shape": name, "ep": ep, "groups": dist.get_world_size() // ep, "tokens_per_gpu": T, "impl": impl,
               "check_rel_err": errors.get(impl)}
        with torch.no_grad():
            row["fwd_ms"] = 1e3 * time_step(lambda: fn(*case[:5]), args, device)
        row["fwdbwd_ms"] = 1e3 * time_step(lambda: fwdbwd(fn, *case), args, device)
        for p in PASSES:
            row[f"{p}_tokens_per_s_per_gpu"] = T / (row[f"{p}_ms"] / 1e3)
            row[f"{p}_comm_share"] = 1e3 * comm[p] / row[f"{p}_ms"]
        rows.append(row)
        log(f"{name} EP={ep} {impl}: fwd {row['fwd_ms']:.2f} ms, fwd+bwd {row['fwdbwd_ms']:.2f} ms")
    base = rows[-1]["fwdbwd_ms"]
    for row in rows:
        row["fwdbwd_speedup_vs_baseline"] = base / row["fwdbwd_ms"]
    return rows


def table(rows):
    head = ("| shape | EP | impl | fwd ms | fwd+bwd ms | fwd+bwd tokens/s/GPU | comm share fwd / fwd+bwd | "
            "fwd+bwd vs baseline | check vs EP=1 |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        err = r["check_rel_err"]
        check_cell = "—" if err is None else f"{err:.1e}" + ("" if err < CHECK_BOUND else " FAIL")
        lines.append(f"| {r['shape']} | {r['ep']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | "
                     f"{r['fwdbwd_tokens_per_s_per_gpu'] / 1e3:.1f}k | {100 * r['fwd_comm_share']:.0f}% / "
                     f"{100 * r['fwdbwd_comm_share']:.0f}% | {r['fwdbwd_speedup_vs_baseline']:.2f}x | {check_cell} |")
    return head + "\n".join(lines)


def write(results, out):
    os.makedirs(out, exist_ok=True)
    gpu = results["gpu"].lower().replace(" ", "-")
    stem = os.path.join(out, f"{results['date']}-{gpu}-x{results['world']}-{results['commit']}-ep")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"{results['world']} x {results['gpu']}, commit `{results['commit']}`, {results['date']}, command "
                f"`{results['command']}`\n\n{table(results['rows'])}\n")
    return stem


def main(argv=None):
    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(backend)
    megamoe = import_megamoe()
    world = dist.get_world_size()
    shapes = {**workloads.SHAPES, **workloads.TEST_SHAPES}
    rows, skipped = [], []
    for name in args.shapes:
        for ep in args.ep:
            if world % ep or shapes[name][3] % ep:
                skipped.append(f"{name} EP={ep} (world {world}, E {shapes[name][3]})")
                continue
            rows += bench_ep(megamoe, name, shapes[name], ep, args, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    commit, dirty = git_commit()
    results = {"date": datetime.date.today().isoformat(), "gpu": device_name(device.type), "world": world,
               "backend": backend, "torch_version": torch.__version__, "commit": commit, "git_dirty": dirty,
               "command": shlex.join(sys.orig_argv), "settings": vars(args), "skipped": skipped, "rows": rows}
    failed = [f"{r['shape']} EP={r['ep']} {r['impl']}" for r in rows
              if r["check_rel_err"] is not None and not r["check_rel_err"] < CHECK_BOUND]
    if dist.get_rank() == 0:
        print(table(rows))
        if skipped:
            print("skipped: " + "; ".join(skipped))
        if args.out:
            print(f"wrote {write(results, args.out)}.{{json,md}}")
        if failed:
            print("FAILED checks: " + "; ".join(failed))
    dist.barrier()  # every rank done with its collectives before the groups are torn down
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
