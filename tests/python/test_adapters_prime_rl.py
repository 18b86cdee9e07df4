"""megamoe.adapters.prime_rl against plain-PyTorch prime-rl experts modules written here (each storage prime-rl keeps:
w1 / w2 / w3, fused gate_up_proj, separate gate_proj / up_proj with biases, gpt-oss's interleaved transposed experts
with biases and clamped SwiGLU) and prime-rl's per-expert grouped-rows computation, in float64 on the CPU: forward
and every gradient on ragged rows with padding, the weights read in place, refusals and errors naming the argument,
gradients not requested skipped."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megamoe
from adapter_cases import (IDS, ROUTINGS, assert_close, counts_of, gpt_oss_act, grads, grouped_swiglu, randn,
                          record_needs, routing)
from megamoe.adapters import prime_rl


class Silu:
    """prime-rl's Silu activation (a class with a static apply, as its ActivationDispatch holds)."""

    @staticmethod
    def apply(gate, up):
        return F.silu(gate) * up


class Relu2:
    @staticmethod
    def apply(gate, up):
        return F.relu(gate).square() * up


def make_experts(storage, H, I, E, gen):
    """A prime-rl-shaped experts module with random float64 parameters."""
    module = nn.Module()
    module.num_experts = E
    scale = 0.3
    if storage == "w1w2w3":  # GroupedExperts
        module.w1, module.w2, module.w3 = (nn.Parameter(randn(gen, *s, scale=scale)) for s in
                                           ((E, I, H), (E, H, I), (E, I, H)))
    elif storage == "gate_up_proj":  # fused [E, 2I, H], gate rows first
        module.gate_up_proj = nn.Parameter(randn(gen, E, 2 * I, H, scale=scale))
        module.down_proj = nn.Parameter(randn(gen, E, H, I, scale=scale))
        module.activation = Silu
    elif storage == "gate_proj_up_proj_bias":  # separate gate / up with biases
        module.gate_proj = nn.Parameter(randn(gen, E, I, H, scale=scale))
        module.up_proj = nn.Parameter(randn(gen, E, I, H, scale=scale))
        module.down_proj = nn.Parameter(randn(gen, E, H, I, scale=scale))
        module.gate_proj_bias = nn.Parameter(randn(gen, E, I, scale=scale))
        module.up_proj_bias = nn.Parameter(randn(gen, E, I, scale=scale))
        module.down_proj_bias = nn.Parameter(randn(gen, E, H, scale=scale))
        module.activation = Silu()
    elif storage == "gpt_oss":  # GptOssGroupedExperts: [E, H, 2I] interleaved, [E, I, H], biases
        module.gate_up_proj = nn.Parameter(randn(gen, E, H, 2 * I, scale=3.0))  # large: the clamp is exercised
        module.gate_up_proj_bias = nn.Parameter(randn(gen, E, 2 * I, scale=scale))
        module.down_proj = nn.Parameter(randn(gen, E, I, H, scale=scale))
        module.down_proj_bias = nn.Parameter(randn(gen, E, H, scale=scale))
    return module


def prime_rl_reference(experts, x, counts):
    """prime-rl's per-expert computation of each storage in plain PyTorch (padding rows: 0)."""
    if hasattr(experts, "w1"):
        return grouped_swiglu(x, counts, experts.w1, experts.w3, experts.w2)
    if hasattr(experts, "gate_up_proj_bias"):  # x @ gate_up_proj[e] + b, interleaved gate / up, clamped SwiGLU
        w13 = experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H]
        b13 = experts.gate_up_proj_bias
        return grouped_swiglu(x, counts, w13[:, 0::2], w13[:, 1::2], experts.down_proj.transpose(1, 2),
                              b13[:, 0::2], b13[:, 1::2], experts.down_proj_bias, act=gpt_oss_act())
    if hasattr(experts, "gate_up_proj"):
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
        return grouped_swiglu(x, counts, gate, up, experts.down_proj, act=experts.activation.apply)
    return grouped_swiglu(x, counts, experts.gate_proj, experts.up_proj, experts.down_proj, experts.gate_proj_bias,
                          experts.up_proj_bias, experts.down_proj_bias, act=experts.activation.apply)


STORAGES = ["w1w2w3", "gate_up_proj", "gate_proj_up_proj_bias", "gpt_oss"]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("case", ROUTINGS, ids=IDS)
def test_expert_compute_matches_prime_rl(storage, case, gen):
    _, T, H, I, E, topk, kind = case
    experts = make_experts(storage, H, I, E, gen)
    ids, _ = routing(T, E, topk, kind, gen)
    counts = counts_of(ids, E)
    R = int(counts.sum()) + 2  # two padding rows
    x = randn(gen, R, H)
    dout = torch.randn(R, H, generator=gen, dtype=torch.float64)
    leaves = {"x": x, **dict(experts.named_parameters())}
    storage_ptrs = {name: p.data_ptr() for name, p in experts.named_parameters()}
    compute = prime_rl.MegamoeExpertCompute()
    compute.validate(experts)
    ours = grads(lambda: compute(experts, x, counts), leaves, dout)
    theirs = grads(lambda: prime_rl_reference(experts, x, counts), leaves, dout)
    assert_close(ours, theirs)
    assert ours["out"][-2:].abs().max() == 0
    assert {name: p.data_ptr() for name, p in experts.named_parameters()} == storage_ptrs


@pytest.mark.parametrize("storage", ["w1w2w3", "gpt_oss"])
def test_recompute_mode_same_gradients(storage, gen):
    H, I, E = 10, 6, 3
    experts = make_experts(storage, H, I, E, gen)
    counts = torch.tensor([3, 0, 4])
    x = randn(gen, 7, H)
    dout = torch.randn(7, H, generator=gen, dtype=torch.float64)
    leaves = {"x": x, **dict(experts.named_parameters())}
    keep = grads(lambda: prime_rl.expert_compute(experts, x, counts), leaves, dout)
    recompute = grads(lambda: prime_rl.MegamoeExpertCompute(recompute=True)(experts, x, counts), leaves, dout)
    assert_close(recompute, keep, bound=1e-15)


def test_gradients_not_requested_are_skipped(gen, monkeypatch):
    H, I, E = 8, 6, 4
    experts = make_experts("gate_up_proj", H, I, E, gen)
    counts = torch.tensor([2, 0, 3, 1])
    x = torch.randn(6, H, generator=gen, dtype=torch.float64)
    asked = record_needs(monkeypatch, megamoe.grouped.OPS, "backward_op")
    experts.down_proj.requires_grad_(False)
    out = prime_rl.expert_compute(experts, x, counts)  # x without grad, down_proj frozen
    out.backward(torch.ones_like(out))
    assert asked == [{"need_dw13"}]
    assert experts.down_proj.grad is None and experts.gate_up_proj.grad is not None


def test_unsupported_experts_are_refused(gen):
    H, I, E = 8, 6, 4
    compute = prime_rl.MegamoeExpertCompute()
    relu2 = make_experts("gate_up_proj", H, I, E, gen)
    relu2.activation = Relu2
    with pytest.raises(ValueError, match="activation Relu2"):
        compute.validate(relu2)
    no_gate = make_experts("gate_proj_up_proj_bias", H, I, E, gen)
    no_gate.gate_proj = None
    with pytest.raises(ValueError, match="gate_proj is None"):
        compute.validate(no_gate)
    non_gated = make_experts("w1w2w3", H, I, E, gen)
    non_gated.w3 = nn.Parameter(torch.empty(0, dtype=torch.float64))
    with pytest.raises(ValueError, match="w3 empty"):
        compute.validate(non_gated)
    one_bias = make_experts("gate_proj_up_proj_bias", H, I, E, gen)
    one_bias.up_proj_bias = None
    with pytest.raises(ValueError, match="gate_proj_bias"):
        compute.validate(one_bias)
    with pytest.raises(ValueError, match="not a prime-rl experts module"):
        compute.validate(nn.Linear(2, 2))


def test_bad_inputs_name_the_argument(gen):
    H, I, E = 8, 6, 4
    experts = make_experts("w1w2w3", H, I, E, gen)
    x = torch.randn(6, H, dtype=torch.float64)
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        prime_rl.expert_compute(experts, x, torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="num_tokens_per_expert"):
        prime_rl.expert_compute(experts, x, torch.ones(E))
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        prime_rl.expert_compute(experts, x, torch.tensor([4, 4, 0, 0]))  # sums past the 6 rows
    with pytest.raises(ValueError, match="x"):
        prime_rl.expert_compute(experts, x[None], torch.tensor([1, 2, 3, 0]))
