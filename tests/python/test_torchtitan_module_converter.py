"""megamoe.adapters.torchtitan_module_converter against torchtitan 0.2.2 itself (scripts/install_frameworks.sh's
"previous" release; this file runs there in a subprocess started by test_torchtitan_0_2_releases): its Qwen3 MoE and
DeepSeek-V3 debug models (from its train specs, cut to 2 layers, torchtitan's SDPA attention) converted through
torchtitan's own converter container (job config model.converters = ["megamoe"]) against the unconverted model with
the same weights, in float64 on the CPU (framework_cases.float64_shim): the logits, each MoE layer's output and every
gradient agree within 1e-10, on the whole-layer path and the grouped path; the state dict is unchanged; refusals
name the reason. torchtitan 0.2.2 runs on the GPU machine's torch (0.3.0 needs a newer one): its trainer with this
converter is what scripts/gpu_torchtitan.sh measures."""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from framework_cases import float64_shim, load_release, other_releases, run_release

VERSION = load_release("torchtitan", "torchtitan")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import titan_models  # noqa: E402
from titan_data import install_datasets_stand_in  # noqa: E402

install_datasets_stand_in()  # torchtitan 0.2's train specs import its HF dataloaders, which import `datasets`
if importlib.util.find_spec("torchtitan.protocols.model_converter") is not None:
    try:
        import torchtitan.protocols.train_spec  # noqa: F401
    except ImportError as error:
        pytest.skip(f"torchtitan {VERSION} does not import here: {error}", allow_module_level=True)
MODULE_CONVERTERS = importlib.util.find_spec("torchtitan.protocols.model_converter") is not None
needs_module_converters = pytest.mark.skipif(
    not MODULE_CONVERTERS, reason=f"torchtitan {VERSION} converts model configs (0.3: megamoe.adapters."
    "torchtitan_converter, tested by test_torchtitan_converter.py); this file runs with 0.2.2 in a subprocess")
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")
BOUND = 1e-10
MODELS = {"qwen3": "debugmodel_moe", "deepseek_v3": "debugmodel"}  # deepseek_v3's layer 0 is dense


def build(name, layers=2, converters=()):
    """torchtitan 0.2's model of train spec `name` (cut to `layers`), float64, its converters applied."""
    from torchtitan.config import JobConfig
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    import megamoe.adapters.torchtitan_module_converter  # noqa: F401  (registers "megamoe", "megamoe.fp8")

    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args[MODELS.get(name, "debugmodel")])
    args.n_layers = layers
    if getattr(args, "moe_args", None) is not None:  # its grouped-mm path pads rows with a Triton kernel (GPU only)
        args.moe_args.use_grouped_mm = False  # torchtitan's per-expert loop: the same experts, on the CPU
    job_config = JobConfig()
    job_config.model.converters = list(converters)
    args.update_from_config(job_config)  # as torchtitan 0.2's trainer does before building
    model = spec.model_cls(args)
    build_model_converters(job_config, None).convert(model)
    return model


def pair(name, gen, converter="megamoe"):
    theirs, ours = build(name), build(name, converters=[converter])
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    with torch.no_grad():
        theirs.init_weights(buffer_device=None)
        ours.init_weights(buffer_device=None)  # the buffers; the parameters are loaded below
    for module in (theirs, ours):
        module._apply(lambda t: t.to(torch.float64) if t.is_floating_point() else t)
    state = theirs.state_dict()
    for key, value in state.items():
        if ".experts." in key:
            state[key] = torch.randn(value.shape, generator=gen, dtype=torch.float64) * 0.1
    theirs.load_state_dict(state)
    ours.load_state_dict(state)
    return theirs, ours


def run(module, tokens, dout):
    """titan_models.run with each MoE layer's whole output hooked (0.2's MoE modules, as the converter swaps them)."""
    moe = {name: layer.moe for name, layer in module.layers.items() if getattr(layer, "moe_enabled", False)}
    return titan_models.run(module, tokens, dout, hooked=moe)


def inputs(module, gen):
    vocab = module.tok_embeddings.weight.shape[0]
    tokens = torch.randint(0, vocab, (2, 24), generator=gen)
    return tokens, torch.randn(2, 24, vocab, generator=gen, dtype=torch.float64)


def count_calls(monkeypatch, name):
    from megamoe.adapters import torchtitan_module_converter as converter

    calls = []
    original = getattr(converter, name)
    monkeypatch.setattr(converter, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@needs_module_converters
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("path", ["whole_layer", "grouped"])
def test_converted_model_matches_torchtitan(name, path, gen, monkeypatch):
    from adapter_cases import assert_close
    from megamoe.adapters import torchtitan_module_converter as converter

    theirs, ours = pair(name, gen)
    moe_layers = [layer.moe for layer in ours.layers.values() if getattr(layer, "moe_enabled", False)]
    assert moe_layers and all(type(m) is converter.MegamoeMoE for m in moe_layers)
    if path == "grouped":  # what expert parallelism takes: torchtitan's reorder and combine around grouped experts
        monkeypatch.setattr(converter.MegamoeMoE, "_whole_layer", lambda self: False)
    whole, grouped = count_calls(monkeypatch, "moe"), count_calls(monkeypatch, "grouped_moe")
    tokens, dout = inputs(ours, gen)
    got = run(ours, tokens, dout)
    assert (len(whole), len(grouped)) == ((len(moe_layers), 0) if path == "whole_layer" else (0, len(moe_layers)))
    want = run(theirs, tokens, dout)
    assert got.keys() == want.keys()
    assert_close(got, want, BOUND)
    assert all(got[f"layers.{n}.moe.experts.w1"].abs().max() > 0 for n, layer in ours.layers.items()
               if getattr(layer, "moe_enabled", False))


@needs_module_converters
def test_state_dict_unchanged(gen):
    theirs, ours = pair("qwen3", gen)
    mine, original = ours.state_dict(), theirs.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {k: (v.shape, v.dtype) for k, v in original.items()}
    assert all(torch.equal(mine[k], original[k]) for k in original)


@needs_module_converters
def test_refusals_name_the_reason(gen):
    from megamoe.adapters import torchtitan_module_converter as converter

    with pytest.raises(ValueError, match="has no torchtitan MoE layer"):
        build("llama3", converters=["megamoe"])
    with pytest.raises(ValueError, match="megamoe stands in for torchtitan's MoE with its GroupedExperts"):
        build("gpt_oss", converters=["megamoe"])
    model = build("qwen3", layers=1)
    model.layers["0"].moe.experts.w1 = torch.nn.Parameter(torch.zeros(64, 100, 256))
    with pytest.raises(ValueError, match="precision 'fp8' needs the dim and hidden dim multiples of 128"):
        converter.convert_model(model, precision="fp8")
    with pytest.raises(ValueError, match="precision must be"):
        converter.convert_model(model, precision="fp16")


@needs_module_converters
def test_fp8_on_the_cpu_raises_not_a_silent_bf16_run(gen):
    model = build("qwen3", layers=1, converters=["megamoe.fp8"]).to(torch.bfloat16)
    assert model.layers["0"].moe.experts.precision == "fp8"
    with float64_shim(), pytest.raises(NotImplementedError, match="fp8"):  # (the shim: torch.histc of int ids)
        model(torch.randint(0, 2048, (1, 8), generator=gen))


@pytest.mark.parametrize("role, version, status", other_releases("torchtitan"))
def test_torchtitan_0_2_releases(role, version, status):
    """This file against the other installed releases that have model converters by name, each in a subprocess."""
    from framework_cases import FRAMEWORKS

    if MODULE_CONVERTERS:
        pytest.skip("the subprocess of one release runs no other release")
    module_converters = FRAMEWORKS / f"torchtitan-{version}" / "torchtitan" / "protocols" / "model_converter.py"
    if status == "ok" and not module_converters.exists():
        pytest.skip(f"torchtitan {version} ({role}) has no model converters by name (0.2's protocol)")
    run_release("test_torchtitan_module_converter.py", "torchtitan", role, version, status)
