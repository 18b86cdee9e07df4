"""Grouped rows on CPU tensors (the C++ reference): equal to the whole layer on the same math (the slots sorted by
expert, the scores their topk_weights, the rows added back into their tokens), against plain PyTorch, gradcheck,
padding rows, empty experts, one expert taking every row, R = 0, memory modes, opcheck, torch.compile and bad input.
"""

import pytest
import torch

import megamoe
from conftest import RAGGED, grads_of, grouped_as_layer, group_rows, make_problem, rel_err, torch_grouped

OUTPUTS = ("y", "dx", "dtopk_weights", "dw13", "dw2")


@pytest.mark.parametrize("case", RAGGED, ids=[c[0] for c in RAGGED])
@pytest.mark.parametrize("counts_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_padding", [0, 3])
def test_grouped_rows_equal_the_whole_layer(case, counts_dtype, num_padding, gen):
    _, T, H, I, E, topk, routing = case
    x, ids, s, w13, w2, dy = make_problem(T, H, I, E, topk, routing, gen=gen)
    whole = grads_of(megamoe.moe, x, ids, s, w13, w2, dy)
    grouped = grads_of(grouped_as_layer(num_padding, counts_dtype=counts_dtype, gen=gen), x, ids, s, w13, w2, dy)
    for name, a, b in zip(OUTPUTS, grouped, whole):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.3e}"


def _grouped_leaves(R, H, I, counts, gen, dtype=torch.float64, with_scores=True):
    """x_sorted, tokens_per_expert, w13, w2, scores (None without), dout; float leaves require grad."""
    E = len(counts)
    x = (torch.randn(R, H, generator=gen, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64) / H**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, H, I, generator=gen, dtype=torch.float64) / I**0.5).to(dtype).requires_grad_()
    scores = (torch.rand(R, generator=gen, dtype=torch.float64) + 0.05).to(dtype).requires_grad_()
    scores = scores if with_scores else None
    dout = torch.randn(R, H, generator=gen, dtype=torch.float64).to(dtype)
    return x, torch.tensor(counts), w13, w2, scores, dout


def _grouped_grads(fn, x, counts, w13, w2, scores, dout):
    """out and the gradients (d x_sorted, d scores or None, dw13, dw2) of <dout, fn(...)>."""
    leaves = [t for t in (x, scores, w13, w2) if t is not None]
    for t in leaves:
        t.grad = None
    out = fn(x, counts, w13, w2, scores)
    out.backward(dout)
    grads = [t.grad.detach().clone() if t is not None else None for t in (x, scores, w13, w2)]
    for t in leaves:
        t.grad = None
    return [out.detach()] + grads


@pytest.mark.parametrize("counts,R", [([4, 0, 6, 0, 5], 18), ([0, 11, 0], 11), ([3], 5), ([0, 0], 4)],
                         ids=["empty_experts_padding", "one_expert_takes_all", "E1_padding", "only_padding"])
@pytest.mark.parametrize("with_scores", [True, False])
def test_matches_plain_pytorch(counts, R, with_scores, gen):
    x, n, w13, w2, scores, dout = _grouped_leaves(R, 12, 7, counts, gen, with_scores=with_scores)
    ours = _grouped_grads(megamoe.grouped_moe, x, n, w13, w2, scores, dout)
    theirs = _grouped_grads(torch_grouped, x, n, w13, w2, scores, dout)
    for name, a, b in zip(("out", "dx_sorted", "dscores", "dw13", "dw2"), ours, theirs):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < 1e-12 or (b.abs().max() == 0 and a.abs().max() == 0), f"{name}: {rel_err(a, b):.3e}"


def test_padding_rows_and_empty_experts_give_exact_zeros(gen):
    x, n, w13, w2, scores, dout = _grouped_leaves(12, 8, 5, [3, 0, 4, 0], gen)  # rows 7.. are padding
    out, dx, ds, dw13, dw2 = _grouped_grads(megamoe.grouped_moe, x, n, w13, w2, scores, dout)
    assert torch.all(out[7:] == 0) and torch.all(dx[7:] == 0) and torch.all(ds[7:] == 0)
    assert torch.all(dw13[[1, 3]] == 0) and torch.all(dw2[[1, 3]] == 0)
    assert out[:7].abs().min(dim=1).values.gt(0).all() and dw13[0].abs().sum() > 0


def test_gradcheck_float64(gen):
    """gradcheck backpropagates one graph many times: recompute mode (keep-h's backward consumes h)."""
    x, n, w13, w2, scores, _ = _grouped_leaves(6, 5, 4, [2, 0, 3], gen)  # one padding row
    assert torch.autograd.gradcheck(lambda a, b, c, d: megamoe.grouped_moe(a, n, c, d, b, recompute=True),
                                    (x, scores, w13, w2))
    assert torch.autograd.gradcheck(lambda a, c, d: megamoe.grouped_moe(a, n, c, d, recompute=True), (x, w13, w2))


def test_no_rows(gen):
    x, n, w13, w2, scores, dout = _grouped_leaves(0, 8, 5, [0, 0, 0], gen)
    out, dx, ds, dw13, dw2 = _grouped_grads(megamoe.grouped_moe, x, n, w13, w2, scores, dout)
    assert out.shape == (0, 8) and dx.shape == (0, 8) and ds.shape == (0,)
    assert torch.all(dw13 == 0) and torch.all(dw2 == 0)


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
def test_memory_modes_give_the_same_gradients(dtype, bound, gen):
    x, n, w13, w2, scores, dout = _grouped_leaves(14, 16, 8, [5, 0, 7], gen, dtype=dtype)
    kept = _grouped_grads(megamoe.grouped_moe, x, n, w13, w2, scores, dout)
    recomputed = _grouped_grads(lambda *args: megamoe.grouped_moe(*args, recompute=True), x, n, w13, w2, scores, dout)
    for name, a, b in zip(("out", "dx_sorted", "dscores", "dw13", "dw2"), kept, recomputed):
        assert rel_err(a, b) < bound, f"{name}: {rel_err(a, b):.3e}"
    with torch.no_grad():
        _, h = torch.ops.megamoe.grouped_forward(x, n, w13, w2, scores, True)
    assert h.shape == (14, 16) and h.dtype == dtype


def test_low_precision_tracks_float64(gen):
    x, n, w13, w2, scores, dout = _grouped_leaves(21, 40, 24, [6, 0, 9, 4], gen, dtype=torch.bfloat16)
    ours = _grouped_grads(megamoe.grouped_moe, x, n, w13, w2, scores, dout)
    wide = [t.detach().double().requires_grad_() for t in (x, w13, w2, scores)]
    ref = _grouped_grads(megamoe.grouped_moe, wide[0], n, wide[1], wide[2], wide[3], dout.double())
    for name, a, b in zip(("out", "dx_sorted", "dscores", "dw13", "dw2"), ours, ref):
        assert rel_err(a, b) < 2e-2, f"{name}: {rel_err(a, b):.3e}"


def test_weight_gradients_in_f32(gen):
    x, n, w13, w2, scores, dout = _grouped_leaves(9, 8, 6, [4, 5], gen)
    with torch.no_grad():
        _, _, dw13, dw2, *_ = megamoe.grouped_backward(dout, x, n, w13, w2, scores)
        _, _, dw13_f32, dw2_f32, *_ = megamoe.grouped_backward(dout, x, n, w13, w2, scores, None, True)
    assert dw13_f32.dtype == dw2_f32.dtype == torch.float32
    assert rel_err(dw13_f32, dw13) < 1e-6 and rel_err(dw2_f32, dw2) < 1e-6


def test_opcheck(gen):
    # No padding rows: their h rows are left unwritten (never read), which opcheck would see as differing outputs.
    x, n, w13, w2, scores, dout = _grouped_leaves(9, 8, 6, [3, 0, 6], gen)
    for s in (scores, None):
        torch.library.opcheck(torch.ops.megamoe.grouped_forward.default, (x, n, w13, w2, s, False))
        # keep-h: not the AOT-dispatch check, whose traced function returns h while its backward writes dh over it
        # (test_cpu.py's test_opcheck says why)
        torch.library.opcheck(torch.ops.megamoe.grouped_forward.default, (x, n, w13, w2, s, True),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        with torch.no_grad():  # the backward op has no autograd formula of its own (no double backward)
            _, h = torch.ops.megamoe.grouped_forward(x, n, w13, w2, s, True)
            for saved_h, wgrad_f32 in ((dout.new_empty(0), False), (h, False), (h, True)):
                torch.library.opcheck(torch.ops.megamoe.grouped_backward.default,
                                      (dout, x, n, w13, w2, s, saved_h, wgrad_f32))


def test_torch_compile_fullgraph(gen):
    x, n, w13, w2, scores, dout = _grouped_leaves(10, 8, 4, [3, 0, 5], gen)

    def block(x_sorted, tokens_per_expert, w13, w2, scores):
        return megamoe.grouped_moe(torch.tanh(x_sorted), tokens_per_expert, w13, w2, scores.sigmoid()) * 2

    compiled = torch.compile(block, fullgraph=True)
    expected = _grouped_grads(block, x, n, w13, w2, scores, dout)
    got = _grouped_grads(compiled, x, n, w13, w2, scores, dout)
    for a, b in zip(got, expected):
        assert rel_err(a, b) < 1e-12


def test_group_rows_helper_sorts_slots_by_expert(gen):
    """The test helper itself: rows of expert e are contiguous, in slot order, and the counts add up."""
    x, ids, s, w13, w2, _ = make_problem(13, 6, 4, 5, 3, "dropped", gen=gen)
    x_sorted, counts, scores, token_of_row = group_rows(x, ids, s, 5)
    experts = ids.reshape(-1)[ids.reshape(-1) >= 0]
    assert counts.tolist() == torch.bincount(experts, minlength=5).tolist() and counts.sum() == x_sorted.shape[0]
    assert torch.equal(x_sorted, x[token_of_row]) and torch.equal(scores, s.reshape(-1)[ids.reshape(-1) >= 0][
        torch.sort(experts, stable=True).indices])
    for segment in torch.split(token_of_row, counts.tolist()):
        assert torch.all(segment.diff() > 0)  # one expert's rows in slot order (distinct experts per token)


def _good(gen):
    x, n, w13, w2, scores, _ = _grouped_leaves(7, 10, 4, [3, 0, 2], gen, dtype=torch.float32)
    return {"x_sorted": x.detach(), "tokens_per_expert": n.to(torch.int32), "w13": w13.detach(), "w2": w2.detach(),
            "scores": scores.detach()}


def _set(name, fn):
    def mutate(a):
        a[name] = fn(a[name])
    return mutate


def _count(idx, value):
    def mutate(a):
        a["tokens_per_expert"] = a["tokens_per_expert"].clone()
        a["tokens_per_expert"][idx] = value
    return mutate


BAD = [
    # (case id, mutation, exception, text the message must contain)
    ("x_sorted_rank", _set("x_sorted", lambda t: t[None]), ValueError, "x_sorted: expected 2 dimensions [R, H]"),
    ("x_sorted_not_tensor", _set("x_sorted", lambda t: t.tolist()), TypeError, "x_sorted must be a torch.Tensor"),
    ("counts_float", _set("tokens_per_expert", lambda t: t.float()), ValueError,
     "tokens_per_expert: dtype f32 not allowed (i32 or i64)"),
    ("counts_length", _set("tokens_per_expert", lambda t: t[:-1]), ValueError,
     "tokens_per_expert: expected shape [E] (E from w13) = [3], got [2]"),
    ("counts_2d", _set("tokens_per_expert", lambda t: t[None]), ValueError, "tokens_per_expert: expected 1 dimensions"),
    ("counts_not_tensor", _set("tokens_per_expert", lambda t: t.tolist()), TypeError,
     "tokens_per_expert must be a torch.Tensor"),
    ("count_negative", _count(1, -2), ValueError, "tokens_per_expert: value -2 at [1] is negative"),
    ("counts_sum_past_R", _count(2, 5), ValueError,
     "tokens_per_expert: the counts sum past the R=7 rows of x_sorted (at expert 2)"),
    ("scores_shape", _set("scores", lambda t: t[:-1]), ValueError, "scores: expected shape [R] (R from x_sorted)"),
    ("scores_int", _set("scores", lambda t: t.to(torch.int64)), ValueError, "scores: dtype i64 not allowed"),
    ("scores_not_tensor", _set("scores", lambda t: 1.0), TypeError, "scores must be a torch.Tensor"),
    ("w2_E_mismatch", _set("w2", lambda t: t[:-1].contiguous()), ValueError, "w2: expected shape"),
    ("w13_dtype", _set("w13", lambda t: t.double()), ValueError,
     "w13: dtype f64 not allowed (must equal the dtype of x_sorted)"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_names_the_argument(case, gen):
    _, mutate, exc, text = case
    args = _good(gen)
    mutate(args)
    with pytest.raises(exc) as info:
        megamoe.grouped_moe(**args)
    assert text in str(info.value), str(info.value)
