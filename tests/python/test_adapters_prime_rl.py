"""megamoe.adapters.prime_rl against plain-PyTorch prime-rl experts modules written here from prime-rl's source (the
files and commits the adapter's docstring cites; prime-rl is not on PyPI): every storage prime-rl keeps (w1 / w2 / w3;
separate gate_proj / up_proj and prime-rl's fused gate_up_proj, each with no, all, or one of its split biases;
gpt-oss's interleaved transposed experts with biases and clamped SwiGLU) against prime-rl's grouped-rows computation
(GroupedGemmExpertCompute: each bias that is set added), in float64 on the CPU: forward and every gradient on ragged
rows with padding, the weights read in place, refusals naming the attribute (no parameter silently unread), errors
naming the argument, gradients not requested skipped."""

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


ALL_BIASES = ("gate_proj_bias", "up_proj_bias", "down_proj_bias")
# storage -> (weights, the biases set): "split" gate_proj / up_proj, "fused" gate_up_proj [E, 2I, H] (prime-rl's
# fuse_gate_up_projections leaves the biases split), "w1w2w3" GroupedExperts, "gpt_oss" GptOssGroupedExperts.
STORAGES = {
    "w1w2w3": ("w1w2w3", ()),
    "gate_proj_up_proj": ("split", ()),
    "gate_proj_up_proj_bias": ("split", ALL_BIASES),
    "gate_up_proj": ("fused", ()),
    "gate_up_proj_bias": ("fused", ALL_BIASES),
    "gpt_oss": ("gpt_oss", ()),
}


def make_experts(storage, H, I, E, gen, biases=None):
    """A prime-rl-shaped experts module with random float64 parameters; `biases` overrides the storage's."""
    weights, default_biases = STORAGES[storage]
    module = nn.Module()
    module.num_experts = E
    scale = 0.3
    if weights == "w1w2w3":  # GroupedExperts
        module.w1, module.w2, module.w3 = (nn.Parameter(randn(gen, *s, scale=scale)) for s in
                                           ((E, I, H), (E, H, I), (E, I, H)))
        return module
    if weights == "gpt_oss":  # GptOssGroupedExperts: [E, H, 2I] interleaved, [E, I, H], biases
        module.gate_up_proj = nn.Parameter(randn(gen, E, H, 2 * I, scale=3.0))  # large: the clamp is exercised
        module.gate_up_proj_bias = nn.Parameter(randn(gen, E, 2 * I, scale=scale))
        module.down_proj = nn.Parameter(randn(gen, E, I, H, scale=scale))
        module.down_proj_bias = nn.Parameter(randn(gen, E, H, scale=scale))
        return module
    if weights == "split":
        module.gate_proj = nn.Parameter(randn(gen, E, I, H, scale=scale))
        module.up_proj = nn.Parameter(randn(gen, E, I, H, scale=scale))
        module.gate_up_proj = None  # as prime-rl's GroupedExperts registers it before any fusion
    else:  # fused, gate rows first
        module.gate_up_proj = nn.Parameter(randn(gen, E, 2 * I, H, scale=scale))
        module.gate_proj = module.up_proj = None  # as fuse_gate_up_projections leaves them
    module.down_proj = nn.Parameter(randn(gen, E, H, I, scale=scale))
    for name in ALL_BIASES:
        size = H if name == "down_proj_bias" else I
        wanted = name in (default_biases if biases is None else biases)
        setattr(module, name, nn.Parameter(randn(gen, E, size, scale=scale)) if wanted else None)
    module.activation = Silu
    return module


def prime_rl_reference(experts, x, counts):
    """prime-rl's per-expert computation of each storage in plain PyTorch (padding rows: 0)."""
    if getattr(experts, "w1", None) is not None:
        return grouped_swiglu(x, counts, experts.w1, experts.w3, experts.w2)
    if getattr(experts, "gate_up_proj_bias", None) is not None:  # x @ gate_up_proj[e] + b, interleaved, clamped
        w13 = experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H]
        b13 = experts.gate_up_proj_bias
        return grouped_swiglu(x, counts, w13[:, 0::2], w13[:, 1::2], experts.down_proj.transpose(1, 2),
                              b13[:, 0::2], b13[:, 1::2], experts.down_proj_bias, act=gpt_oss_act())
    if experts.gate_up_proj is not None:  # GroupedGemmExpertCompute: gate_up.chunk(2) of the fused projection
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
    else:
        gate, up = experts.gate_proj, experts.up_proj
    return grouped_swiglu(x, counts, gate, up, experts.down_proj, experts.gate_proj_bias, experts.up_proj_bias,
                          experts.down_proj_bias, act=experts.activation.apply)


def check_against_prime_rl(experts, case, gen):
    """megamoe's compute of `experts` against prime_rl_reference: y and every gradient (x, each parameter: none may
    come back None), padding rows 0, the parameters read in place."""
    _, T, H, I, E, topk, kind = case
    ids, _ = routing(T, E, topk, kind, gen)
    counts = counts_of(ids, E)
    R = int(counts.sum()) + 2  # two padding rows
    x = randn(gen, R, H)
    dout = torch.randn(R, H, generator=gen, dtype=torch.float64)
    leaves = {"x": x, **dict(experts.named_parameters())}
    storage_ptrs = {name: p.data_ptr() for name, p in experts.named_parameters()}
    compute = prime_rl.MegamoeExpertCompute()
    compute.validate(experts)
    assert prime_rl.unsupported_reason(experts) is None
    ours = grads(lambda: compute(experts, x, counts), leaves, dout)
    theirs = grads(lambda: prime_rl_reference(experts, x, counts), leaves, dout)
    assert_close(ours, theirs)
    assert ours["out"][-2:].abs().max() == 0
    assert {name: p.data_ptr() for name, p in experts.named_parameters()} == storage_ptrs


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("case", ROUTINGS, ids=IDS)
def test_expert_compute_matches_prime_rl(storage, case, gen):
    check_against_prime_rl(make_experts(storage, *case[2:5], gen), case, gen)


@pytest.mark.parametrize("weights", ["gate_proj_up_proj", "gate_up_proj"])
@pytest.mark.parametrize("biases", [("gate_proj_bias",), ("up_proj_bias",), ("down_proj_bias",),
                                    ("gate_proj_bias", "up_proj_bias")], ids=lambda b: "+".join(b))
def test_any_subset_of_the_split_biases(weights, biases, gen):
    """prime-rl adds each bias that is set: one of the [E, I] pair alone is computed (zeros for the other)."""
    case = ROUTINGS[0]
    check_against_prime_rl(make_experts(weights, *case[2:5], gen, biases=biases), case, gen)


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


class LowRankDelta(nn.Module):
    """A LoRA-style parametrization: weight + B @ A per expert, with its own parameters."""

    def __init__(self, E, rows, cols, gen):
        super().__init__()
        self.A, self.B = nn.Parameter(randn(gen, E, 2, cols)), nn.Parameter(randn(gen, E, rows, 2, scale=0.1))

    def forward(self, weight):
        return weight + self.B @ self.A


def test_parametrized_weights_are_read_through_their_attribute(gen):
    """A torch parametrization (here a LoRA-style delta on gate_up_proj) is read through the attribute: its
    parameters (parametrizations.gate_up_proj.*) get their gradients, none refused as unread."""
    case = ROUTINGS[0]
    H, I, E = case[2:5]
    experts = make_experts("gate_up_proj_bias", H, I, E, gen)
    torch.nn.utils.parametrize.register_parametrization(experts, "gate_up_proj", LowRankDelta(E, 2 * I, H, gen))
    check_against_prime_rl(experts, case, gen)


def refused(experts, match):
    """validate, a call and unsupported_reason all refuse `experts`, naming `match`."""
    with pytest.raises(ValueError, match=match):
        prime_rl.MegamoeExpertCompute().validate(experts)
    x = torch.zeros(2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        prime_rl.expert_compute(experts, x, torch.tensor([2, 0, 0, 0]))
    assert prime_rl.unsupported_reason(experts) is not None


def test_unsupported_experts_are_refused(gen):
    H, I, E = 8, 6, 4
    relu2 = make_experts("gate_up_proj", H, I, E, gen)
    relu2.activation = Relu2
    refused(relu2, "activation Relu2")
    relu2_w1 = make_experts("w1w2w3", H, I, E, gen)
    relu2_w1.activation = Relu2
    refused(relu2_w1, "activation Relu2")
    no_gate = make_experts("gate_proj_up_proj_bias", H, I, E, gen)  # prime-rl's non_gated GroupedExperts
    no_gate.gate_proj = no_gate.gate_proj_bias = None
    refused(no_gate, "gate_proj is None")
    non_gated = make_experts("w1w2w3", H, I, E, gen)
    non_gated.w3 = nn.Parameter(torch.empty(0, dtype=torch.float64))
    refused(non_gated, "w3 empty")
    refused(nn.Linear(2, 2), "not a prime-rl experts module")


@pytest.mark.parametrize("storage, attribute, value_shape", [
    ("gate_up_proj", "gate_proj", (4, 6, 8)),  # both storages of gate / up
    ("gate_up_proj_bias", "up_proj", (4, 6, 8)),
    ("w1w2w3", "down_proj_bias", (4, 8)),  # biases beside w1 / w2 / w3
    ("w1w2w3", "gate_proj_bias", (4, 6)),
    ("w1w2w3", "gate_up_proj", (4, 12, 8)),
    ("gpt_oss", "gate_proj_bias", (4, 6)),
    ("gpt_oss", "activation", None),
    ("gate_up_proj", "gate_up_proj_bias", (4, 12)),  # a fused bias outside gpt-oss's storage
    ("gate_proj_up_proj", "gate_up_proj_bias", (4, 12)),
    ("gate_up_proj_bias", "lora_A", (4, 2, 8)),  # any other parameter
])
def test_storages_that_would_leave_a_parameter_unread_are_refused(storage, attribute, value_shape, gen):
    experts = make_experts(storage, 8, 6, 4, gen)
    setattr(experts, attribute, Silu if value_shape is None else nn.Parameter(randn(gen, *value_shape)))
    refused(experts, attribute)


def test_a_submodule_parameter_is_refused(gen):
    experts = make_experts("gate_proj_up_proj_bias", 8, 6, 4, gen)
    experts.adapter = nn.Linear(8, 8, dtype=torch.float64)
    refused(experts, r"adapter\.weight")


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
