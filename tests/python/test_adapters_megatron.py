"""megamoe.adapters.megatron against plain-PyTorch Megatron experts written here (the legacy GroupedMLP's weight1
[H, E*2I] / weight2 [E*I, H] read as [E, H, 2I] / [E, I, H] views; TEGroupedMLP's per-expert fc1 [2I, H] / fc2 [H, I]
with biases, as one grouped tensor or per-expert lists; probs scaling the activation and fc2's bias), in float64 on
the CPU: forward and every gradient (rows, probs, weights, biases) on ragged rows, gpt-oss's clamped activation, the
fp32 main_grad accumulation (into an existing buffer, twice, Megatron DDP's grad_added_to_main_grad), the weights
read in place, errors naming the argument, gradients not requested skipped."""

import pytest
import torch
import torch.nn.functional as F

import megamoe
from adapter_cases import (IDS, ROUTINGS, assert_close, counts_of, gpt_oss_act, grads, grouped_swiglu, randn,
                          record_needs, routing)
from conftest import rel_err
from megamoe.adapters import megatron


def legacy_grouped_mlp(x, tokens_per_expert, probs, weight1, weight2, E):
    """Megatron's legacy GroupedMLP: x @ weight1.view(E, H, 2I)[e], glu (chunk: gate, up), * probs, @ weight2 view."""
    H = weight1.shape[0]
    w1, w2 = weight1.view(E, H, -1), weight2.view(E, -1, H)  # [E, H, 2I], [E, I, H]
    outs, start = [], 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        gate, up = (x[start:start + n] @ w1[e]).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up * probs[start:start + n, None]) @ w2[e])
        start += n
    return torch.cat(outs + [x.new_zeros(x.shape[0] - start, H)])


def te_grouped_mlp(x, tokens_per_expert, probs, fc1, fc2, b1=None, b2=None, act=None):
    """Megatron's TEGroupedMLP: fc1 [E, 2I, H] (+ b1), glu, * probs, fc2 [E, H, I], + b2 * probs."""
    gate, up = fc1.chunk(2, dim=1)
    gate_bias, up_bias = (None, None) if b1 is None else b1.chunk(2, dim=1)
    out = grouped_swiglu(x, tokens_per_expert, gate, up, fc2, gate_bias, up_bias, b2, act=act)
    return out * probs[:, None]  # fc2(act * p) + b2 * p = p * (fc2(act) + b2)


def rows_problem(case, gen, padding=0):
    _, T, H, I, E, topk, kind = case
    ids, _ = routing(T, E, topk, kind, gen)
    counts = counts_of(ids, E)
    R = int(counts.sum()) + padding
    x, probs = randn(gen, R, H), (torch.rand(R, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()
    return x, counts, probs, torch.randn(R, H, generator=gen, dtype=torch.float64), (H, I, E)


@pytest.mark.parametrize("case", ROUTINGS, ids=IDS)
def test_grouped_mlp_matches_legacy_megatron(case, gen):
    x, counts, probs, dout, (H, I, E) = rows_problem(case, gen, padding=2)
    weight1, weight2 = randn(gen, H, E * 2 * I, scale=0.3), randn(gen, E * I, H, scale=0.3)
    leaves = {"x": x, "probs": probs, "weight1": weight1, "weight2": weight2}
    ours = grads(lambda: megatron.grouped_mlp(x, counts, probs, weight1, weight2, E), leaves, dout)
    theirs = grads(lambda: legacy_grouped_mlp(x, counts, probs, weight1, weight2, E), leaves, dout)
    assert_close(ours, theirs)
    out, bias = megatron.grouped_mlp(x, counts, probs, weight1, weight2, E)
    assert bias is None and out[-2:].abs().max() == 0


@pytest.mark.parametrize("case", ROUTINGS, ids=IDS)
@pytest.mark.parametrize("storage", ["grouped", "per_expert"])
@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss"])
def test_te_grouped_mlp_matches_megatron(case, storage, activation, gen):
    x, counts, probs, dout, (H, I, E) = rows_problem(case, gen)
    fc1, fc2 = randn(gen, E, 2 * I, H, scale=2.0), randn(gen, E, H, I, scale=0.3)
    b1, b2 = randn(gen, E, 2 * I, scale=0.3), randn(gen, E, H, scale=0.3)
    act = megamoe.clamped_swiglu(7.0, 1.702) if activation == "gpt_oss" else None
    ref_act = gpt_oss_act() if activation == "gpt_oss" else None
    if storage == "grouped":
        leaves = {"x": x, "probs": probs, "fc1": fc1, "fc2": fc2, "b1": b1, "b2": b2}
        args = (fc1, fc2, b1, b2)
    else:  # TE's weight0 ... weight{E-1}: separate leaves per expert (scattered: stacked, warned once; every
        # layout of a list in test_adapters_megatron_lists.py)
        per = [[randn(gen, *t.shape[1:]) for _ in range(E)] for t in (fc1, fc2, b1, b2)]
        leaves = {"x": x, "probs": probs, **{f"p{i}_{e}": t for i, ts in enumerate(per) for e, t in enumerate(ts)}}
        args = tuple(per)
        fc1, fc2, b1, b2 = (torch.stack(ts) for ts in per)
    ours = grads(lambda: megatron.te_grouped_mlp(x, counts, probs, *args, activation=act), leaves, dout)
    theirs = grads(lambda: te_grouped_mlp(x, counts, probs, fc1, fc2, b1, b2, act=ref_act), leaves, dout)
    assert_close(ours, theirs)


def reference_weight_grads(x, counts, probs, weight1, weight2, E, dout):
    w1, w2 = weight1.detach().requires_grad_(), weight2.detach().requires_grad_()
    out = legacy_grouped_mlp(x.detach(), counts, probs.detach(), w1, w2, E)
    return torch.autograd.grad(out, [w1, w2], dout)


def test_main_grad_accumulates_into_existing_buffers(gen):
    """gradient_accumulation_fusion adds into weight.main_grad (f32, already holding a value) on every backward, and
    autograd leaves weight.grad alone; the rows and probs get their gradients as usual."""
    x, counts, probs, dout, (H, I, E) = rows_problem(ROUTINGS[1], gen)
    weight1, weight2 = randn(gen, H, E * 2 * I, scale=0.3), randn(gen, E * I, H, scale=0.3)
    initial = [torch.randn(w.shape, generator=gen, dtype=torch.float32) for w in (weight1, weight2)]
    weight1.main_grad, weight2.main_grad = (t.clone() for t in initial)
    buffers = (weight1.main_grad.data_ptr(), weight2.main_grad.data_ptr())
    expected = reference_weight_grads(x, counts, probs, weight1, weight2, E, dout)
    for step in (1, 2):
        out, _ = megatron.grouped_mlp(x, counts, probs, weight1, weight2, E, gradient_accumulation_fusion=True)
        out.backward(dout)
        for w, start, grad in zip((weight1, weight2), initial, expected):
            assert w.grad is None
            assert rel_err(w.main_grad - start.double(), step * grad) < 1e-6, step
    assert (weight1.main_grad.data_ptr(), weight2.main_grad.data_ptr()) == buffers  # added in place
    assert x.grad is not None and probs.grad is not None


def test_main_grad_marks_megatron_ddp_params(gen):
    """With Megatron DDP's grad_added_to_main_grad attribute the backward sets it and gives autograd a placeholder
    gradient (zeros where zero_out_wgrad), so the parameter's gradient hooks run, as for Megatron's fused layers."""
    x, counts, probs, dout, (H, I, E) = rows_problem(ROUTINGS[0], gen)
    fc1, fc2 = randn(gen, E, 2 * I, H, scale=0.3), randn(gen, E, H, I, scale=0.3)
    hooked = []
    for w in (fc1, fc2):
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
        w.zero_out_wgrad = True
        w.register_post_accumulate_grad_hook(lambda p: hooked.append(p.shape))
    out, _ = megatron.te_grouped_mlp(x, counts, probs, fc1, fc2, gradient_accumulation_fusion=True)
    out.backward(dout)
    ref = torch.func.grad(lambda a, b: (te_grouped_mlp(x.detach(), counts, probs.detach(), a, b) * dout).sum(),
                          argnums=(0, 1))(fc1.detach(), fc2.detach())
    for w, grad in zip((fc1, fc2), ref):
        assert w.grad_added_to_main_grad and w.grad is not None and w.grad.abs().max() == 0
        assert rel_err(w.main_grad, grad) < 1e-6
    assert sorted(hooked) == sorted([fc1.shape, fc2.shape])


def test_gradients_not_requested_are_skipped(gen, monkeypatch):
    x, counts, probs, dout, (H, I, E) = rows_problem(ROUTINGS[0], gen)
    weight1, weight2 = randn(gen, H, E * 2 * I), randn(gen, E * I, H)
    weight2.requires_grad_(False)
    probs = probs.detach()
    asked = record_needs(monkeypatch, megamoe.grouped.OPS, "backward_op")
    megatron.grouped_mlp(x, counts, probs, weight1, weight2, E)[0].backward(dout)
    assert asked == [{"need_dx_sorted", "need_dw13"}]
    assert weight2.grad is None and weight1.grad is not None and x.grad is not None


def test_bad_inputs_name_the_argument(gen):
    H, I, E = 8, 6, 4
    x, probs = torch.randn(6, H, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    counts = torch.tensor([1, 2, 3, 0])
    weight1, weight2 = torch.randn(H, E * 2 * I, dtype=torch.float64), torch.randn(E * I, H, dtype=torch.float64)
    with pytest.raises(ValueError, match="permuted_probs"):
        megatron.grouped_mlp(x, counts, probs[:5], weight1, weight2, E)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        megatron.grouped_mlp(x, counts[:3], probs, weight1, weight2, E)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        megatron.grouped_mlp(x, torch.tensor([4, 4, 0, 0]), probs, weight1, weight2, E)  # past the 6 rows
    with pytest.raises(ValueError, match="num_local_experts"):
        megatron.grouped_mlp(x, counts, probs, weight1, weight2, 5)
    with pytest.raises(ValueError, match="permuted_local_hidden_states"):
        megatron.grouped_mlp(x[None], counts, probs, weight1, weight2, E)
    weight1.requires_grad_()
    with pytest.raises(ValueError, match="weight1.main_grad"):
        megatron.grouped_mlp(x, counts, probs, weight1, weight2, E, gradient_accumulation_fusion=True)
    fc1 = [torch.randn(2 * I, H, dtype=torch.float64, requires_grad=True) for _ in range(E)]
    fc2 = torch.randn(E, H, I, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fc1_weight\[0\]\.main_grad"):
        megatron.te_grouped_mlp(x, counts, probs, fc1, fc2, gradient_accumulation_fusion=True)
    with pytest.raises(ValueError, match=r"fc1_weight\[1\]"):
        megatron.te_grouped_mlp(x, counts, probs, [fc1[0], fc1[1][0]], fc2)
    with pytest.raises(ValueError, match="fc2_weight"):
        megatron.te_grouped_mlp(x, counts, probs, torch.stack(fc1), fc2[:, :, :-1].contiguous())
