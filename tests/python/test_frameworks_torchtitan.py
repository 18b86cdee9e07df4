"""megamoe.adapters.torchtitan against torchtitan's own modules, installed from PyPI by scripts/install_frameworks.sh:
the pinned 0.3.0 in this process, 0.2.2 and the newest release each in a subprocess (test_other_torchtitan_releases).
torchtitan's MoE layer (its router, token dispatcher, combine and shared experts) is built from its own configs and
loaded with random weights through its own state-dict keys; a copy with megamoe's drop-in (RoutedExperts as
routed_experts, or GroupedExperts as inner_experts / 0.2's experts) is loaded with the same state dict. In float64 on
the CPU (framework_cases.float64_shim keeps torchtitan's own bf16 / f32 casts from rounding) with ragged routing
(two experts never chosen, through torchtitan's expert bias), y and every gradient agree within 1e-10."""

import importlib.util
import re

import pytest
import torch

from adapter_cases import ROUTINGS, IDS, counts_of, routing
from framework_cases import (assert_modules_agree, float64_shim, load_release, module_grads, other_releases,
                             run_release)

VERSION = load_release("torchtitan", "torchtitan")
from megamoe.adapters import torchtitan as adapter  # noqa: E402 (after torchtitan's release is on sys.path)

COMMON_MOE = importlib.util.find_spec("torchtitan.models.common") is not None  # 0.3: RoutedExperts
needs_common = pytest.mark.skipif(not COMMON_MOE, reason=f"torchtitan {VERSION} has no RoutedExperts (0.2 layout; "
                                                          "the 0.3 tests run with the pinned 0.3.0)")
needs_legacy = pytest.mark.skipif(COMMON_MOE, reason=f"torchtitan {VERSION} has no MoE.experts (the 0.2 layout's test "
                                                     "runs in test_other_torchtitan_releases[previous])")
# torchtitan's router asks for an f32 autocast, which CPU autocast does not take (it runs without: float64 here)
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")
NEVER_CHOSEN = 2  # the last experts, kept out of every token's top-k by a large negative expert bias


def torchtitan_name(name):
    """megamoe's parameter name for torchtitan's (w1_EFD -> w1, ...)."""
    return re.sub(r"_(EFD|EDF)$", "", name)


def random_state(module, gen):
    """Random float64 values for every entry of the module's state dict (torchtitan's keys); the expert bias keeps
    the last NEVER_CHOSEN experts out of the top-k, so those experts get no token."""
    state = {}
    for key, value in module.state_dict().items():
        state[key] = torch.randn(value.shape, generator=gen, dtype=torch.float64) * 0.3
        if key.endswith("expert_bias_E") or key.endswith("expert_bias"):
            state[key][-NEVER_CHOSEN:] = -10.0  # scores are in (0, 1)
    return state


def build_common_moe(H, I, E, K, score_func, route_norm):
    """torchtitan 0.3's MoE (router, RoutedExperts with its LocalTokenDispatcher, shared experts) in float64."""
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import MoE, RoutedExperts, GroupedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    def linear(i, o):
        return Linear.Config(in_features=i, out_features=o)

    config = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=linear(H, E), top_k=K, score_func=score_func,
                                            route_norm=route_norm),
        shared_experts=FeedForward.Config(w1=linear(H, I), w2=linear(I, H), w3=linear(H, I)))
    return config.build().to(torch.float64)


def build_legacy_moe(H, I, E, K, score_func, score_before_experts):
    """torchtitan 0.2's MoE (router, reorderer, GroupedExperts in MoE.experts, shared experts) in float64."""
    from torchtitan.models.moe.moe import MoE, MoEArgs

    args = MoEArgs(num_experts=E, top_k=K, score_func=score_func, route_norm=K > 1,
                   score_before_experts=score_before_experts, use_grouped_mm=False)
    return MoE(args, dim=H, hidden_dim=I).to(torch.float64)


def check_drop_in(theirs, ours, gen, B, L):
    """`ours` (a copy of `theirs` with megamoe's drop-in) loaded with `theirs`'s state dict: y [B, L, H] and every
    gradient (x, each parameter) of both agree, in float64."""
    state = random_state(theirs, gen)
    theirs.load_state_dict(state)
    ours.load_state_dict(state)  # torchtitan's keys (w1_EFD ...) into megamoe's experts
    H = state[next(k for k in state if "shared_experts.w1" in k)].shape[1]
    x = torch.randn(B, L, H, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, L, H, generator=gen, dtype=torch.float64)
    results = []
    for module in (theirs, ours):
        leaf = x.clone().requires_grad_()
        with float64_shim():
            results.append(module_grads(module, lambda: module(leaf), {"x": leaf}, dy, rename=torchtitan_name))
    assert results[0]["out"].shape == (B, L, H)
    assert_modules_agree(results[1], results[0])
    return results


@needs_common
@pytest.mark.parametrize("drop_in", ["routed_experts", "inner_experts"])
@pytest.mark.parametrize("B, L, K, score_func, route_norm", [(2, 5, 2, "softmax", False), (3, 4, 1, "sigmoid", False),
                                                              (1, 1, 3, "sigmoid", True)],
                         ids=["B2_L5_top2", "B3_L4_top1_sigmoid", "B1_L1_top3_sigmoid_norm"])
def test_moe_with_megamoe_matches_torchtitan(drop_in, B, L, K, score_func, route_norm, gen):
    """(route_norm with top-1 would make the scores' gradient 0: the router's weight gradient only rounding noise.)"""
    H, I, E = 16, 12, 7
    theirs, ours = (build_common_moe(H, I, E, K, score_func, route_norm) for _ in range(2))
    if drop_in == "routed_experts":  # dispatch, experts and combine: one megamoe call on torchtitan's [B, L, .]
        ours.routed_experts = adapter.RoutedExperts(H, I, E, dtype=torch.float64)
    else:  # torchtitan's dispatcher and combine around megamoe's grouped experts
        ours.routed_experts.inner_experts = adapter.GroupedExperts(H, I, E, dtype=torch.float64)
    results = check_drop_in(theirs, ours, gen, B, L)
    for name in ("w1", "w2", "w3"):  # the never-chosen experts get exact zeros, the others not
        grad = results[1][f"routed_experts.inner_experts.{name}"]
        assert grad[-NEVER_CHOSEN:].abs().max() == 0 and grad[:-NEVER_CHOSEN].abs().max() > 0


@needs_common
@pytest.mark.parametrize("case", ROUTINGS, ids=IDS)
def test_grouped_experts_match_torchtitan(case, gen):
    """The inner-experts call on dispatched rows grouped by expert (ragged counts, empty experts)."""
    from torchtitan.models.common.moe import GroupedExperts

    _, T, H, I, E, topk, kind = case
    theirs = GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E).build().to(torch.float64)
    ours = adapter.GroupedExperts(H, I, E, dtype=torch.float64)
    state = random_state(theirs, gen)
    theirs.load_state_dict(state)
    ours.load_state_dict(state)
    ids, _ = routing(T, E, topk, kind, gen)
    counts = counts_of(ids, E)
    x = torch.randn(int(counts.sum()), H, generator=gen, dtype=torch.float64)
    dout = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    results = []
    for module in (theirs, ours):
        leaf = x.clone().requires_grad_()
        with float64_shim():
            results.append(module_grads(module, lambda: module(leaf, counts), {"x": leaf}, dout,
                                        rename=torchtitan_name))
    assert_modules_agree(results[1], results[0])


@needs_legacy
@pytest.mark.parametrize("score_before_experts", [True, False], ids=["score_before", "score_after"])
@pytest.mark.parametrize("K, score_func", [(2, "softmax"), (1, "sigmoid")], ids=["top2", "top1_sigmoid"])
def test_legacy_moe_with_megamoe_grouped_experts_matches_torchtitan(score_before_experts, K, score_func, gen):
    H, I, E = 16, 12, 7
    theirs = build_legacy_moe(H, I, E, K, score_func, score_before_experts)
    ours = build_legacy_moe(H, I, E, K, score_func, score_before_experts)
    ours.experts = adapter.GroupedExperts(H, I, E, dtype=torch.float64)
    results = check_drop_in(theirs, ours, gen, 2, 5)
    assert results[1]["experts.w1"][-NEVER_CHOSEN:].abs().max() == 0


@pytest.mark.parametrize("role, version, status", other_releases("torchtitan"))
def test_other_torchtitan_releases(role, version, status):
    """This file's tests against torchtitan 0.2.2 and the newest release, in a subprocess each."""
    run_release("test_frameworks_torchtitan.py", "torchtitan", role, version, status)
