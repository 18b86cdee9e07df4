"""Where a training step of examples/train_qwen3_moe.py spends its GPU time, per experts implementation: GPU kernel
time per step grouped by category (experts, router, attention, dense GEMMs, loss, optimizer, ...), the top kernels,
and the step's wall time against the kernels' sum (the rest is the GPU waiting on the host). --attribute also
profiles one step with the host side and charges each kernel to the op that launched it and the Python line (or
autograd node) behind it, to tell which code a copy or an elementwise kernel belongs to. --by-module profiles one step
more and charges each kernel to the part of the model that ran it, forward and backward apart (MODULE_PARTS: the
embedding, attention, the router, the routed experts, the norms, the LM head, the decoder layers' residual adds; the
optimizer; the rest, the loss included, outside the model), the FP8 weight quantization apart wherever it runs: the
step's breakdown beside the experts' share. A backward kernel is charged through its autograd node to the forward op
that made the node (the profiler's sequence numbers); eager layers only (a compiled layer's kernels are charged to the
layer's first part).

    MEGAMOE_LIBRARY=build/libmegamoe.so PYTHONPATH=python python3 scripts/profile_train.py \
        [--impls megamoe,grouped_mm] [--layers 8] [--warmup 3] [--steps 2] [--top 25] [--attribute] [--by-module] \
        [--routing-stats] \
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
    ("weight quant", r"quantize_blocks"),  # megamoe FP8's weight copies (128 x 128 blocks), once per optimizer step
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


def self_and_parents(evt):
    """A profiler event, then the CPU ops around it, innermost first."""
    while evt is not None:
        yield evt
        evt = evt.cpu_parent


def launch_site(evt):
    """The autograd node or the first Python frame outside torch behind a CPU op, e.g. 'modeling_x.py(120): fwd'."""
    for node in self_and_parents(evt):
        if node.name.startswith("autograd::engine::evaluate_function"):
            return node.name.split(": ", 1)[-1]
        if node.stack:
            frames = [f for f in node.stack if "/torch/" not in f] or node.stack
            return os.path.basename(frames[0])
    return "?"


def profile_step(step, step_idx, with_stack=False):
    """The profiler's events of one step, the host side included."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
        step(step_idx)
        torch.cuda.synchronize()
    return prof.events()


def attribute(step, step_idx, top):
    """Profile one step with the host side; print kernel ms per (op, launch site), largest first."""
    by_site = collections.Counter()
    for evt in profile_step(step, step_idx, with_stack=True):
        if evt.kernels:
            by_site[(evt.name, launch_site(evt))] += sum(k.duration for k in evt.kernels) / 1000.0
    print(f"  by launch site ({sum(by_site.values()):.1f} ms of kernels):")
    for (op, site), ms in by_site.most_common(top):
        print(f"  {ms:8.2f}  {op:28s} {site[:110]}")


MODULE_PARTS = (  # (part, regex on a module's qualified name), first match wins; the innermost matched module counts
    ("experts", r"\.mlp\.experts$"),
    ("router", r"\.mlp(\.gate)?$"),  # the gate, and the MoE block's own ops: softmax, top-k, the weights' norm
    ("attention", r"\.self_attn$"),
    ("norms", r"norm$"),
    ("embedding", r"embed_tokens$"),
    ("LM head", r"^lm_head$"),
    ("decoder layers, other", r"\.layers\.\d+$"),  # the residual adds
)
SCOPE = "module::"  # the profiler scopes the hooks open: SCOPE + part
OPTIMIZER_SCOPE = "Optimizer."  # torch.optim's own profiler scopes: Optimizer.step#AdamW.step, Optimizer.zero_grad#...
OUTSIDE = "outside the model (loss, clip, ...)"


def scope_modules(model):
    """Open a profiler scope (record_function) named SCOPE + part around the forward of each module of MODULE_PARTS;
    returns the hook handles (remove them when done)."""
    handles = []
    for name, module in model.named_modules():
        part = next((part for part, pattern in MODULE_PARTS if re.search(pattern, name)), None)
        if part is None:
            continue
        open_scopes = []

        def enter(_module, _inputs, part=part, open_scopes=open_scopes):
            scope = torch.autograd.profiler.record_function(SCOPE + part)
            scope.__enter__()
            open_scopes.append(scope)

        def leave(_module, _inputs, _output, open_scopes=open_scopes):
            open_scopes.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def part_of_events(events):
    """{event id: (part, pass)} for the events of one profiled step, pass "fwd", "bwd" or "" (optimizer, outside):
    the innermost SCOPE ancestor of a forward op; for a backward op, that of the forward op whose sequence number its
    autograd node (autograd::engine::evaluate_function) carries; the optimizer's own scope; else OUTSIDE."""
    def innermost_part(chain):
        return next((a.name[len(SCOPE):] for a in chain if a.name.startswith(SCOPE)), None)

    forward_part = {}  # sequence number of a forward op -> its part
    for evt in events:
        if evt.sequence_nr is not None and evt.sequence_nr >= 0 and not evt.name.startswith("autograd::engine"):
            part = innermost_part(self_and_parents(evt))
            if part is not None:
                forward_part.setdefault(evt.sequence_nr, part)
    parts = {}
    for evt in events:
        chain = list(self_and_parents(evt))
        node = next((a for a in chain if a.name.startswith("autograd::engine::evaluate_function")), None)
        if node is not None:
            parts[evt.id] = (forward_part.get(node.sequence_nr, OUTSIDE), "bwd")
        elif any(a.name.startswith(OPTIMIZER_SCOPE) for a in chain):
            parts[evt.id] = ("optimizer", "")
        else:
            part = innermost_part(chain)
            parts[evt.id] = (part, "fwd") if part is not None else (OUTSIDE, "")
    return parts


def by_module(model, step, step_idx):
    """Profile one step with the host side; print kernel ms per part of the model, forward and backward apart."""
    handles = scope_modules(model)
    try:
        events = profile_step(step, step_idx)
    finally:
        for handle in handles:
            handle.remove()
    parts = part_of_events(events)
    ms = collections.Counter()
    for evt in events:
        for kernel in evt.kernels:
            key = ("weight quant", "") if category(kernel.name) == "weight quant" else parts[evt.id]
            ms[key] += kernel.duration / 1000.0
    total = sum(ms.values())
    print(f"  by part of the model ({total:.1f} ms of kernels in one step):")
    for (part, pass_name), part_ms in ms.most_common():
        print(f"  {part_ms:8.2f} ms  {100 * part_ms / total:5.1f}%  {part} {pass_name}".rstrip())


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
    if args.by_module:
        by_module(model, step, args.warmup + args.steps)
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
    p.add_argument("--by-module", action="store_true", help="also charge kernels to parts of the model, fwd / bwd")
    p.add_argument("--routing-stats", action="store_true", help="print how evenly each layer's router spreads tokens")
    args = p.parse_args()
    for impl in args.impls.split(","):
        profile_impl(impl, args)


if __name__ == "__main__":
    main()
