"""Steps of torchtitan's own trainer (torchtitan 0.3.0's Trainer, built from its config through its ConfigManager, the
step its train_step), one run per process, written to a JSON file: the per-step loss, the step times, tokens/s, peak
memory, and (with --experts-share) the routed experts' share of a step.

    python bench/titan_train.py --config qwen3_30b_a3b --layers 4 --steps 200 --seconds 120 --json run.json \\
        -- --override.imports megamoe.adapters.torchtitan_converter.megamoe_experts --compile.enable

Everything after `--` is torchtitan's command line (ConfigManager.parse_args, `--module titan_configs` and `--config`
added): the converter's command-line form, compile, batch, parallelism. --layers keeps the model's first N layers
(the rest of its config as torchtitan's). The loop is torchtitan's Trainer.train() less checkpointing, validation and
profiling: train_step per step (its forward / backward, gradient clipping, optimizer and LR steps, metrics), stopped
at --steps, or once --seconds have passed after the first step (the steps done are in the JSON).

--device cpu runs it on the CPU for a dry run: torchtitan picks CUDA when no accelerator is present and reads the
CUDA memory statistics (cpu_device_plumbing() points its device globals at the CPU, with no memory statistics), and
flex attention has no CPU backward (every attention becomes torchtitan's causal SDPA attention).
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from titan_data import install_datasets_stand_in  # noqa: E402

WARMUP_STEPS_EXCLUDED = 5  # the first steps (compilation, CUDA graph capture, allocator growth) left out of the timing


def cpu_device_plumbing():
    """Point torchtitan's device globals at the CPU (a device module with no memory statistics)."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.utils as utils

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = types.SimpleNamespace(
        set_device=lambda device: None, get_device_name=lambda device=None: "cpu", current_device=lambda: 0,
        device_count=lambda: 1, get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=total),
        reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None, memory_stats=lambda *a: {},
        synchronize=lambda *a: None)
    for module in (utils, metrics, dist_utils, token_dispatcher):
        module.device_type, module.device_module = "cpu", cpu
    parallel_dims.device_type = "cpu"


def single_process_environment():
    """torchrun's variables for one process (torchtitan initialises torch.distributed from them)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(name, value)


def build_trainer(args, titan_args):
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", "titan_configs", "--config", args.config, *titan_args])
    model = config.model_spec.model
    if args.layers:
        model.layers = model.layers[:args.layers]
        if getattr(model, "mtp_layers", None):
            model.mtp_layers = []
    if args.device == "cpu":  # flex attention has no CPU backward: torchtitan's SDPA attention (causal, no masks)
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.steps = args.steps
    return config, config.build()


def routed_experts_kinds(model):
    """{class name of each MoE layer's routed experts / inner experts: count} (shows what the converter swapped)."""
    kinds = {}
    for module in model.modules():
        if hasattr(module, "token_dispatcher") and hasattr(module, "inner_experts"):
            name = f"{type(module).__name__}/{type(module.inner_experts).__name__}"
            kinds[name] = kinds.get(name, 0) + 1
    return kinds


def experts_share(trainer, step_seconds, repeats=10):
    """The routed experts' share of a step, estimated: one MoE layer's routed experts (dispatch, experts, combine;
    torchtitan's or megamoe's, eager) timed forward + backward on this run's batch shape with its router's real
    routing, times the number of MoE layers, over the measured step time. None where no MoE layer is found."""
    model = trainer.model_parts[0]
    layers = [layer for layer in model.layers.values() if getattr(layer, "moe", None) is not None]
    if not layers or trainer.device.type != "cuda":
        return None
    moe = layers[0].moe
    dim = moe.router.gate.weight.shape[-1]
    batch, seq = trainer.config.training.local_batch_size, trainer.config.training.seq_len
    dtype = torch.bfloat16
    x = torch.randn(batch, seq, dim, device=trainer.device, dtype=dtype) * 0.5
    with torch.no_grad():
        scores, ids, _ = moe.router(x, moe.expert_bias_E)
    counts = torch.bincount(ids.reshape(-1), minlength=moe.routed_experts.inner_experts.num_experts)
    x.requires_grad_()
    dy = torch.randn_like(x)

    def once():
        out = moe.routed_experts(x, scores, ids, counts)
        out.backward(dy)

    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        once()
    end.record()
    torch.cuda.synchronize()
    layer_seconds = start.elapsed_time(end) / 1000 / repeats
    model.zero_grad(set_to_none=True)
    return {"layer_fwd_bwd_ms": layer_seconds * 1000, "moe_layers": len(layers),
            "share": layer_seconds * len(layers) / step_seconds}


def summarize(records, tokens_per_step):
    """Timing of the logged steps: the step time is the wall time between consecutive steps' metrics (each step's
    logging reads its loss: the step has finished), the first WARMUP_STEPS_EXCLUDED left out."""
    times = [b["time"] - a["time"] for a, b in zip(records, records[1:])][WARMUP_STEPS_EXCLUDED - 1:]
    if not times:
        return {}
    median = statistics.median(times)
    return {"timed_steps": len(times), "step_median_s": median, "step_mean_s": statistics.fmean(times),
            "tokens_per_s": tokens_per_step / median}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, titan_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a function of bench/titan_configs.py")
    parser.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=0, help="stop after this long past the first step (0: no)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--experts-share", action="store_true", help="estimate the routed experts' share")
    parser.add_argument("--json", required=True, help="where the run's results go")
    args = parser.parse_args(ours)

    install_datasets_stand_in()
    if args.device == "cpu":
        cpu_device_plumbing()
    single_process_environment()
    from torchtitan.tools.logging import init_logger

    init_logger()
    started = time.perf_counter()
    config, trainer = build_trainer(args, titan_args)
    metrics = trainer.metrics_processor
    result = {"config": args.config, "layers": args.layers, "titan_args": titan_args, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "experts": routed_experts_kinds(trainer.model_parts[0]),
              "local_batch_size": config.training.local_batch_size, "seq_len": config.training.seq_len,
              "compile": config.compile.enable and "model" in config.compile.components,
              "cuda_graphs": not config.training.disable_cuda_graphs, "steps_planned": args.steps,
              "build_s": time.perf_counter() - started}
    tokens_per_step = config.training.local_batch_size * config.training.seq_len
    data_iterator = trainer.batch_generator(trainer.dataloader)
    first_step_done = None
    try:
        for step in range(1, args.steps + 1):
            trainer.step = step
            trainer.gc_handler.run(step)
            trainer.train_step(data_iterator)
            first_step_done = first_step_done or time.perf_counter()
            if args.seconds and time.perf_counter() - first_step_done > args.seconds:
                break
    except Exception as error:  # recorded with the steps done so far, then raised
        result["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        records = metrics.records
        result.update({
            "steps_done": len(records),
            "losses": [r["loss_metrics/global_avg_loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records],
            "titan_tps": [r["throughput(tps)"] for r in records],
            "peak_active_gib": max((r["memory/max_active(GiB)"] for r in records), default=None),
            "peak_reserved_gib": max((r["memory/max_reserved(GiB)"] for r in records), default=None),
            "tokens_per_step": tokens_per_step, **summarize(records, tokens_per_step)})
        if args.device == "cuda":
            result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    if args.experts_share and "step_median_s" in result:
        result["experts_share"] = experts_share(trainer, result["step_median_s"])
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    print(json.dumps({k: result[k] for k in ("config", "experts", "steps_done", "tokens_per_s", "peak_active_gib")
                      if k in result}))
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
