"""Where a training step of examples/train_qwen3_moe.py spends its GPU time, per experts implementation: GPU kernel
time per step grouped by category (experts, router, attention, dense GEMMs, loss, optimizer, ...), the top kernels,
and the step's wall time against the kernels' sum (the rest is the GPU waiting on the host). --attribute also
profiles one step with the host side and charges each kernel to the op that launched it and the Python line (or
autograd node) behind it, to tell which code a copy or an elementwise kernel belongs to.

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python python3 scripts/profile_train.py \
        [--impls megamoe,grouped_mm] [--layers 8] [--warmup 3] [--steps 2] [--top 25] [--attribute] [--routing-stats] \
        [--example-args '--loss compiled --compile-layers']
"""
import argparse
import collections
import os
import re
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_qwen3_moe as example  # noqa: E402

CATEGORIES = (  # (category, regex on the kernel name), first match wins
    ("megamoe", r"megamoe|m_grouped|k_grouped|gather_sum|combine|routing|count_kernel|scatter_kernel"),
    ("optimizer", r"multi_tensor|fused_adam|FusedAdam|_fused_adamw|adam"),
    ("attention", r"flash|fmha|attention|sdpa|cutlass::.*Fmha|pytorch_flash"),
    ("grouped_mm", r"grouped|GroupedGemm|group_mm|GroupProblemShape"),
    ("triton", r"^triton_"),
    ("loss", r"log_softmax|softmax_warp|nll_loss|cross_entropy|cunn_SoftMax|SoftMaxForward|SoftMaxBackward"),
    ("gemm", r"gemm|nvjet|sm90_xmma|cutlass|cublas|xmma"),
    ("sort/topk", r"sort|topk|radix|Sort|scan|histogram|index_put|bincount"),
    ("reduce", r"reduce|norm|Reduce"),
    ("copy/cast", r"copy|cast|fill|Memset|Memcpy|memset|memcpy"),
    ("elementwise", r"elementwise|vectorized|unrolled|index|gather|scatter"),
)


def category(name):
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name):
            return cat
    return "other"


def short_name(name):
    name = re.sub(r"^void ", "", name.replace("(anonymous namespace)::", ""))
    cut = name.find("<")
    return (name[:cut] if cut > 0 else name.split("(")[0])[:90]


def launch_site(evt):
    """The autograd node or the first Python frame outside torch behind a CPU op, e.g. 'modeling_x.py(120): fwd'."""
    node = evt
    while node is not None:
        if node.name.startswith("autograd::engine::evaluate_function"):
            return node.name.split(": ", 1)[-1]
        if node.stack:
            frames = [f for f in node.stack if "/torch/" not in f] or node.stack
            return os.path.basename(frames[0])
        node = node.cpu_parent
    return "?"


def attribute(step, step_idx, top):
    """Profile one step with the host side; print kernel ms per (op, launch site), largest first."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step(step_idx)
        torch.cuda.synchronize()
    by_site = collections.Counter()
    for evt in prof.events():
        if evt.kernels:
            by_site[(evt.name, launch_site(evt))] += sum(k.duration for k in evt.kernels) / 1000.0
    print(f"  by launch site ({sum(by_site.values()):.1f} ms of kernels):")
    for (op, site), ms in by_site.most_common(top):
        print(f"  {ms:8.2f}  {op:28s} {site[:110]}")


def routing_stats(model, cfg, step, step_idx):
    """Per layer: tokens of the busiest expert over the mean, the coefficient of variation, empty experts."""
    stats, hooks = [], []

    def hook(_module, _inputs, output):
        counts = torch.bincount(output[-1].flatten(), minlength=cfg.num_experts).float()  # [E]
        stats.append((counts.max() / counts.mean()).item())
        stats.append((counts.std() / counts.mean()).item())
        stats.append(int((counts == 0).sum()))

    for layer in model.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    step(step_idx)
    for h in hooks:
        h.remove()
    rows = [stats[i:i + 3] for i in range(0, len(stats), 3)]
    print("  routing per layer (max/mean, cv, empty experts): " +
          "; ".join(f"{m:.2f} {cv:.2f} {z}" for m, cv, z in rows))


def profile_impl(impl, args):
    argv = ["--experts-impl", impl, "--layers", str(args.layers), "--steps", "1", *args.example_args.split()]
    targs = example.parse_args(argv)
    device = torch.device("cuda")
    cfg = example.model_config(targs.layers, False)
    model = example.build_model(cfg, targs, torch.bfloat16)
    num_steps, num_micro = args.warmup + args.steps + 1, targs.micro_batches
    data = example.synthetic_batches(cfg.vocab_size, num_steps * num_micro, targs.batch, targs.seq, 0)
    data = data.view(num_steps, num_micro, targs.batch, targs.seq)  # --micro-batches among the example's args
    optimizer = example.make_optimizer(model, targs, device)
    compute_loss = example.loss_function(targs.loss)

    def step(i):  # the example's training step, with its optimizer, loss and clip
        return example.train_step(model, optimizer, compute_loss, data[i].to(device), targs.clip)

    for i in range(args.warmup):
        step(i)
    if args.routing_stats:
        routing_stats(model, cfg, step, args.warmup)
    walls = []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(args.warmup + i)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    by_cat, by_kernel = collections.Counter(), collections.Counter()
    counts = collections.Counter()
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if total <= 0 or evt.count == 0 or evt.key.startswith("ProfilerStep"):
            continue
        ms = total / 1000.0 / args.steps
        by_cat[category(evt.key)] += ms
        by_kernel[evt.key] += ms
        counts[evt.key] += evt.count // args.steps
    kernel_sum = sum(by_cat.values())
    print(f"\n== {impl} {args.example_args}: wall {statistics.median(walls) * 1e3:.1f} ms/step (profiled), kernels' sum "
          f"{kernel_sum:.1f} ms/step, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    for cat, ms in by_cat.most_common():
        print(f"  {cat:12s} {ms:8.2f} ms  {100 * ms / kernel_sum:5.1f}%")
    print("  top kernels (ms/step, launches/step):")
    for key, ms in by_kernel.most_common(args.top):
        print(f"  {ms:8.2f}  x{counts[key]:<4d} [{category(key)}] {short_name(key)}")
    if args.attribute:
        attribute(step, args.warmup + args.steps, 2 * args.top)
    del model, optimizer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default="megamoe,grouped_mm")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--example-args", default="", help="more train_qwen3_moe.py flags, e.g. '--compile-layers'")
    p.add_argument("--attribute", action="store_true", help="also charge kernels to ops and Python lines")
    p.add_argument("--routing-stats", action="store_true", help="print how evenly each layer's router spreads tokens")
    args = p.parse_args()
    for impl in args.impls.split(","):
        profile_impl(impl, args)


if __name__ == "__main__":
    main()
