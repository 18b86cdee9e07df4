"""torchtitan's parallel layouts with megamoe's converter, inside a gloo process group (spawned by
test_torchtitan_parallel.py through test_ep.py's harness; ep_cases.run_cases runs the cases): each case builds
torchtitan's model twice (its own experts, and converted) on the meta device in float64, parallelizes both with the
model's own parallelize function (torchtitan's Module.parallelize for TP / EP sharding, its apply_fsdp_to_decoder for
FSDP2; mixed-precision dtypes float64), loads one full state dict into both (each parameter distributed as the model
holds it), runs this rank's tokens forward and backward, and checks on every rank: the logits and every gradient
(DTensor gradients gathered) agree within 1e-10, and megamoe took the expected path (the whole-layer call without
expert parallelism, the grouped experts behind torchtitan's all-to-all dispatcher with it).

On the CPU: torchtitan builds its meshes for CUDA when no accelerator is present, so its parallel_dims module's
device type is set to "cpu" here; the attentions are SDPA (titan_models.py); float64 is added to torchtitan's
TORCH_DTYPE_MAP (its mixed-precision setting takes bf16 / f32 names). Expert parallelism runs with torchtitan's
"partial_dtensor" SPMD backend: under its default "spmd_types" backend torchtitan's own all-to-all dispatcher does not
run on gloo (uneven all_to_all splits), with or without megamoe.
"""

import functools
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from titan_data import install_datasets_stand_in  # noqa: E402

install_datasets_stand_in()

import torchtitan.distributed.parallel_dims as titan_parallel_dims  # noqa: E402
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as titan_dist_utils  # noqa: E402

from adapter_cases import assert_close  # noqa: E402
from ep_cases import SkipCase  # noqa: E402
from framework_cases import float64_shim  # noqa: E402
from megamoe.adapters import torchtitan_converter as converter  # noqa: E402
from titan_models import model_spec, random_state, build  # noqa: E402

titan_parallel_dims.device_type = "cpu"
TORCH_DTYPE_MAP.setdefault("float64", torch.float64)
BOUND = 1e-10
SEQ = 16


@functools.cache
def parallel_dims(backend, P, degrees):
    """torchtitan's ParallelDims of a layout, made once per process: a second one of the same layout gets the first's
    flattened meshes from torch's mesh registry, which fully_shard then finds different from its own."""
    return ParallelDims.from_config(ParallelismConfig(spmd_backend=backend, **dict(degrees)), P)


def parallel_model(spec, parallelism, dims, state):
    """spec's model built on meta in float64, parallelized by the model's own parallelize function, on the CPU with
    `state` loaded (each entry distributed as the model holds it)."""
    from torchtitan.trainer import Trainer

    training = TrainingConfig(local_batch_size=2, seq_len=SEQ, mixed_precision_param="float64",
                              mixed_precision_reduce="float64", disable_cuda_graphs=True)
    spec.model.update_from_config(config=Trainer.Config(parallelism=parallelism, training=training))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            model = spec.model.build()
    finally:
        torch.set_default_dtype(default)
    with tempfile.TemporaryDirectory() as dump:
        model = spec.parallelize_fn(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                    compile_config=CompileConfig(), ac_config=None, dump_folder=dump)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (RoPE); the parameters come from `state`
    held = model.state_dict()
    model.load_state_dict({key: distribute_tensor(state[key], value.device_mesh, value.placements)
                           if isinstance(value, DTensor) else state[key] for key, value in held.items()})
    return model


def forward_backward(model, dims, tokens, seed):
    """{"out": this rank's logits (its vocabulary shard under TP), each parameter: its gradient (DTensors
    gathered)}, for a random d out drawn from `seed` in the shape of this rank's logits."""
    with float64_shim(), titan_dist_utils.get_spmd_context(parallel_dims=dims)():
        out = model(tokens)
        local = out.to_local() if isinstance(out, DTensor) else out
        dout = torch.randn(local.shape, generator=torch.Generator().manual_seed(seed), dtype=local.dtype)
        if isinstance(out, DTensor):
            dout = DTensor.from_local(dout, out.device_mesh, out.placements, run_check=False)
        out.backward(dout)
        out = local
    grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for name, p in model.named_parameters() if p.grad is not None}
    return {"out": out.detach(), **grads}


def counting(name, calls):
    """converter.<name> (moe / grouped_moe) wrapped to count its calls."""
    original = getattr(converter, name)

    def call(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    return call


def compare_layout(rank, P, seed, model, backend, expected_path, layers=1, **degrees):
    """torchtitan's model and the converted one in the layout `degrees` (ParallelismConfig fields) under SPMD backend
    `backend`: equal within BOUND, megamoe's calls all of `expected_path`."""
    parallelism = ParallelismConfig(spmd_backend=backend, **degrees)
    titan_dist_utils.set_spmd_backend(backend)
    dims = parallel_dims(backend, P, tuple(sorted(degrees.items())))
    gen = torch.Generator().manual_seed(seed)
    state = random_state(build(model_spec(model, layers=layers).model), gen)
    torch.manual_seed(seed + 1 + rank)  # this rank's tokens
    config = model_spec(model, layers=layers).model
    tokens = torch.randint(0, config.vocab_size, (2, SEQ))
    results = []
    for converters in ([], [converter.MegamoeConverter.Config()]):
        parallel = parallel_model(model_spec(model, converters, layers), parallelism, dims, state)
        calls = {}
        originals = {name: getattr(converter, name) for name in ("moe", "grouped_moe")}
        for name in originals:
            setattr(converter, name, counting(name, calls))
        try:
            results.append(forward_backward(parallel, dims, tokens, seed + 1 + rank))
        finally:
            for name, original in originals.items():
                setattr(converter, name, original)
        if converters:
            assert set(calls) == {expected_path}, f"megamoe calls {calls}, expected {expected_path} only"
        else:
            assert not calls, f"torchtitan's model called megamoe: {calls}"
    theirs, ours = results
    assert ours.keys() == theirs.keys()
    assert_close(ours, theirs, BOUND)


def case_fsdp2_qwen3(rank, P, seed):
    """FSDP2 over every rank (torchtitan's default spmd_types backend): the whole-layer megamoe call."""
    compare_layout(rank, P, seed, "qwen3", "spmd_types", "moe", data_parallel_shard_degree=P)


def case_fsdp2_deepseek_v3(rank, P, seed):
    compare_layout(rank, P, seed, "deepseek_v3", "spmd_types", "moe", layers=2, data_parallel_shard_degree=P)


def case_tensor_parallel_qwen3(rank, P, seed):
    """TP over 2 ranks (experts sharded over their hidden dimension, partial sums), FSDP2 over the rest."""
    compare_layout(rank, P, seed, "qwen3", "spmd_types", "moe", tensor_parallel_degree=2,
                   data_parallel_shard_degree=P // 2)


def case_expert_parallel_qwen3(rank, P, seed):
    """EP over 2 ranks (torchtitan's all-to-all dispatcher; megamoe's grouped experts on the local experts), FSDP2
    over every rank (on the experts too where P > 2)."""
    compare_layout(rank, P, seed, "qwen3", "partial_dtensor", "grouped_moe", expert_parallel_degree=2,
                   data_parallel_shard_degree=P)


def case_expert_parallel_gpt_oss(rank, P, seed):
    compare_layout(rank, P, seed, "gpt_oss", "partial_dtensor", "grouped_moe", expert_parallel_degree=2,
                   data_parallel_shard_degree=P)


def case_tensor_parallel_gpt_oss(rank, P, seed):
    """gpt-oss experts sharded by TP under the spmd_types backend (plain local weights: torchtitan adds the whole
    down bias on each rank, and so does megamoe)."""
    compare_layout(rank, P, seed, "gpt_oss", "spmd_types", "moe", tensor_parallel_degree=2,
                   data_parallel_shard_degree=P // 2)


def case_tensor_parallel_gpt_oss_partial_dtensor(rank, P, seed):
    """The same under the partial_dtensor backend (DTensor weights on a "tp" mesh: torchtitan divides the down bias
    by the TP degree in the forward only, and so does megamoe)."""
    compare_layout(rank, P, seed, "gpt_oss", "partial_dtensor", "moe", tensor_parallel_degree=2,
                   data_parallel_shard_degree=P // 2)


def case_skip_reason_for_spmd_types_expert_parallel(rank, P, seed):
    raise SkipCase("expert parallelism under torchtitan's spmd_types backend: torchtitan's own all-to-all "
                   "dispatcher does not run on gloo (uneven all_to_all splits), with or without megamoe; the EP cases "
                   "run under its partial_dtensor backend")


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
FOUR_RANK_CASES = ["expert_parallel_qwen3", "tensor_parallel_qwen3"]  # EP 2 x FSDP 2 on the experts; TP 2 x FSDP 2
