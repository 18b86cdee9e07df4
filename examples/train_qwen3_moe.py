"""Train a Qwen3-30B-A3B-shaped causal LM with a chosen Hugging Face experts implementation.

The model has Qwen3-30B-A3B's real hidden size, expert intermediate size, experts, top-k, heads and vocabulary,
and fewer layers (default 8, so it fits one H200 with bf16 weights, gradients and AdamW states). Data are
synthetic token sequences from a seeded Markov chain (each token has 4 possible successors), so the loss can
fall from ln(vocab) towards ln(4) and two runs with the same --seed see the same weights and the same data.

    python examples/train_qwen3_moe.py --experts-impl megamoe --steps 50 --log-json megamoe.json
    python examples/train_qwen3_moe.py --experts-impl grouped_mm --steps 50 --log-json grouped_mm.json
    python examples/compare_losses.py megamoe.json grouped_mm.json --out losses.png
    python examples/train_qwen3_moe.py --tiny --device cpu --steps 3          # smoke test, no GPU needed

Needs transformers 5.x (pip install "transformers>=5,<6"); tqdm is optional. Prints the median step time after
the warm-up steps, tokens/s and peak memory.
"""

import argparse
import json
import math
import platform
import resource
import statistics
import sys
import time

import torch

BRANCHING = 4  # successors per token in the synthetic Markov chain: the loss floor is ln(4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts-impl", default="megamoe",
                   help="megamoe, megamoe-fp8 (blockwise FP8, Hopper), grouped_mm, batched_mm, eager, ...")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (Qwen3-30B-A3B has 48)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 4096; 64 with --tiny)")
    p.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 4; 2 with --tiny)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="forward / backward passes per optimizer step (gradient accumulation: each micro-batch's "
                        "loss / micro-batches; tokens per step = micro-batches x batch x seq)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the data")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights, gradients and AdamW states")
    p.add_argument("--attn-impl", default="sdpa", help="Hugging Face attn_implementation")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing of the decoder layers")
    p.add_argument(
        "--loss", choices=("auto", "hf", "compiled"), default="auto",
        help="hf: the model's own loss (copies the [tokens, vocab] logits to fp32, then log-softmax); compiled: the "
        "same fp32 cross-entropy as one torch.compile'd function over the bf16 logits (no fp32 copies); "
        "auto: compiled on CUDA, hf on the CPU",
    )
    p.add_argument("--compile-layers", action="store_true", help="torch.compile each decoder layer (experts included)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny config of the same family (CPU smoke test)")
    p.add_argument("--log-json", default=None, metavar="PATH", help="write the per-step losses and timings here")
    args = p.parse_args(argv)
    args.seq = args.seq or (64 if args.tiny else 4096)
    args.batch = args.batch or (2 if args.tiny else 4)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.warmup = min(args.warmup, max(args.steps - 1, 0))
    if args.micro_batches < 1:
        p.error(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.loss == "auto":
        args.loss = "compiled" if args.device.startswith("cuda") else "hf"
    return args


def model_config(layers, tiny):
    """Qwen3-30B-A3B's shapes with `layers` decoder layers, or a tiny config of the same family."""
    from transformers import Qwen3MoeConfig

    common = {"num_hidden_layers": layers, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    if tiny:
        return Qwen3MoeConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
            **common,
        )
    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common,
    )


def synthetic_batches(vocab, steps, batch, seq, seed):
    """[steps, batch, seq] int64 token ids from a seeded Markov chain (on the CPU, the same on every machine)."""
    gen = torch.Generator().manual_seed(seed + 1)
    successors = torch.randint(0, vocab, (vocab, BRANCHING), generator=gen)  # [V, BRANCHING]
    choice = torch.randint(0, BRANCHING, (steps * batch, seq), generator=gen)  # [rows, seq]
    tokens = torch.empty(steps * batch, seq, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, vocab, (steps * batch,), generator=gen)
    for t in range(1, seq):
        tokens[:, t] = successors[tokens[:, t - 1], choice[:, t]]
    return tokens.view(steps, batch, seq)


def build_model(cfg, args, dtype):
    """The causal LM, initialised from --seed directly on the device, with the chosen experts implementation."""
    from transformers import AutoModelForCausalLM

    if args.experts_impl in ("megamoe", "megamoe-fp8"):
        import megamoe.hf  # noqa: F401  (registers experts_implementation="megamoe" and "megamoe-fp8")
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, attn_implementation=args.attn_impl, experts_implementation=args.experts_impl
        )
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    if args.compile_layers:
        for layer in model.model.layers:
            layer.compile()
    model.train()
    return model


def causal_lm_cross_entropy(logits, input_ids):
    """The model's own loss (transformers' ForCausalLMLoss: position t predicts token t + 1, mean over the
    predicted positions, softmax in fp32) as one function for torch.compile, which fuses the fp32 upcast into the
    softmax instead of materialising fp32 copies of the [batch * seq, vocab] logits. logits [B, S, V]; input_ids [B, S]."""
    labels = torch.nn.functional.pad(input_ids, (0, 1), value=-100)[..., 1:]  # [B, S]: the next token, -100 at the end
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def loss_function(kind):
    """loss(model, input_ids) for --loss hf / compiled."""
    if kind == "hf":
        return lambda model, input_ids: model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    cross_entropy = torch.compile(causal_lm_cross_entropy, fullgraph=True)
    return lambda model, input_ids: cross_entropy(model(input_ids=input_ids, use_cache=False).logits, input_ids)


def param_counts(model, cfg):
    """(total parameters, parameters active per token)."""
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    inactive = cfg.num_hidden_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    return total, total - inactive


def peak_memory_gib(device):
    """Peak memory: allocated by torch on CUDA, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kib / 2**20 if platform.system() != "Darwin" else rss_kib / 2**30


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def progress(steps):
    """tqdm over the steps when it is installed, else a plain range (the loop prints instead)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return range(steps), None
    bar = tqdm(range(steps), desc="train", unit="step", dynamic_ncols=True)
    return bar, bar


def make_optimizer(model, args, device):
    """AdamW (fused on CUDA) with weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def train_step(model, optimizer, compute_loss, micro_batches, clip):
    """One optimizer step over micro_batches [micro-batches, batch, seq]: the gradients of every micro-batch's loss /
    micro-batches accumulated, then the clip and AdamW. Returns the mean of the micro-batches' losses (a Python
    float: waits for the step)."""
    num_micro_batches = micro_batches.shape[0]
    total_loss = 0.0
    for input_ids in micro_batches:  # [batch, seq]
        loss = compute_loss(model, input_ids) / num_micro_batches
        loss.backward()
        total_loss = total_loss + loss.detach()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total_loss)


def train(model, data, args, device):
    """Run the steps; returns (losses, step seconds)."""
    optimizer = make_optimizer(model, args, device)
    compute_loss = loss_function(args.loss)
    losses, times = [], []
    steps, bar = progress(args.steps)
    for step in steps:
        input_ids = data[step].to(device, non_blocking=True)  # [micro-batches, batch, seq]
        synchronize(device)
        start = time.perf_counter()
        loss_value = train_step(model, optimizer, compute_loss, input_ids, args.clip)
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss_value)
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at step {step}")
        if bar is not None:
            bar.set_postfix(loss=f"{loss_value:.4f}", step_s=f"{times[-1]:.3f}")
        else:
            print(f"step {step + 1}/{args.steps}  loss {loss_value:.4f}  {times[-1]:.3f} s", flush=True)
    return losses, times


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.experts_impl == "megamoe" and device.type == "cuda" and dtype != torch.bfloat16:
        sys.exit("megamoe on CUDA runs bf16/f16: use --dtype bf16 (fp32 runs on the CPU reference)")
    import transformers

    cfg = model_config(args.layers, args.tiny)
    model = build_model(cfg, args, dtype)
    total, active = param_counts(model, cfg)
    tokens_per_step = args.micro_batches * args.batch * args.seq
    print(
        f"Qwen3-MoE{' (tiny)' if args.tiny else '-30B-A3B shapes'}: {cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, experts {cfg.num_experts} x top-{cfg.num_experts_per_tok} of intermediate "
        f"{cfg.moe_intermediate_size}, vocab {cfg.vocab_size}; {total / 1e6:,.1f} M parameters ({active / 1e6:,.1f} M "
        f"active); experts_implementation={model.config._experts_implementation}, attn={args.attn_impl}, "
        f"loss={args.loss}{', compiled layers' if args.compile_layers else ''}, {args.dtype}, {args.micro_batches} micro-batch(es) x batch {args.batch} x seq {args.seq} = {tokens_per_step} "
        f"tokens/step, AdamW{' (fused)' if device.type == 'cuda' else ''} on {device}",
        flush=True,
    )
    data = synthetic_batches(cfg.vocab_size, args.steps * args.micro_batches, args.batch, args.seq, args.seed)
    data = data.view(args.steps, args.micro_batches, args.batch, args.seq)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = train(model, data, args, device)

    timed = times[args.warmup :]
    median = statistics.median(timed)
    peak = peak_memory_gib(device)
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (ln vocab = {math.log(cfg.vocab_size):.4f}, floor ln "
        f"{BRANCHING} = {math.log(BRANCHING):.4f})\nmedian step {median:.4f} s over steps {args.warmup + 1}.."
        f"{args.steps}, {tokens_per_step / median:,.0f} tokens/s, peak memory {peak:.2f} GiB "
        f"({'torch allocated' if device.type == 'cuda' else 'process RSS'})",
        flush=True,
    )
    if args.log_json:
        record = {
            "experts_impl": args.experts_impl,
            "args": vars(args),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "params": total,
            "active_params": active,
            "tokens_per_step": tokens_per_step,
            "losses": losses,
            "step_s": times,
            "median_step_s": median,
            "tokens_per_s": tokens_per_step / median,
            "peak_memory_gib": peak,
        }
        with open(args.log_json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.log_json}")


if __name__ == "__main__":
    main()
