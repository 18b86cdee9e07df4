"""Steps of torchtitan's own trainer, one run per process, written to a JSON file: the per-step loss, the step times,
tokens/s, peak memory, and (with --experts-share) the routed experts' share of a step. Peak memory twice: torchtitan's
own metric (the whole step's) and, on CUDA, the largest allocation reached before the optimizer step (the forward and
backward beside the weights, gradients and optimizer state: where an experts implementation's activations show when
the optimizer step sets the whole step's peak).

    python bench/titan_train.py --model qwen3_30b_a3b --experts megamoe --layers 4 --steps 200 --seconds 120 \
        --json run.json [--compile] [-- more torchtitan arguments]

The trainer is the installed torchtitan's: 0.3 (its Trainer from its config through its ConfigManager: `--module
titan_configs --config <model>`, megamoe switched on by `--override.imports megamoe.adapters.torchtitan_converter.
megamoe_experts`, or `_fp8`) or 0.2 (its Trainer from its job config: `--model.name <spec>_synthetic`, megamoe by
`--model.converters megamoe` / `megamoe.fp8`; the settings of torchtitan 0.3.0's config, bench/titan_legacy.py).
--experts: torchtitan (its own experts), megamoe, megamoe-fp8, megamoe-list (0.3: the converter in the config's
converters list instead of the command line), torchao-fp8 (torchtitan's float8 grouped-experts converter; torchao).
--compile: torchtitan's compile of the model and the loss. --layers keeps the model's first N layers. The loop is
torchtitan's train() less checkpointing, validation and profiling: its train_step per step (forward / backward,
gradient clipping, optimizer and LR steps, metrics), stopped at --steps, or once --seconds have passed after the first
step (the steps done are in the JSON). --attention sdpa: torchtitan's causal SDPA attention in place of a flavour's
flex attention (DeepSeek-V3), which inductor autotunes for minutes at start-up; the comparison's runs share it.

--device cpu runs it on the CPU for a dry run: torchtitan picks CUDA when no accelerator is present and reads the
CUDA memory statistics (cpu_device_plumbing() points its device globals at the CPU, with no memory statistics), and
flex attention has no CPU backward (0.3: every attention becomes torchtitan's causal SDPA attention), and torchtitan
0.2's router counts expert ids with torch.histc, which takes integers on CUDA only (counted as floats on the CPU),
and its grouped-mm experts pad their rows with a Triton kernel (on the CPU: its per-expert loop, use_grouped_mm off).
"""

import argparse
import contextlib
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
    import importlib

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = types.SimpleNamespace(
        set_device=lambda device: None, get_device_name=lambda device=None: "cpu", current_device=lambda: 0,
        device_count=lambda: 1, get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=total),
        reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None, memory_stats=lambda *a: {},
        synchronize=lambda *a: None)
    for name in ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.utils",
                 "torchtitan.models.common.token_dispatcher", "torchtitan.distributed.parallel_dims"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module of the other release
            continue
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu
    histc = torch.histc  # torchtitan 0.2's router counts its int64 ids with torch.histc, which the CPU takes in floats

    def histc_of_integers(values, *args, **kwargs):
        if values.is_floating_point():
            return histc(values, *args, **kwargs)
        return histc(values.double(), *args, **kwargs).to(values.dtype)

    torch.histc = histc_of_integers


def single_process_environment():
    """torchrun's variables for one process (torchtitan initialises torch.distributed from them)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(name, value)


def release():
    """3 for torchtitan 0.3 (model-config converters), 2 for 0.2 (model converters by name)."""
    import importlib.util

    return 3 if importlib.util.find_spec("torchtitan.protocols.model_converter") is None else 2


OVERRIDES = {"megamoe": "megamoe.adapters.torchtitan_converter.megamoe_experts",
             "megamoe-fp8": "megamoe.adapters.torchtitan_converter.megamoe_experts_fp8"}
CONVERTERS_0_2 = {"megamoe": ["--model.converters", "megamoe"], "megamoe-fp8": ["--model.converters", "megamoe.fp8"],
                  "torchao-fp8": ["--model.converters", "quantize.grouped_mm.float8",
                                  "--quantize.grouped_mm.float8.fqns", "experts"]}
MODELS_0_3 = {"qwen3_moe_debug": "qwen3_moe_debug", "qwen3_30b_a3b": "qwen3_30b_a3b",
              "deepseek_v3_debug": "deepseek_v3_debugmodel", "deepseek_v3_16b": "deepseek_v3_16b"}


def titan_command_line(args):
    """(torchtitan's command line for this run, the release)."""
    compile_args = ["--compile.enable", "--compile.components", "model,loss"] if args.compile else []
    if release() == 3:
        function = MODELS_0_3[args.model] + {"torchao-fp8": "_torchao_fp8", "megamoe-list": "_megamoe"}.get(
            args.experts, "")
        line = ["--module", "titan_configs", "--config", function]
        if args.experts in OVERRIDES:
            line += ["--override.imports", OVERRIDES[args.experts]]
        return line + compile_args, 3
    import titan_legacy

    if args.experts == "megamoe-list":
        raise SystemExit("--experts megamoe-list: torchtitan 0.2 has no converters list in its model configs")
    spec, flavor = titan_legacy.MODELS[args.model]
    line = ["--model.name", f"{spec}_synthetic", "--model.flavor", flavor, "--experimental.custom_import",
            "titan_legacy", *titan_legacy.COMMON, *titan_legacy.TRAINING[args.model],
            *CONVERTERS_0_2.get(args.experts, [])]
    return line + compile_args, 2


def build_trainer(args, titan_args):
    """torchtitan's trainer of this run (config parsed by torchtitan's ConfigManager), the model cut to
    args.layers."""
    line, version = titan_command_line(args)
    if version == 3:
        from torchtitan.config import ConfigManager

        config = ConfigManager().parse_args([*line, *titan_args])
        model = config.model_spec.model
        if args.layers:
            model.layers = model.layers[:args.layers]
            if getattr(model, "mtp_layers", None):
                model.mtp_layers = []
        if args.device == "cpu" or args.attention == "sdpa":  # flex attention has no CPU backward: SDPA (causal)
            from torchtitan.models.common.attention import ScaledDotProductAttention

            for layer in model.layers:
                layer.attention.inner_attention = ScaledDotProductAttention.Config()
        config.training.steps = args.steps
        return config, config.build()
    import titan_legacy
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    config = ConfigManager().parse_args([*line, "--training.steps", str(args.steps), *titan_args])
    if args.layers:
        titan_legacy.cut_layers(config.model.name, config.model.flavor, args.layers)
    if args.attention == "sdpa":
        titan_legacy.use_sdpa_attention(config.model.name, config.model.flavor)
    if args.device == "cpu":
        titan_legacy.use_expert_loop(config.model.name, config.model.flavor)
    return config, Trainer(config)


def recorded_metrics(trainer):
    """Keep every metrics dict torchtitan logs (its MetricsProcessor's logger), with the wall time of logging."""
    records = []
    metrics = trainer.metrics_processor
    inner = metrics.logger

    class Keep:
        def log(self, values, step):
            records.append({"step": step, "time": time.perf_counter(), **values})
            inner.log(values, step)

        def close(self):
            inner.close()

    metrics.logger = Keep()
    return records


class PeakBeforeOptimizer:
    """The CUDA allocator's peak from the start of each step to its first optimizer step (a global optimizer step
    pre-hook; torchtitan's optimizers are torch.optim ones): start() before a step, `peaks` (bytes) one per step."""

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.peaks, self.armed = [], False
        self.handle = register_optimizer_step_pre_hook(self._before_step)

    def start(self):
        torch.cuda.reset_peak_memory_stats()
        self.armed = True

    def _before_step(self, optimizer, args, kwargs):
        if self.armed:
            self.peaks.append(torch.cuda.max_memory_allocated())
            self.armed = False


def routed_experts_kinds(model):
    """{the class names of each MoE layer's routed experts (0.3: RoutedExperts / its inner experts; 0.2: MoE / its
    experts): count}: what the converter swapped."""
    kinds = {}
    for module in model.modules():
        if hasattr(module, "token_dispatcher") and hasattr(module, "inner_experts"):
            name = f"{type(module).__name__}/{type(module.inner_experts).__name__}"
        elif hasattr(module, "router") and hasattr(module, "experts"):
            name = f"{type(module).__name__}/{type(module.experts).__name__}"
        else:
            continue
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def experts_share(trainer, step_seconds, repeats=10):
    """The MoE layers' share of a step, estimated: one MoE layer (router, routed experts, shared experts: eager)
    timed forward + backward on this run's batch shape (its parameters gathered as the step gathers them, under the
    trainer's autocast), times the number of MoE layers, over the measured step time."""
    model = trainer.model_parts[0]
    blocks = [block for block in model.layers.values() if getattr(block, "moe", None) is not None]
    if not blocks or trainer.device.type != "cuda":
        return None
    block = blocks[0]
    config = trainer.config if hasattr(trainer, "config") else trainer.job_config
    batch, seq = config.training.local_batch_size, config.training.seq_len
    dim = block.moe.router.gate.weight.shape[-1]
    x = (torch.randn(batch, seq, dim, device=trainer.device, dtype=torch.bfloat16) * 0.5).requires_grad_()
    dy = torch.randn_like(x)
    autocast = getattr(trainer, "maybe_enable_amp", None) or contextlib.nullcontext()
    unshard = getattr(block, "unshard", None)  # FSDP2 blocks: the step gathers their parameters this way

    def once():
        with autocast:
            out = block.moe(x)
        out.backward(dy)

    try:
        if unshard is not None:
            unshard()
        for _ in range(3):
            once()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            once()
        end.record()
        torch.cuda.synchronize()
    except Exception as error:  # an estimate only: the run's results stand without it
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        if unshard is not None:
            block.reshard()
        model.zero_grad(set_to_none=True)
    layer_seconds = start.elapsed_time(end) / 1000 / repeats
    return {"moe_layer_fwd_bwd_ms": layer_seconds * 1000, "moe_layers": len(blocks),
            "share": layer_seconds * len(blocks) / step_seconds}


def activation_checkpointing(config):
    """The run's activation checkpointing: "none", "full", "selective", ... (0.2: a mode string; 0.3: a policy's
    config object, or None)."""
    policy = config.activation_checkpoint
    if policy is None:
        return "none"
    mode = getattr(policy, "mode", None)
    if isinstance(mode, str):
        return mode
    name = type(policy).__qualname__.split(".")[0]  # FullAC.Config, SelectiveAC.Config, MemoryBudgetAC.Config
    return {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "memory_budget"}.get(name, name)


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
    parser.add_argument("--model", required=True, choices=list(MODELS_0_3))
    parser.add_argument("--experts", default="torchtitan",
                        choices=["torchtitan", "megamoe", "megamoe-fp8", "megamoe-list", "torchao-fp8"])
    parser.add_argument("--compile", action="store_true", help="torchtitan's compile of the model and the loss")
    parser.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=0, help="stop after this long past the first step (0: no)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--attention", choices=["model", "sdpa"], default="model",
                        help="sdpa: torchtitan's causal SDPA attention in place of the model's flex attention")
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
    records = recorded_metrics(trainer)
    import torchtitan

    result = {"model": args.model, "experts_asked": args.experts, "layers": args.layers, "attention": args.attention,
              "titan_command_line": titan_command_line(args)[0] + titan_args, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "torchtitan": getattr(torchtitan, "__version__", "?"),
              "experts": routed_experts_kinds(trainer.model_parts[0]),
              "local_batch_size": config.training.local_batch_size, "seq_len": config.training.seq_len,
              "compile": config.compile.enable and "model" in config.compile.components,
              "activation_checkpoint": activation_checkpointing(config),
              "cuda_graphs": not getattr(config.training, "disable_cuda_graphs", True), "steps_planned": args.steps,
              "build_s": time.perf_counter() - started}
    tokens_per_step = config.training.local_batch_size * config.training.seq_len
    data_iterator = trainer.batch_generator(trainer.dataloader)
    before_optimizer = PeakBeforeOptimizer() if args.device == "cuda" else None
    first_step_done = None
    try:
        for step in range(1, args.steps + 1):
            trainer.step = step
            trainer.gc_handler.run(step)
            if before_optimizer is not None:
                before_optimizer.start()
            trainer.train_step(data_iterator)
            first_step_done = first_step_done or time.perf_counter()
            if args.seconds and time.perf_counter() - first_step_done > args.seconds:
                break
    except KeyboardInterrupt:  # scripts/gpu_torchtitan.sh's time limit: the steps done so far stand
        result["error"] = "stopped by the time limit (SIGINT) after the steps recorded"
    except Exception as error:  # recorded with the steps done so far, then raised
        result["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
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
            peaks = before_optimizer.peaks[WARMUP_STEPS_EXCLUDED:] or before_optimizer.peaks
            result["peak_before_optimizer_gib"] = max(peaks) / 2**30 if peaks else None
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    if args.experts_share and "step_median_s" in result:
        result["experts_share"] = experts_share(trainer, result["step_median_s"])
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    print(json.dumps({k: result[k] for k in ("model", "experts", "steps_done", "tokens_per_s", "peak_active_gib")
                      if k in result}))
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
