"""megamoe.adapters.torchtitan_converter against torchtitan 0.3.0 itself (installed by scripts/install_frameworks.sh):
its Qwen3 MoE, DeepSeek-V3 and gpt-oss debug models built through torchtitan's model registries with the converter
in the registry's converters list and without it, loaded with one state dict (torchtitan's keys), in float64 on the
CPU (titan_models.py): the logits, every MoE layer's routed-experts output and every parameter's gradient agree
within 1e-10, on megamoe's whole-layer path and on its grouped path (what expert parallelism takes); the same in
bf16 (torchtitan's bf16 experts) within bf16 rounding; the command-line override; the state dict and torchtitan's
Hugging Face conversion unchanged; each refusal's reason; torchtitan's per-block torch.compile(fullgraph=True).
Expert-parallel / FSDP2 / TP layouts on gloo ranks: test_torchtitan_parallel.py; torchtitan's trainer:
test_torchtitan_trainer.py."""

import pytest
import torch

from framework_cases import load_release, other_releases, run_release, FRAMEWORKS

VERSION = load_release("torchtitan", "torchtitan")
from titan_models import (MODELS, build, model_config, moe_layers, random_state, run, skip_unless_importable,  # noqa: E402
                          tokens_and_dout)

try:
    from torchtitan.protocols.model import ModelConfigConverter  # noqa: F401  (0.3: model-config converters)
except ImportError:
    pytest.skip(f"torchtitan {VERSION} has no model-config converter protocol (torchtitan.protocols.model."
                "ModelConfigConverter, from 0.3.0); its converters rewrite built nn.Modules, registered by name",
                allow_module_level=True)
skip_unless_importable(VERSION)

from megamoe.adapters import torchtitan_converter as converter  # noqa: E402 (after torchtitan is on sys.path)
from megamoe.adapters.torchtitan_converter import MegamoeConverter  # noqa: E402

# torchtitan's router asks for an f32 autocast, which CPU autocast does not take (it runs without: float64 here)
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")
BOUND = 1e-10


def converted_pair(model, gen, precision="bf16", layers=None):
    """(torchtitan's model, the converted one) with one random state; and that state."""
    theirs_config = model_config(model, layers=layers)
    ours_config = model_config(model, converters=[MegamoeConverter.Config(precision=precision)], layers=layers)
    state = random_state(build(theirs_config), gen)
    return build(theirs_config, state), build(ours_config, state), state


def assert_agree(ours, theirs, bound=BOUND):
    from adapter_cases import assert_close

    assert ours.keys() == theirs.keys()
    assert_close(ours, theirs, bound)


def count_calls(monkeypatch, name):
    """Count the calls of megamoe.adapters.torchtitan_converter.<name> (moe or grouped_moe)."""
    calls = []
    original = getattr(converter, name)
    monkeypatch.setattr(converter, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("model", list(MODELS))
def test_converted_model_matches_torchtitan(model, gen, monkeypatch):
    """Without expert parallelism: one megamoe.moe call per MoE layer replaces torchtitan's dispatch, experts and
    combine; the logits, each MoE layer's output and every gradient agree in float64."""
    theirs, ours, _ = converted_pair(model, gen)
    layers = moe_layers(ours)
    assert layers and all(type(e).__name__ == "MegamoeRoutedExperts" for e in layers.values())
    tokens, dout = tokens_and_dout(ours.config, gen)
    whole_layer, grouped = count_calls(monkeypatch, "moe"), count_calls(monkeypatch, "grouped_moe")
    ours_result = run(ours, tokens, dout)
    assert len(whole_layer) == len(layers) and not grouped
    theirs_result = run(theirs, tokens, dout)
    assert_agree(ours_result, theirs_result)
    for name, experts in layers.items():  # the experts' gradients are not all zero (the MoE layers are exercised)
        for param_name, _ in experts.named_parameters():
            assert ours_result[f"layers.{name}.moe.routed_experts.{param_name}"].abs().max() > 0


@pytest.mark.parametrize("model", ["qwen3", "gpt_oss"])
def test_grouped_path_matches_torchtitan(model, gen, monkeypatch):
    """The path an expert-parallel dispatcher takes (torchtitan's dispatch and combine around megamoe's grouped
    experts), forced here on one process: the same agreement."""
    theirs, ours, _ = converted_pair(model, gen)
    monkeypatch.setattr(converter, "_dispatches_locally", lambda dispatcher: False)
    tokens, dout = tokens_and_dout(ours.config, gen)
    grouped = count_calls(monkeypatch, "grouped_moe")
    ours_result = run(ours, tokens, dout)
    assert len(grouped) == len(moe_layers(ours))
    assert_agree(ours_result, run(theirs, tokens, dout))


def test_bf16_model_within_bf16_rounding(gen):
    """In bf16 (torchtitan's experts cast to bf16; so does megamoe), one MoE layer (past it a rounding difference
    may flip a later router's top-k, which no tolerance bounds): the converted model's MoE output and logits are
    within bf16 rounding of torchtitan's (relative 1e-2, about 2.5 bf16 units; megamoe's combine rounds once, in
    f32, torchtitan's rounds each scaled row to bf16 before adding them)."""
    theirs, ours, _ = converted_pair("qwen3", gen, layers=1)
    theirs, ours = (module.to(torch.bfloat16) for module in (theirs, ours))
    tokens, dout = tokens_and_dout(ours.config, gen, dtype=torch.bfloat16)
    got, want = run(ours, tokens, dout), run(theirs, tokens, dout)
    for name in ("out", "moe.0"):
        error = ((got[name].double() - want[name].double()).norm() / want[name].double().norm()).item()
        assert error < 1e-2, f"{name}: relative error {error:.3e}"


def test_state_dict_and_hf_conversion_unchanged(gen):
    """The converted model's state dict has torchtitan's keys, shapes and dtypes; each model loads the other's
    (strict); torchtitan's Hugging Face state-dict adapter maps both alike."""
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    theirs, ours, state = converted_pair("qwen3", gen)
    mine, original = ours.state_dict(), theirs.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {k: (v.shape, v.dtype) for k, v in original.items()}
    assert all(torch.equal(mine[k], original[k]) for k in original)
    build(model_config("qwen3"), dict(mine))
    adapter = Qwen3StateDictAdapter(ours.config, None)
    hf_mine, hf_original = adapter.to_hf(dict(mine)), adapter.to_hf(dict(original))
    assert hf_mine.keys() == hf_original.keys() and all(torch.equal(hf_mine[k], hf_original[k]) for k in hf_mine)


def test_command_line_override_converts_like_the_converter():
    """--override.imports megamoe.adapters.torchtitan_converter.megamoe_experts (and _fp8, and the kwargs form) as
    torchtitan's trainer applies overrides: every RoutedExperts.Config replaced, torchtitan's fields kept."""
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports

    for tokens, precision in ([["megamoe.adapters.torchtitan_converter.megamoe_experts"], "bf16"],
                              [["megamoe.adapters.torchtitan_converter.megamoe_experts_fp8"], "fp8"],
                              [['megamoe.adapters.torchtitan_converter.megamoe_experts={"precision": "fp8"}'], "fp8"]):
        config = model_config("qwen3", layers=3)
        replaced = apply_overrides(OverrideConfig(imports=parse_cli_imports(tokens)), config)
        assert len(replaced) == 3
        for layer in config.layers:
            routed = layer.moe.routed_experts
            assert type(routed) is converter.MegamoeRoutedExperts.Config
            assert type(routed.inner_experts) is converter.MegamoeGroupedExperts.Config
            assert routed.inner_experts.precision == precision and routed.inner_experts.dim == 256


def test_converter_keeps_torchtitan_fields():
    """Initialisation, dimensions, sharding and the token dispatcher carry over; converting twice takes the new
    options."""
    config = model_config("deepseek_v3")
    theirs = config.layers[1].moe.routed_experts
    converter.convert_model_config(config, recompute=True)
    ours = config.layers[1].moe.routed_experts
    inner = ours.inner_experts
    assert type(ours) is converter.MegamoeRoutedExperts.Config and inner.recompute and inner.precision == "bf16"
    for name in ("param_init", "sharding_config", "dim", "hidden_dim", "num_experts"):
        assert getattr(inner, name) is getattr(theirs.inner_experts, name), name
    assert ours.token_dispatcher is theirs.token_dispatcher and ours.sharding_config is theirs.sharding_config
    again = converter.megamoe_routed_experts_config(ours, precision="fp8")
    assert again.inner_experts.precision == "fp8" and not again.inner_experts.recompute


def test_refusals_name_the_reason():
    from torchtitan.models.llama3 import model_registry as llama3_registry
    from torchtitan.overrides.fused_swiglu import fused_grouped_experts

    with pytest.raises(ValueError, match="has no routed experts"):
        llama3_registry("debugmodel", converters=[MegamoeConverter.Config()])
    with pytest.raises(ValueError, match="precision must be one of"):
        MegamoeConverter.Config(precision="fp16").build()
    with pytest.raises(ValueError, match="gpt-oss experts: precision 'fp8'"):
        model_config("gpt_oss", converters=[MegamoeConverter.Config(precision="fp8")])
    config = model_config("qwen3", layers=1)
    config.layers[0].moe.routed_experts.inner_experts.hidden_dim = 100
    with pytest.raises(ValueError, match=r"layers.0.moe.routed_experts precision 'fp8' needs hidden_dim a multiple"):
        converter.convert_model_config(config, precision="fp8")
    config = model_config("qwen3", layers=1)
    routed = config.layers[0].moe.routed_experts
    routed.inner_experts = fused_grouped_experts(routed.inner_experts)
    with pytest.raises(ValueError, match="inner_experts is a FusedGroupedExperts.Config"):
        converter.convert_model_config(config)


def test_fp8_on_the_cpu_raises_not_a_silent_bf16_run(gen):
    """precision="fp8" converts; its forward needs a Hopper GPU: on the CPU megamoe raises NotImplementedError."""
    config = model_config("qwen3", converters=[MegamoeConverter.Config(precision="fp8")], layers=1)
    assert config.layers[0].moe.routed_experts.inner_experts.precision == "fp8"
    module = build(config, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="fp8"):
        module(torch.randint(0, config.vocab_size, (1, 8), generator=gen))


@pytest.mark.parametrize("model", ["qwen3", "gpt_oss"])
def test_torchtitan_block_compile(model, gen):
    """Each transformer block compiled as torchtitan compiles it (block.compile(fullgraph=True); aot_eager on the
    CPU): no graph break in megamoe's experts, the eager results."""
    theirs, ours, _ = converted_pair(model, gen)
    tokens, dout = tokens_and_dout(ours.config, gen)
    eager = run(ours, tokens, dout)
    for block in ours.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    assert_agree(run(ours, tokens, dout), eager)


@pytest.mark.parametrize("role, version, status", other_releases("torchtitan"))
def test_other_torchtitan_releases(role, version, status):
    """This file against the other installed releases, each in a subprocess, where the release has torchtitan's
    model-config converters (0.3 and later)."""
    protocol = FRAMEWORKS / f"torchtitan-{version}" / "torchtitan" / "protocols" / "model.py"
    if status == "ok" and (not protocol.exists() or "ModelConfigConverter" not in protocol.read_text()):
        pytest.skip(f"torchtitan {version} ({role}) has no model-config converter protocol "
                    "(torchtitan.protocols.model.ModelConfigConverter, from 0.3.0): nothing to convert with")
    run_release("test_torchtitan_converter.py", "torchtitan", role, version, status)
