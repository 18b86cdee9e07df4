"""torchtitan 0.3's own MoE models for the converter's tests (test_torchtitan_*.py): built through torchtitan's model
registries (qwen3 "debugmodel_moe", deepseek_v3 "debugmodel", gpt_oss "debugmodel") with and without megamoe's
converter, cut to their first layers, loaded with one state dict, and run in float64 on the CPU.

On the CPU every attention is torchtitan's ScaledDotProductAttention (its CPU-capable inner attention; flex
attention has no CPU backward and varlen needs CUDA), in both models of a comparison; the models are called
without attention masks (causal SDPA). framework_cases.float64_shim keeps torchtitan's own casts to bf16 / f32 from
rounding, so both models compute in float64 with their own operations."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

from framework_cases import float64_shim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from titan_data import install_datasets_stand_in  # noqa: E402

install_datasets_stand_in()  # torchtitan's trainer module (its model configs import it) imports `datasets`

MODELS = {  # name: (torchtitan module, flavor, layers kept: MoE layers included)
    "qwen3": ("qwen3", "debugmodel_moe", 2),
    "deepseek_v3": ("deepseek_v3", "debugmodel", 2),  # layer 0 is dense, layer 1 MoE (2 shared experts)
    "gpt_oss": ("gpt_oss", "debugmodel", 2),
}


def skip_unless_importable(version, modules=("torchtitan.trainer", "torchtitan.models.qwen3",
                                            "torchtitan.models.deepseek_v3", "torchtitan.models.gpt_oss")):
    """Skip the calling test module where this torchtitan release does not import with this torch (0.3.0 needs
    torch >= 2.12) or lacks its trainer's dependencies."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            pytest.skip(f"torchtitan {version} does not import here (torch {torch.__version__}): {error}",
                        allow_module_level=True)


def registry(model):
    """torchtitan's model_registry of a MODELS entry."""
    return importlib.import_module(f"torchtitan.models.{MODELS[model][0]}").model_registry


def model_spec(model, converters=None, layers=None):
    """torchtitan's ModelSpec from its registry (converters applied by the registry), the model config cut to its
    first layers, every attention the CPU-capable SDPA."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    _, flavor, default_layers = MODELS[model]
    spec = registry(model)(flavor, converters=converters)
    spec.model.layers = spec.model.layers[:layers or default_layers]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


def model_config(model, converters=None, layers=None):
    """The model config of model_spec(...)."""
    return model_spec(model, converters, layers).model


def moe_layers(module):
    """The MoE layers' routed experts of a built model: {layer name: RoutedExperts}."""
    return {name: layer.moe.routed_experts for name, layer in module.layers.items()
            if getattr(layer, "moe", None) is not None}


def random_state(module, gen):
    """torchtitan's initialisation (seeded from gen) in float64, the routed experts' parameters (biases included)
    redrawn at 0.1 so that they shape the output; the expert bias buffer random (it steers the routing)."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    with torch.no_grad():
        module.init_weights(buffer_device=None)
    state = {key: value.to(torch.float64) if value.is_floating_point() else value
             for key, value in module.state_dict().items()}
    for key, value in state.items():
        if ".routed_experts." in key:
            state[key] = torch.randn(value.shape, generator=gen, dtype=torch.float64) * 0.1
        if key.endswith("expert_bias_E"):
            state[key] = torch.randn(value.shape, generator=gen, dtype=torch.float64) * 0.01
    return state


def build(config, state=None, dtype=torch.float64):
    """The model of `config` on the CPU in `dtype`, loaded with `state` (torchtitan's keys) where given."""
    module = config.build()._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)  # complex RoPE kept
    if state is not None:
        module.load_state_dict({key: value.to(dtype) if value.is_floating_point() else value
                                for key, value in state.items()})
    return module


def run(module, tokens, dout, hooked=None):
    """{"out": logits, "moe.<layer>": that layer's output of `hooked` ({layer name: submodule}; default its
    routed experts, moe_layers), each parameter: its gradient} of <dout, module(tokens)>, in float64 through
    float64_shim."""
    outputs = {}
    hooked = moe_layers(module) if hooked is None else hooked
    hooks = [sub.register_forward_hook(lambda _m, _a, out, name=name: outputs.__setitem__(f"moe.{name}", out))
             for name, sub in hooked.items()]
    module.zero_grad(set_to_none=True)
    try:
        with float64_shim():
            out = module(tokens)
            out.backward(dout)
    finally:
        for hook in hooks:
            hook.remove()
    # the gradients (parameters that get none, e.g. gpt-oss's attention sinks without its own attention: left out)
    grads = {name: param.grad for name, param in module.named_parameters() if param.grad is not None}
    return {"out": out.detach(), **{k: v.detach() for k, v in outputs.items()}, **grads}


def tokens_and_dout(config, gen, batch=2, length=24, dtype=torch.float64):
    tokens = torch.randint(0, config.vocab_size, (batch, length), generator=gen)
    dout = torch.randn(batch, length, config.vocab_size, generator=gen, dtype=dtype)
    return tokens, dout
