"""megamoe.adapters.megatron against Megatron-core's own MoE layer, installed from PyPI by
scripts/install_frameworks.sh: the pinned 0.16.1 in this process, the newest release in a subprocess
(test_other_megatron_releases). Megatron's MoELayer with its allgather token dispatcher and its SequentialMLP experts
(local per-expert MLPs: fc1 [2I, H], fc2 [H, I]; the CPU path, no Transformer Engine) is built from its own spec and
loaded with random weights through its own state-dict keys; a copy loaded with the same state dict has its experts'
forward replaced by megamoe.adapters.megatron.te_grouped_mlp on those per-expert weights (stacked per call, or packed
once by pack_expert_parameters and read in place). In float64 on the CPU with ragged routing (empty experts, one expert
taking all), y and every gradient (x, the routing probs, each expert weight) agree within 1e-10. The routing is given
to both layers (MoELayer.route replaced): Megatron's router moves its weight to CUDA, and it is not what megamoe
replaces."""

import types

import pytest
import torch
import torch.nn.functional as F

from adapter_cases import IDS, ROUTINGS, routing
from framework_cases import assert_modules_agree, load_release, module_grads, other_releases, run_release

VERSION = load_release("megatron-core", "megatron.core")
import megamoe  # noqa: E402 (after Megatron's release is on sys.path)
from megamoe.adapters import megatron as adapter  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),  # Megatron: "Transformer Engine ... not installed"
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # Megatron: "tp_group is None ..."


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    """Megatron's parallel state on one gloo process (tensor, pipeline and expert parallel sizes 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    init_file = tmp_path_factory.mktemp("megatron") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def build_moe_layer(H, I, E, K, activation):
    """Megatron's MoELayer (allgather dispatcher, SequentialMLP of local MLPs, no biases) in float64 on the CPU."""
    from megatron.core.activations import quick_gelu
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    gpt_oss = dict(activation_func=quick_gelu, activation_func_clamp_value=7.0, glu_linear_offset=1.0)
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=1, ffn_hidden_size=I, moe_ffn_hidden_size=I,
        num_moe_experts=E, moe_router_topk=K, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_aux_loss_coeff=0.0, moe_router_pre_softmax=K == 1, gated_linear_unit=True, add_bias_linear=False, bias_activation_fusion=False,
        params_dtype=torch.float64, use_cpu_initialization=True,
        **(gpt_oss if activation == "gpt_oss" else dict(activation_func=F.silu)))
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    # 0.16 returns a ModuleSpec, later releases a builder (functools.partial of MoELayer)
    layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    assert type(layer.experts).__name__ == "SequentialMLP" and "AllGather" in type(layer.token_dispatcher).__name__
    return layer


def megamoe_experts(activation, packed):
    """A forward for Megatron's SequentialMLP on megamoe: te_grouped_mlp on its experts' own weights."""
    act = megamoe.clamped_swiglu(7.0, 1.702) if activation == "gpt_oss" else None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]  # E x [2I, H]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]  # E x [H, I]
        return adapter.te_grouped_mlp(permuted_local_hidden_states, tokens_per_expert, permuted_probs, fc1, fc2,
                                      activation=act)

    return forward


@pytest.mark.parametrize("case", ROUTINGS, ids=IDS)
@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("packed", [False, True], ids=["lists", "packed"])
def test_moe_layer_with_megamoe_experts_matches_megatron(case, activation, packed, model_parallel, gen):
    _, T, H, I, E, topk, kind = case
    theirs, ours = build_moe_layer(H, I, E, topk, activation), build_moe_layer(H, I, E, topk, activation)
    state = {}
    for key, value in theirs.state_dict().items():
        if value is not None:
            scale = 2.0 if activation == "gpt_oss" and "linear_fc1" in key else 0.3  # gpt-oss: the clamps engage
            state[key] = torch.randn(value.shape, generator=gen, dtype=torch.float64) * scale
    theirs.load_state_dict(state)
    ours.load_state_dict(state)  # Megatron's keys: experts.local_experts.{e}.linear_fc1.weight ...
    ours.experts.forward = types.MethodType(megamoe_experts(activation, packed), ours.experts)
    if packed:  # one [E, ...] buffer per list, read in place
        experts = ours.experts.local_experts
        adapter.pack_expert_parameters([[e.linear_fc1.weight for e in experts], [e.linear_fc2.weight for e in experts]])

    ids, weights = routing(T, E, topk, kind, gen)
    probs = torch.zeros(T, E, dtype=torch.float64).scatter(1, ids, weights).requires_grad_()  # [T, E]
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, ids, True)  # [T, E]
    B = 3 if T % 3 == 0 else 1
    x = torch.randn(T // B, B, H, generator=gen, dtype=torch.float64)  # Megatron's [S, B, H]
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    results = []
    for layer in (theirs, ours):
        layer.route = lambda hidden_states, padding_mask=None: (probs, routing_map)
        leaf = x.clone().requires_grad_()
        results.append(module_grads(layer, lambda: layer(leaf), {"x": leaf, "probs": probs}, dy))
    assert results[0]["out"].shape == x.shape
    assert_modules_agree(results[1], results[0], unused=("router.weight",))


@pytest.mark.parametrize("role, version, status", other_releases("megatron-core"))
def test_other_megatron_releases(role, version, status):
    """This file's tests against the newest megatron-core release, in a subprocess."""
    run_release("test_frameworks_megatron.py", "megatron-core", role, version, status)
