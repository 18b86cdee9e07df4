"""megamoe.adapters.torchtitan against plain-PyTorch torchtitan modules written here (GroupedExperts' storage w1 / w2 /
w3 and its per-expert loop; RoutedExperts' local dispatcher: stable argsort, experts, score-weighted scatter-add), in
float64 on the CPU: forward and every gradient on ragged routings, any leading shape of the routed call, the
parameters read in place, errors naming the argument, gradients not requested skipped, torchtitan's key names,
torch.compile(fullgraph=True). test_frameworks_torchtitan.py checks the same against torchtitan's own modules."""

import pytest
import torch
from torch import nn

import megamoe
from adapter_cases import (DROPPED, IDS, ROUTINGS, assert_close, counts_of, grads, grouped_swiglu, record_needs,
                          routing, sort_by_expert)
from megamoe.adapters import torchtitan


class TorchtitanGroupedExperts(nn.Module):
    """torchtitan's GroupedExperts (for-loop form) in plain PyTorch: o = w2[e] (silu(w1[e] x) * (w3[e] x))."""

    def __init__(self, w1, w2, w3):
        super().__init__()
        self.w1, self.w2, self.w3 = w1, w2, w3  # [E, I, H], [E, H, I], [E, I, H]

    def forward(self, x_sorted, num_tokens_per_expert):
        return grouped_swiglu(x_sorted, num_tokens_per_expert, self.w1, self.w3, self.w2)


def torchtitan_routed(experts, x, topk_scores, topk_expert_ids):
    """torchtitan's RoutedExperts with its LocalTokenDispatcher: sort the slots by expert, run the experts, scale
    each row by its score, scatter-add into the tokens. Dropped slots (-1) are left out."""
    x_sorted, _order, scores_sorted, token_of_row = sort_by_expert(x, topk_expert_ids, topk_scores)
    counts = counts_of(topk_expert_ids, experts.w1.shape[0])
    rows = experts(x_sorted, counts) * scores_sorted[:, None]  # [R, H]
    return torch.zeros_like(x).index_add(0, token_of_row, rows)


def make_experts(H, I, E):
    module = torchtitan.GroupedExperts(H, I, E, dtype=torch.float64)
    module.init_weights(0.3)
    return module


def params_of(module):
    return {"w1": module.w1, "w2": module.w2, "w3": module.w3}


@pytest.mark.parametrize("case", ROUTINGS + [DROPPED], ids=IDS + ["dropped_slots"])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep_h", "recompute"])
def test_routed_experts_match_torchtitan(case, recompute, gen):
    _, T, H, I, E, topk, kind = case
    routed = torchtitan.RoutedExperts(H, I, E, dtype=torch.float64, recompute=recompute)
    routed.inner_experts.init_weights(0.3)
    reference = TorchtitanGroupedExperts(**params_of(routed.inner_experts))
    ids, scores = routing(T, E, topk, kind, gen)
    scores.requires_grad_()
    x = torch.randn(T, H, generator=gen, dtype=torch.float64).requires_grad_()
    dy = torch.randn(T, H, generator=gen, dtype=torch.float64)
    leaves = {"x": x, "topk_scores": scores, **params_of(routed.inner_experts)}
    storage = {name: p.data_ptr() for name, p in params_of(routed.inner_experts).items()}
    ours = grads(lambda: routed(x, scores, ids, counts_of(ids, E)), leaves, dy)
    theirs = grads(lambda: torchtitan_routed(reference, x, scores, ids), leaves, dy)
    assert_close(ours, theirs)
    assert {name: p.data_ptr() for name, p in params_of(routed.inner_experts).items()} == storage


@pytest.mark.parametrize("leading", [(2, 3), (6, 1), (1, 2, 3)], ids=["B2_L3", "B6_L1", "1x2x3"])
def test_routed_experts_take_any_leading_shape(leading, gen):
    """x [..., H] with scores / ids [..., K] (torchtitan 0.3.0 calls it with [B, L, .]) -> y [..., H]: the values and
    gradients of the flattened call, reshaped."""
    H, I, E, K = 10, 6, 4, 2
    T = torch.Size(leading).numel()
    routed = torchtitan.RoutedExperts(H, I, E, dtype=torch.float64)
    routed.inner_experts.init_weights(0.3)
    reference = TorchtitanGroupedExperts(**params_of(routed.inner_experts))
    ids, scores = routing(T, E, K, "random", gen)
    scores.requires_grad_()
    x = torch.randn(T, H, generator=gen, dtype=torch.float64).requires_grad_()
    dy = torch.randn(*leading, H, generator=gen, dtype=torch.float64)
    leaves = {"x": x, "topk_scores": scores, **params_of(routed.inner_experts)}
    ours = grads(lambda: routed(x.view(*leading, H), scores.view(*leading, K), ids.view(*leading, K),
                                counts_of(ids, E)), leaves, dy)
    theirs = grads(lambda: torchtitan_routed(reference, x, scores, ids).view(*leading, H), leaves, dy)
    assert_close(ours, theirs)


@pytest.mark.parametrize("case", ROUTINGS, ids=IDS)
@pytest.mark.parametrize("num_padding", [0, 3])
def test_grouped_experts_match_torchtitan(case, num_padding, gen):
    """The inner-experts call on dispatched rows (padding rows past the counts' sum come out 0)."""
    _, T, H, I, E, topk, kind = case
    experts = make_experts(H, I, E)
    reference = TorchtitanGroupedExperts(**params_of(experts))
    ids, _scores = routing(T, E, topk, kind, gen)
    counts = counts_of(ids, E)
    R = int(counts.sum()) + num_padding
    x_sorted = torch.randn(R, H, generator=gen, dtype=torch.float64).requires_grad_()
    dout = torch.randn(R, H, generator=gen, dtype=torch.float64)
    leaves = {"x": x_sorted, **params_of(experts)}
    ours = grads(lambda: experts(x_sorted, counts), leaves, dout)
    theirs = grads(lambda: reference(x_sorted, counts), leaves, dout)
    assert_close(ours, theirs)
    assert ours["out"][R - num_padding:].abs().max() == 0 if num_padding else True


def test_gradients_not_requested_are_skipped(gen, monkeypatch):
    """Frozen experts: the backward is asked for dx and d scores only; x without grad: only the weights."""
    H, I, E = 8, 6, 4
    routed = torchtitan.RoutedExperts(H, I, E, dtype=torch.float64)
    ids, scores = routing(5, E, 2, "random", gen)
    x = torch.randn(5, H, generator=gen, dtype=torch.float64)
    asked = record_needs(monkeypatch, megamoe.ops.OPS, "backward_op")
    routed.requires_grad_(False)
    x.requires_grad_()
    scores.requires_grad_()
    y = routed(x, scores, ids)
    y.backward(torch.ones_like(y))
    assert asked[-1] == {"need_dx", "need_dtopk_weights"}
    assert all(p.grad is None for p in routed.parameters()) and x.grad is not None and scores.grad is not None

    routed.requires_grad_(True)
    x.requires_grad_(False)
    scores = scores.detach()
    y = routed(x, scores, ids)
    y.backward(torch.ones_like(y))
    assert asked[-1] == {"need_dw13", "need_dw2", "need_dw3"}
    assert all(p.grad is not None for p in routed.parameters())


def test_bad_inputs_name_the_argument():
    H, I, E = 8, 6, 4
    routed = torchtitan.RoutedExperts(H, I, E, dtype=torch.float64)
    x = torch.randn(5, H, dtype=torch.float64)
    ids = torch.zeros(5, 2, dtype=torch.int64)
    scores = torch.ones(5, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="topk_scores"):
        routed(x, scores[:, :1], ids)
    with pytest.raises(TypeError, match="topk_expert_ids"):
        routed(x, scores, ids.float())
    with pytest.raises(ValueError, match="topk_expert_ids"):
        routed(x, scores[:4], ids[:4])
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        routed(x, scores, ids, torch.zeros(E + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"leading shape of x \(1, 5, 8\)"):
        routed(x[None], scores, ids)
    with pytest.raises(ValueError, match="x must have at least 2 dimensions"):
        routed(x[0], scores[0], ids[0])
    experts = routed.inner_experts
    with pytest.raises(TypeError, match="num_tokens_per_expert"):
        experts(x, torch.zeros(E))
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        experts(x, torch.tensor([5, 1, 0, 0]))  # sums past the 5 rows


def test_loads_torchtitan_key_names():
    H, I, E = 8, 6, 4
    source = make_experts(H, I, E)
    state = {f"{ours}_{suffix}": t.detach().clone() for (ours, suffix), t in
             zip((("w1", "EFD"), ("w2", "EDF"), ("w3", "EFD")), (source.w1, source.w2, source.w3))}
    target = torchtitan.GroupedExperts(H, I, E, dtype=torch.float64)
    target.load_state_dict(state)
    for name in ("w1", "w2", "w3"):
        assert torch.equal(getattr(target, name), getattr(source, name))


def test_torch_compile_fullgraph(gen):
    """RoutedExperts and GroupedExperts trace with fullgraph=True (no graph break) and give the eager results."""
    H, I, E, T = 8, 6, 4, 7
    routed = torchtitan.RoutedExperts(H, I, E, dtype=torch.float64)
    routed.inner_experts.init_weights(0.3)
    ids, scores = routing(T, E, 2, "random", gen)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64).requires_grad_()
    dy = torch.randn(T, H, generator=gen, dtype=torch.float64)
    leaves = {"x": x, **params_of(routed.inner_experts)}
    eager = grads(lambda: routed(x, scores, ids), leaves, dy)
    compiled_routed = torch.compile(routed, backend="aot_eager", fullgraph=True)
    assert_close(grads(lambda: compiled_routed(x, scores, ids), leaves, dy), eager)

    counts = counts_of(ids, E)
    x_sorted = torch.randn(int(counts.sum()), H, generator=gen, dtype=torch.float64).requires_grad_()
    leaves = {"x": x_sorted, **params_of(routed.inner_experts)}
    dout = torch.randn(x_sorted.shape, generator=gen, dtype=torch.float64)
    eager = grads(lambda: routed.inner_experts(x_sorted, counts), leaves, dout)
    compiled_grouped = torch.compile(routed.inner_experts, backend="aot_eager", fullgraph=True)
    assert_close(grads(lambda: compiled_grouped(x_sorted, counts), leaves, dout), eager)
