"""Small batches at a reference shape's experts (default qwen3-30b-a3b's H, I, E, topk at T = 1, 8, 64,
512): megamoe and the torch `_grouped_mm` path (bench/torch_moe_baseline.py), forward and forward + backward, per call
(CUDA events around one call, the GPU idle before it) and as a CUDA-graph replay, beside the weight-read floor: the
bytes the pass must move over the device-to-device copy bandwidth measured in the same run. The forward reads w13 and
w2 of each expert the batch touches once; forward + backward reads them again and writes dw13 and dw2 for every
expert (dense gradients; untouched experts' are zeros). Each implementation's y is checked against an fp32
computation of DESIGN §1 on every token before it is timed (within 3x torch bf16's error + 1e-3, as the tests allow).

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python:bench python3 bench/bench_small_batch.py [--out DIR]
        [--shape qwen3-30b-a3b] [--batches 1,8,64,512] [--iters 20]

Writes <date>-<gpu>-<commit>-small-batch.{json,md} to --out (when given) and prints the table; --device cpu with
--shape tiny runs the flow on the CPU (host timer, graphs simulated).
"""
import argparse
import datetime
from types import SimpleNamespace

import torch

import megamoe
import workloads
from bench import device_name, git_commit
from impls import Impl, torch_eager
from reference import reference_outputs
from report import write_side_record
from timing import CudaTimer, HostTimer, per_call, rel_diff, short, time_graph

COPY_BYTES = {"cuda": 2**30, "cpu": 2**26}  # the copy whose bandwidth the floor uses (read once, written once)
BF16_BOUND = 2e-2  # y's error bound where the torch path cannot run to give its own (the CPU flow)


def copy_bandwidth(timer, device, iters):
    """Bytes per ms of a device-to-device copy (read + written)."""
    src = torch.empty(COPY_BYTES[device], dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = per_call(lambda: dst.copy_(src), timer, 2, iters, 5.0)["ms"]
    return 2 * src.numel() / ms


def floor_ms(case, bytes_per_ms):
    """{"fwd": ms, "fwdbwd": ms}: the weight bytes each pass must move at the copy bandwidth."""
    T, H, I, E, topk = case.dims
    expert_bytes = 3 * I * H * case.w13.element_size()  # w13 [2I, H] + w2 [H, I]
    touched = torch.unique(case.ids[case.ids >= 0]).numel()
    return {"fwd": touched * expert_bytes / bytes_per_ms, "fwdbwd": (2 * touched + E) * expert_bytes / bytes_per_ms,
            "experts_touched": touched}


def timed(impl, case, pass_name, timer, iters):
    """{"ms": per call, "graph_ms": replay (or "graph_error": the torch path synchronizes with the host)} of one
    pass."""
    step = impl.step(case, pass_name)
    settings = SimpleNamespace(warmup=3, iters=iters, max_seconds=5.0)
    return {"ms": per_call(step, timer, settings.warmup, iters, settings.max_seconds)["ms"],
            **time_graph(step, timer, settings)}


def run_batch(shape, dims, device, timer, iters, bytes_per_ms):
    case = workloads.make_case(f"{shape}-T{dims[0]}", dims, "balanced", device)
    tokens = torch.arange(dims[0])
    want = reference_outputs(case, tokens, [], torch.float32, backward=False)["y"]
    floor = floor_ms(case, bytes_per_ms)
    row = {"T": dims[0], "floor": floor, "impls": {}}
    torch_err = None
    for impl in (torch_eager(), Impl("megamoe", megamoe.moe)):
        cell = {}
        try:
            err = rel_diff(impl.step(case, "fwd")(), want)
            if impl.name == "torch":
                torch_err = err
            cell["y_err"] = err
            cell["ok"] = err <= (BF16_BOUND if torch_err is None else 3 * torch_err + 1e-3)
            if cell["ok"]:
                cell.update({p: timed(impl, case, p, timer, iters) for p in ("fwd", "fwdbwd")})
        except Exception as ex:  # noqa: BLE001 - a path that cannot run here says why (the torch path on a CPU)
            cell["error"] = short(ex)
        row["impls"][impl.name] = cell
    return row


def _cell_text(cell, p):
    if "error" in cell:
        return cell["error"][:40]
    if not cell.get("ok"):
        return f"check failed (y err {cell['y_err']:.1e})"
    graph = f"{cell[p]['graph_ms']:.3f}" if "graph_ms" in cell[p] else "no graph"
    return f"{cell[p]['ms']:.3f} / {graph}"


def markdown(record):
    lines = [f"# Small batches: {record['gpu']}, {record['date']}, commit `{record['commit']}`", "",
             f"{record['shape']}'s experts (H={record['H']}, I={record['I']}, E={record['E']}, topk={record['topk']}), "
             f"balanced routing, bf16. ms per call / CUDA-graph replay; floor: the weight bytes at the copy bandwidth "
             f"measured in the same run ({record['copy_gbps']:.0f} GB/s).", "",
             "| T | experts touched | pass | megamoe | torch `_grouped_mm` | floor | megamoe graph / floor |",
             "|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        for p in ("fwd", "fwdbwd"):
            mine = row["impls"]["megamoe"]
            ratio = (f"{mine[p]['graph_ms'] / row['floor'][p]:.1f}x" if p in mine and "graph_ms" in mine[p]
                     else "-")
            lines.append(f"| {row['T']} | {row['floor']['experts_touched']} | {p} | {_cell_text(mine, p)} | "
                         f"{_cell_text(row['impls']['torch'], p)} | {row['floor'][p]:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", help=f"one of {', '.join(workloads.SHAPES)} or tiny")
    p.add_argument("--batches", default="1,8,64,512")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to run the flow (--shape tiny)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    _, H, I, E, topk = {**workloads.SHAPES, **workloads.TEST_SHAPES}[args.shape]
    timer = CudaTimer() if args.device == "cuda" else HostTimer()
    bytes_per_ms = copy_bandwidth(timer, args.device, args.iters)
    rows = [run_batch(args.shape, (int(T), H, I, E, topk), args.device, timer, args.iters, bytes_per_ms)
            for T in args.batches.split(",")]
    commit, _ = git_commit()
    record = {"date": datetime.date.today().isoformat(), "gpu": device_name(args.device), "commit": commit,
              "shape": args.shape, "H": H, "I": I, "E": E, "topk": topk, "copy_gbps": bytes_per_ms / 1e6,
              "args": vars(args), "rows": rows}
    text = markdown(record)
    print(text)
    if args.out:
        write_side_record(args.out, record, "small-batch", text)
    return 0 if all(cell.get("ok") for row in rows for name, cell in row["impls"].items()
                    if name == "megamoe") else 1


if __name__ == "__main__":
    raise SystemExit(main())
