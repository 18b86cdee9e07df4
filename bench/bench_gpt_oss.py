"""A gpt-oss-shaped experts layer: Hugging Face's GptOssExperts (interleaved gate / up stored
transposed, biases, clamped SwiGLU) run by megamoe (`experts_implementation="megamoe"`, the weights read in place)
and by HF's "grouped_mm", each checked in bf16 against HF's "eager" experts in fp32 on the same weights, then timed
(forward, and forward + backward of x, the routing weights and every expert parameter), same inputs, same run.

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python:bench python3 bench/bench_gpt_oss.py \
        [--tokens 8192] [--hidden 2880] [--intermediate 2880] [--experts 32] [--topk 4] [--out DIR]

Writes <date>-<gpu>-<commit>-gpt-oss.{json,md} to --out (when given) and prints the table. Needs transformers 5.x with
gpt-oss and a CUDA device.
"""
import argparse
import datetime
import json

import torch

import megamoe
import megamoe.hf  # noqa: F401  (registers experts_implementation="megamoe")
from bench import device_name, git_commit
from report import write_side_record
from timing import CudaTimer, HostTimer, per_call, rel_diff

IMPLEMENTATIONS = ("megamoe", "grouped_mm")


def experts_layer(args):
    """The experts module of a one-layer GptOss model with random weights (bf16, on the GPU), HF's init."""
    import transformers

    cfg = transformers.GptOssConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, num_local_experts=args.experts,
        num_experts_per_tok=args.topk, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, experts_implementation="eager")
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():  # weights of a trained model's size: HF's init leaves biases at 0 and the clamps unreached
        for name, p in experts.named_parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.02 if "bias" not in name else 0.5))
    return model, experts


def routing(args):
    gen = torch.Generator(device=args.device).manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, device=args.device, generator=gen).mul_(2.0).bfloat16()
    logits = torch.randn(args.tokens, args.experts, device=args.device, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), args.topk, dim=-1)  # [T, topk]
    return x, ids, weights.bfloat16()


def run(model, experts, impl, x, ids, weights, dy=None):
    """y [T, H] of the experts under `impl`; with dy, also the gradients of x, the weights and every parameter."""
    model.set_experts_implementation(impl)
    params = [p for _, p in sorted(experts.named_parameters())]
    if dy is None:
        with torch.no_grad():
            return experts(x, ids, weights), None
    xg, wg = x.detach().requires_grad_(), weights.detach().requires_grad_()
    y = experts(xg, ids, wg)
    return y, torch.autograd.grad(y, [xg, wg, *params], dy)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--intermediate", type=int, default=2880)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script (tiny sizes)")
    p.add_argument("--impls", default=",".join(IMPLEMENTATIONS), help="comma-separated, grouped_mm first wins the base")
    p.add_argument("--out")
    args = p.parse_args(argv)
    impls = args.impls.split(",")
    model, experts = experts_layer(args)
    x, ids, weights = routing(args)
    dy = torch.randn_like(x)
    path = megamoe.path_of(x, ids, weights, experts.gate_up_proj, experts.down_proj, layout=megamoe.GPT_OSS,
                           activation=megamoe.clamped_swiglu(), b13=experts.gate_up_proj_bias,
                           b2=experts.down_proj_bias)

    # correctness: each bf16 implementation against HF's eager experts in fp32 on the same weights
    ref_model, ref_experts = model, experts
    ref_experts.float()
    want, want_grads = run(ref_model, ref_experts, "eager", x.float(), ids, weights.float(), dy.float())
    ref_experts.bfloat16()
    names = ["dx", "d routing weights"] + [f"d {n}" for n, _ in sorted(experts.named_parameters())]
    errors = {}
    for impl in impls + ["eager"]:  # eager in bf16: the error a bf16 implementation is expected to have
        y, grads = run(model, experts, impl, x, ids, weights, dy)
        errors[impl] = {"y": rel_diff(y, want), **{n: rel_diff(g, w) for n, g, w in zip(names, grads, want_grads)}}
    del want, want_grads

    timer = CudaTimer() if args.device == "cuda" else HostTimer()
    times = {}
    for impl in impls:
        times[impl] = {
            "fwd_ms": per_call(lambda: run(model, experts, impl, x, ids, weights), timer, 2, args.iters, 5.0)["ms"],
            "fwdbwd_ms": per_call(lambda: run(model, experts, impl, x, ids, weights, dy), timer, 2, args.iters,
                                  5.0)["ms"]}
    commit, _ = git_commit()
    gpu = device_name(args.device)
    record = {"date": datetime.date.today().isoformat(), "gpu": gpu, "commit": commit,
              "args": vars(args), "megamoe_path": str(path), "megamoe_path_reason": getattr(path, "reason", None),
              "errors": errors, "times": times}
    base = times.get("grouped_mm", times[impls[0]])
    lines = [f"# gpt-oss experts layer: {gpu}, {record['date']}, commit `{record['commit']}`", "",
             f"T={args.tokens}, H={args.hidden}, I={args.intermediate}, E={args.experts}, topk={args.topk}; bf16; "
             f"megamoe path: {path}" + (f" ({record['megamoe_path_reason']})" if record["megamoe_path_reason"] else "")
             + "; errors are relative Frobenius errors against HF's eager experts in fp32 on the same weights (HF's"
             f" eager experts in bf16: {max(errors['eager'].values()):.1e}).", "",
             "| implementation | fwd ms | fwd+bwd ms | speed-up vs grouped_mm fwd / fwd+bwd | max rel err (y, grads) |",
             "|---|---|---|---|---|"]
    for impl in impls:
        t = times[impl]
        lines.append(f"| {impl} | {t['fwd_ms']:.3f} | {t['fwdbwd_ms']:.3f} | {base['fwd_ms'] / t['fwd_ms']:.2f}x / "
                     f"{base['fwdbwd_ms'] / t['fwdbwd_ms']:.2f}x | {max(errors[impl].values()):.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    print(json.dumps(errors, indent=1))
    if args.out:
        write_side_record(args.out, record, "gpt-oss", text)


if __name__ == "__main__":
    main()
