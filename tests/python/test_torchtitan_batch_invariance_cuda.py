"""Trainer / sampler parity on a GPU: with megamoe's torchtitan converter, torchtitan's Qwen3 MoE model gives bitwise
the same routed-experts outputs for a sequence run alone (a sampler's batch) and packed with other sequences (the
trainer's batch: in one row between others, and as one row of a batch), in bf16 and in FP8. An RL loop whose
generator runs torchtitan's model code (torchtitan's experiments/rl) then computes the same MoE outputs on both
sides; the generator itself (vLLM) is not run here.

The routed experts are given the router's outputs for the packed batch (the same scores and ids for the sequence's
tokens in both runs): the router's gate and the shared experts are torchtitan's Linear layers, whose cuBLAS matmuls
are batch invariant only under torchtitan's batch-invariant mode (the batch_invariant_ops package); where that
package is installed the whole MoE layer is checked too, else that check skips, saying so.

torchtitan 0.3 (megamoe.adapters.torchtitan_converter) or 0.2 (megamoe.adapters.torchtitan_module_converter),
whichever is importable (scripts/gpu_torchtitan.sh installs the release its torch runs). Skips without a GPU or
torchtitan."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")
if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not importable here (scripts/gpu_torchtitan.sh installs it on the GPU machine; "
                "scripts/install_frameworks.sh into .frameworks/ for the CPU tests)", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from titan_data import install_datasets_stand_in  # noqa: E402

install_datasets_stand_in()
CONFIG_CONVERTERS = importlib.util.find_spec("torchtitan.protocols.model_converter") is None  # 0.3
LENGTHS = (37, 200, 91)  # the sequence (the middle one) and its neighbours when packed
LAYERS = 2


def build(precision):
    """torchtitan's Qwen3 MoE debug model (2 layers) with megamoe's converter, bf16 on the GPU, seeded."""
    torch.manual_seed(0)
    if CONFIG_CONVERTERS:
        from megamoe.adapters.torchtitan_converter import MegamoeConverter
        from torchtitan.models.qwen3 import model_registry

        config = model_registry("debugmodel_moe", converters=[MegamoeConverter.Config(precision=precision)]).model
        config.layers = config.layers[:LAYERS]
        with torch.device("cuda"), torch.no_grad():
            model = config.build()
            model.init_weights(buffer_device=None)
    else:
        import copy

        from megamoe.adapters.torchtitan_module_converter import convert_model
        from torchtitan.protocols.train_spec import get_train_spec

        spec = get_train_spec("qwen3")
        args = copy.deepcopy(spec.model_args["debugmodel_moe"])
        args.n_layers = LAYERS
        with torch.device("cuda"), torch.no_grad():
            model = spec.model_cls(args)
            model.init_weights(buffer_device=torch.device("cuda"))
        convert_model(model, precision=precision)
    return model.to(torch.bfloat16).eval()


def routed(moe, x_BLD):
    """(the router's scores and ids [B, L, K], the routed experts' output [B, L, D]) of the layer on x."""
    if CONFIG_CONVERTERS:
        scores, ids, _ = moe.router(x_BLD, moe.expert_bias_E)
        counts = torch.bincount(ids.reshape(-1), minlength=moe.routed_experts.inner_experts.num_experts)
        return scores, ids, lambda x, s, i: moe.routed_experts(x, s, i, counts)
    B, L, D = x_BLD.shape
    scores, ids, _ = moe.router(x_BLD.reshape(-1, D), moe.expert_bias)
    K = ids.shape[-1]
    return scores.view(B, L, K), ids.view(B, L, K), lambda x, s, i: moe.experts.routed(
        x.reshape(-1, D), s.reshape(-1, K), i.reshape(-1, K)).view(x.shape)


def packings(gen, dim):
    """The sequence alone [1, L, D], and its rows inside two packed batches: one row of three sequences, and the
    middle row of a [3, L, D] batch."""
    sequences = [torch.randn(n, dim, generator=gen).cuda().bfloat16() for n in LENGTHS]
    alone = sequences[1][None]
    start = LENGTHS[0]
    one_row = torch.cat(sequences)[None]
    longest = max(LENGTHS)
    rows = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, longest - s.shape[0])) for s in sequences])
    return alone, [("one packed row", one_row, (0, slice(start, start + LENGTHS[1]))),
                   ("one row of a batch", rows, (1, slice(0, LENGTHS[1])))]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_routed_experts_are_batch_invariant(precision):
    if precision == "fp8" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("megamoe's FP8 layer runs on compute capability 9.0 (Hopper)")
    model = build(precision)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.layers.values():
            moe = layer.moe
            alone, packed = packings(gen, model.norm.weight.shape[0])
            for what, batch, (row, columns) in packed:
                scores, ids, call = routed(moe, batch)
                want = call(batch, scores, ids)[row, columns]
                got = call(alone, scores[row, columns][None], ids[row, columns][None])[0]
                assert torch.equal(got, want), (f"{precision}: the routed experts' output of a sequence alone differs "
                                                f"from its rows in {what} (max {(got - want).abs().max():.3e})")


def test_whole_moe_layer_under_torchtitan_batch_invariant_mode():
    if importlib.util.find_spec("batch_invariant_ops") is None:
        pytest.skip("torchtitan's batch-invariant mode needs the batch_invariant_ops package (not installed here): "
                    "its router gate and shared experts are cuBLAS matmuls, batch invariant only in that mode")
    from torchtitan.distributed.utils import set_batch_invariance

    set_batch_invariance(True)
    model = build("bf16")
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        moe = model.layers["0"].moe
        alone, packed = packings(gen, model.norm.weight.shape[0])
        for what, batch, (row, columns) in packed:
            assert torch.equal(moe(alone)[0], moe(batch)[row, columns]), f"the MoE layer's output differs in {what}"
