"""What each expert option costs on megamoe's path (the cost of the options on sm_90a): the same layer at
a reference shape in every weight layout (the same values stored as each layout stores them,
megamoe.arrange_weights), with gpt-oss's clamped SwiGLU and with biases, forward and forward + backward timed per
call beside the default (concatenated w13, SwiGLU, no biases), same inputs, same run. Each layout-only option's y must
equal the default's within bf16 rounding (the same function of the same values), else its row says so.

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python:bench python3 bench/bench_options.py \
        [--shape qwen3-30b-a3b] [--options concatenated,separate,...] [--iters 10] [--out DIR]

Writes <date>-<gpu>-<commit>-options.{json,md} to --out (when given) and prints the table; --device cpu with
--shape tiny smoke-tests the script.
"""
import argparse
import datetime

import torch

import megamoe
import workloads
from bench import device_name, git_commit
from report import write_side_record
from timing import CudaTimer, HostTimer, per_call, rel_diff

# name: (layout, activation, biases)
OPTIONS = {
    "concatenated": (megamoe.CONCATENATED, megamoe.SWIGLU, False),
    "separate": (megamoe.SEPARATE, megamoe.SWIGLU, False),
    "interleaved": (megamoe.INTERLEAVED, megamoe.SWIGLU, False),
    "hf_transposed": (megamoe.HF_TRANSPOSED, megamoe.SWIGLU, False),
    "gpt_oss_layout": (megamoe.GPT_OSS, megamoe.SWIGLU, False),
    "clamped_swiglu": (megamoe.CONCATENATED, megamoe.GPT_OSS_ACTIVATION, False),
    "biases": (megamoe.CONCATENATED, megamoe.SWIGLU, True),
    "gpt_oss": (megamoe.GPT_OSS, megamoe.GPT_OSS_ACTIVATION, True),
}
SAME_FUNCTION_TOLERANCE = 1e-2  # y of a layout-only option against the default's: a few bf16 roundings apart at most


def option_arguments(case, option, b13, b2):
    """(the expert parameters of `option` over the case's canonical weights, by name: the grad leaves; megamoe.moe's
    keyword arguments for them: layout, activation and the optional w3, b13, b2)."""
    layout, activation, biases = OPTIONS[option]
    stored = megamoe.arrange_weights(case.w13.detach(), case.w2.detach(), b13 if biases else None, layout)
    params = {name: t.requires_grad_() for name, t in stored.items() if t is not None}
    if biases:
        params["b2"] = b2.clone().requires_grad_()
    optional = {name: params[name] for name in ("w3", "b13", "b2") if name in params}
    return params, dict(layout=layout, activation=activation, **optional)


def run(case, params, kwargs, with_grads):
    """y, and with_grads the gradients of x, topk_weights and every expert parameter."""
    if not with_grads:
        with torch.no_grad():
            return megamoe.moe(case.x, case.ids, case.s, params["w13"], params["w2"], **kwargs), None
    y = megamoe.moe(case.x, case.ids, case.s, params["w13"], params["w2"], **kwargs)
    return y, torch.autograd.grad(y, [case.x, case.s, *params.values()], case.dy)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", help=f"one of {', '.join(workloads.SHAPES)} or tiny")
    p.add_argument("--options", default=",".join(OPTIONS), help="comma-separated; the first is the base")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script (--shape tiny)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    options = args.options.split(",")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        p.error(f"--options: unknown option {unknown[0]!r} (one of {', '.join(OPTIONS)})")
    dims = {**workloads.SHAPES, **workloads.TEST_SHAPES}[args.shape]
    case = workloads.make_case(args.shape, dims, "balanced", args.device)
    T, H, I, E, topk = dims
    gen = torch.Generator(device=args.device).manual_seed(2)
    b13 = torch.randn(E, 2 * I, generator=gen, device=args.device).mul_(0.1).bfloat16()
    b2 = torch.randn(E, H, generator=gen, device=args.device).mul_(0.1).bfloat16()
    timer = CudaTimer() if args.device == "cuda" else HostTimer()
    base_y, rows = None, {}
    for option in options:
        params, kwargs = option_arguments(case, option, b13, b2)
        fwd_path = megamoe.path_of(case.x, case.ids, case.s, params["w13"], params["w2"], **kwargs)
        bwd_path = megamoe.path_of(case.x, case.ids, case.s, params["w13"], params["w2"], backward=True, **kwargs)
        y, _ = run(case, params, kwargs, False)
        same_function = OPTIONS[option][1:] == OPTIONS[options[0]][1:]
        if base_y is None:
            base_y = y
        check = rel_diff(y, base_y) if same_function else None
        rows[option] = {
            "path": f"{fwd_path} / {bwd_path}", "reason": fwd_path.reason or bwd_path.reason,
            "y_vs_base": check, "ok": check is None or check < SAME_FUNCTION_TOLERANCE,
            "fwd_ms": per_call(lambda: run(case, params, kwargs, False), timer, 2, args.iters, 5.0)["ms"],
            "fwdbwd_ms": per_call(lambda: run(case, params, kwargs, True), timer, 2, args.iters, 5.0)["ms"]}
    commit, _ = git_commit()
    gpu = device_name(args.device)
    record = {"date": datetime.date.today().isoformat(), "gpu": gpu, "commit": commit, "args": vars(args),
              "dims": dict(zip(("T", "H", "I", "E", "topk"), dims)), "rows": rows}
    base = rows[options[0]]
    lines = [f"# megamoe's expert options: {gpu}, {record['date']}, commit `{commit}`", "",
             f"{args.shape} (T={T}, H={H}, I={I}, E={E}, topk={topk}), balanced routing, bf16, per call (CUDA events "
             f"around one call, median of {args.iters}); cost = ms / {options[0]}'s ms. y vs base: relative "
             "difference of y to the base's where the option computes the same function (layouts).", "",
             "| option | path fwd / bwd | fwd ms | fwd+bwd ms | cost fwd / fwd+bwd | y vs base |", "|---|---|---|---|---|---|"]
    for option, r in rows.items():
        check = "—" if r["y_vs_base"] is None else f"{r['y_vs_base']:.1e}" + ("" if r["ok"] else " MISMATCH")
        lines.append(f"| {option} | {r['path']}{' (' + r['reason'] + ')' if r['reason'] else ''} | {r['fwd_ms']:.3f} "
                     f"| {r['fwdbwd_ms']:.3f} | {r['fwd_ms'] / base['fwd_ms']:.3f}x / "
                     f"{r['fwdbwd_ms'] / base['fwdbwd_ms']:.3f}x | {check} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_side_record(args.out, record, "options", text)
    return record


if __name__ == "__main__":
    main()
