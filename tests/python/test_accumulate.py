"""Weight gradients accumulated into f32 buffers (main_grads), on CPU tensors (the C++ reference): the manual backwards
(megamoe.moe_backward / grouped_backward) and the autograd entry points (megamoe.moe / grouped_moe): buffer ==
previous + fresh f32 gradient (bitwise: the reference rounds its gradient to f32, then adds), experts with no tokens
and empty batches leave the buffer untouched, two backwards add twice, the weights' autograd gradients are None,
torch.compile(fullgraph=True) adds in place into the caller's buffer, and bad buffers raise naming the argument."""

import pytest
import torch

import megamoe
from conftest import make_problem


def _previous(like, gen):
    return torch.randn(like.shape, generator=gen, dtype=torch.float64).float()  # never zeros


def _fresh(dy, x, ids, s, w13, w2, **kwargs):
    return megamoe.moe_backward(dy, x, ids, s, w13, w2, None, True, **kwargs)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "half_empty", "dropped", "one_expert"])
def test_moe_backward_adds_the_fresh_gradient(dtype, routing, gen):
    x, ids, s, w13, w2, dy = make_problem(11, 16, 6, 6, 2, routing, dtype=dtype, gen=gen)
    fresh = _fresh(dy, x, ids, s, w13, w2)
    buf13, buf2 = _previous(w13, gen), _previous(w2, gen)
    before13, before2 = buf13.clone(), buf2.clone()
    grads = megamoe.moe_backward(dy, x, ids, s, w13, w2, main_grads=(buf13, buf2))
    assert grads.dw13 is buf13 and grads.dw2 is buf2
    assert torch.equal(buf13, before13 + fresh.dw13) and torch.equal(buf2, before2 + fresh.dw2)
    assert torch.equal(grads.dx, fresh.dx) and torch.equal(grads.dtopk_weights, fresh.dtopk_weights)
    unused = torch.ones(w13.shape[0], dtype=torch.bool)
    unused[ids[ids >= 0]] = False
    assert torch.equal(buf13[unused], before13[unused]) and torch.equal(buf2[unused], before2[unused])
    if routing == "half_empty":
        assert unused[1::2].all()


def test_f32_accumulation_tracks_float64(gen):
    x, ids, s, w13, w2, dy = make_problem(9, 16, 8, 4, 3, "dropped", gen=gen)
    fresh = _fresh(dy, x, ids, s, w13, w2)
    args = [t.float() for t in (dy, x)] + [ids] + [t.float() for t in (s, w13, w2)]
    buf13, buf2 = _previous(w13, gen), _previous(w2, gen)
    before13, before2 = buf13.double(), buf2.double()
    megamoe.moe_backward(*args, main_grads={"w13": buf13, "w2": buf2})
    assert torch.allclose(buf13.double() - before13, fresh.dw13.double(), rtol=1e-4, atol=1e-5)
    assert torch.allclose(buf2.double() - before2, fresh.dw2.double(), rtol=1e-4, atol=1e-5)


def test_partial_main_grads_and_wgrad_dtype(gen):
    """A buffer for w2 only: dw2 is added into it, dw13 comes back as usual (f32 with wgrad_f32, else w13's dtype)."""
    x, ids, s, w13, w2, dy = make_problem(7, 12, 5, 3, 2, dtype=torch.bfloat16, gen=gen)
    fresh = _fresh(dy, x, ids, s, w13, w2)
    buf2 = _previous(w2, gen)
    before2 = buf2.clone()
    grads = megamoe.moe_backward(dy, x, ids, s, w13, w2, main_grads={"w2": buf2})
    assert grads.dw13.dtype == torch.bfloat16 and torch.equal(grads.dw13, fresh.dw13.bfloat16())
    assert torch.equal(buf2, before2 + fresh.dw2)
    grads = megamoe.moe_backward(dy, x, ids, s, w13, w2, None, True, main_grads=(None, buf2))
    assert grads.dw13.dtype == torch.float32 and torch.equal(grads.dw13, fresh.dw13)


def test_empty_batch_leaves_the_buffers_untouched(gen):
    x, ids, s, w13, w2, dy = make_problem(0, 8, 4, 3, 2, gen=gen)
    buf13, buf2 = _previous(w13, gen), _previous(w2, gen)
    before13, before2 = buf13.clone(), buf2.clone()
    megamoe.moe_backward(dy, x, ids, s, w13, w2, main_grads=(buf13, buf2))
    assert torch.equal(buf13, before13) and torch.equal(buf2, before2)


def test_layouts_biases_and_w3_accumulate(gen):
    """The separate layout with biases: dw13 (gate), dw3, dw2, db13, db2 each added into its buffer."""
    E, T, H, I, topk = 4, 9, 10, 6, 2
    x, ids, s, _, _, dy = make_problem(T, H, I, E, topk, "half_empty", gen=gen)
    params = dict(w13=torch.randn(E, I, H, generator=gen, dtype=torch.float64), w2=torch.randn(E, H, I, generator=gen,
                  dtype=torch.float64), w3=torch.randn(E, I, H, generator=gen, dtype=torch.float64),
                  b13=torch.randn(E, 2 * I, generator=gen, dtype=torch.float64),
                  b2=torch.randn(E, H, generator=gen, dtype=torch.float64))
    kwargs = dict(w3=params["w3"], b13=params["b13"], b2=params["b2"], layout=megamoe.SEPARATE)
    fresh = _fresh(dy, x, ids, s, params["w13"], params["w2"], **kwargs)
    buffers = {name: _previous(param, gen) for name, param in params.items()}
    before = {name: buf.clone() for name, buf in buffers.items()}
    grads = megamoe.moe_backward(dy, x, ids, s, params["w13"], params["w2"], main_grads=buffers, **kwargs)
    for name in params:
        assert torch.equal(buffers[name], before[name] + getattr(fresh, f"d{name}")), name
        assert getattr(grads, f"d{name}") is buffers[name]
        assert torch.equal(buffers[name][1::2], before[name][1::2]), name  # odd experts never chosen


def test_autograd_main_grads_accumulate_twice_and_return_none(gen):
    x, ids, s, w13, w2, dy = make_problem(10, 16, 6, 5, 2, "half_empty", gen=gen)
    fresh = _fresh(dy, x, ids, s, w13, w2)
    buf13, buf2 = _previous(w13, gen), _previous(w2, gen)
    before13, before2 = buf13.clone(), buf2.clone()
    x_leaf, s_leaf, w13_leaf, w2_leaf = _leaves(x, s, w13, w2)
    first = megamoe.moe(x_leaf, ids, s_leaf, w13_leaf, w2_leaf, main_grads=(buf13, buf2))
    second = megamoe.moe(x_leaf, ids, s_leaf, w13_leaf, w2_leaf, main_grads=(buf13, buf2))
    first.backward(dy)  # two forwards in flight, then their backwards: the buffers are not version-checked
    second.backward(dy)
    assert w13_leaf.grad is None and w2_leaf.grad is None
    assert torch.equal(x_leaf.grad, 2 * fresh.dx) and torch.equal(s_leaf.grad, 2 * fresh.dtopk_weights)
    assert torch.equal(buf13, before13 + fresh.dw13 + fresh.dw13) and torch.equal(buf2, before2 + fresh.dw2 + fresh.dw2)
    assert torch.equal(buf13[1::2], before13[1::2])  # odd experts never chosen


def test_autograd_main_grads_one_graph_twice_in_recompute_mode(gen):
    x, ids, s, w13, w2, dy = make_problem(6, 8, 4, 3, 2, gen=gen)
    fresh = _fresh(dy, x, ids, s, w13, w2)
    buf13, buf2 = torch.zeros(w13.shape), torch.zeros(w2.shape)
    w13_leaf, w2_leaf = _leaves(w13, w2)
    y = megamoe.moe(x.detach(), ids, s.detach(), w13_leaf, w2_leaf, recompute=True, main_grads=(buf13, buf2))
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    assert torch.equal(buf13, fresh.dw13 + fresh.dw13) and torch.equal(buf2, fresh.dw2 + fresh.dw2)


def test_autograd_partial_main_grads_and_frozen_weights(gen):
    """w2 without a buffer gets its usual autograd gradient; a frozen w13 with a buffer adds nothing into it."""
    x, ids, s, w13, w2, dy = make_problem(8, 12, 5, 4, 2, gen=gen)
    fresh = _fresh(dy, x, ids, s, w13, w2)
    buf13 = _previous(w13, gen)
    before13 = buf13.clone()
    w2_leaf, = _leaves(w2)
    megamoe.moe(x.detach(), ids, s.detach(), w13.detach(), w2_leaf, main_grads=(buf13,)).backward(dy)
    assert torch.equal(buf13, before13)
    assert w2_leaf.grad.dtype == torch.float64 and torch.equal(w2_leaf.grad, fresh.dw2.double())
    w13_leaf, w2_leaf = _leaves(w13, w2)
    megamoe.moe(x.detach(), ids, s.detach(), w13_leaf, w2_leaf, main_grads=(buf13,)).backward(dy)
    assert w13_leaf.grad is None and torch.equal(buf13, before13 + fresh.dw13)
    assert torch.equal(w2_leaf.grad, fresh.dw2.double())


def test_grouped_rows_accumulate(gen):
    from test_grouped import _grouped_leaves

    x, counts, w13, w2, scores, dout = _grouped_leaves(14, 10, 6, [4, 0, 7, 0], gen=gen)
    fresh = megamoe.grouped_backward(dout, x, counts, w13, w2, scores, None, True)
    buf13, buf2 = _previous(w13, gen), _previous(w2, gen)
    before13, before2 = buf13.clone(), buf2.clone()
    grads = megamoe.grouped_backward(dout, x, counts, w13, w2, scores, main_grads=(buf13, buf2))
    assert grads.dw13 is buf13 and torch.equal(buf13, before13 + fresh.dw13) and torch.equal(buf2, before2 + fresh.dw2)
    assert torch.equal(buf13[[1, 3]], before13[[1, 3]])
    x_leaf, w13_leaf, w2_leaf = _leaves(x, w13, w2)
    megamoe.grouped_moe(x_leaf, counts, w13_leaf, w2_leaf, scores.detach(), main_grads=(buf13, buf2)).backward(dout)
    assert w13_leaf.grad is None and w2_leaf.grad is None and torch.equal(x_leaf.grad, fresh.dx_sorted)
    assert torch.equal(buf13, before13 + fresh.dw13 + fresh.dw13)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torch_compile_adds_in_place(dynamic, gen, monkeypatch):
    """fullgraph compile of a block using main_grads: the same buffers as eager, written in place by the kernel (the
    buffer the C API receives is the caller's: no copy of it, no extra pass)."""
    from megamoe import _lib

    x, ids, s, w13, w2, dy = make_problem(6, 8, 4, 3, 2, gen=gen)
    seen = []
    call = _lib.call

    def spy(kind, tensors, *args, **kwargs):
        if kind == "backward":
            seen.append(tensors["dw13"].data_ptr() if tensors["dw13"] is not None else None)
        return call(kind, tensors, *args, **kwargs)

    monkeypatch.setattr(_lib, "call", spy)

    def block(x, ids, s, w13, w2, buf13, buf2):
        return megamoe.moe(torch.tanh(x), ids, s.softmax(-1), w13, w2, main_grads=(buf13, buf2)) * 2

    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    results = []
    for fn in (block, compiled):
        buf13, buf2 = torch.zeros(w13.shape), torch.zeros(w2.shape)
        x_leaf, w13_leaf, w2_leaf = _leaves(x, w13, w2)
        for _ in range(2):  # forward, backward per step: twice into the same buffers
            fn(x_leaf, ids, s.detach(), w13_leaf, w2_leaf, buf13, buf2).backward(dy)
        assert w13_leaf.grad is None and w2_leaf.grad is None
        assert seen[-1] == buf13.data_ptr() and seen[-2] == buf13.data_ptr()
        results.append((buf13, buf2, x_leaf.grad))
    for eager, compiled_result in zip(*results):
        assert torch.allclose(eager, compiled_result, rtol=1e-6, atol=1e-6)


def test_bad_main_grads_name_the_argument(gen):
    x, ids, s, w13, w2, dy = make_problem(5, 8, 4, 3, 2, gen=gen)
    good13, good2 = torch.zeros(w13.shape), torch.zeros(w2.shape)
    cases = [
        ((good13.double(), good2), ValueError, r"main_grads\['w13'\]: the weight gradients are accumulated into "
                                               "float32"),
        ((good13, good2[:, :, :2]), ValueError, r"main_grads\['w2'\]: shape"),
        ((good13, good2, torch.zeros(3)), ValueError, r"main_grads\['w3'\]: given, but w3 is absent"),
        ((good13, "w2"), TypeError, r"main_grads\['w2'\] must be a torch.Tensor"),
        ({"w4": good13}, ValueError, r"main_grads: unknown parameter 'w4'"),
        ((good13.transpose(1, 2).contiguous().transpose(1, 2), good2), ValueError,
         r"main_grads\['w13'\] must be contiguous"),
        ((torch.zeros(w13.shape, requires_grad=True), good2), ValueError, r"main_grads\['w13'\] requires grad"),
        (good13, TypeError, r"main_grads must be a tuple, a list or a dict"),
    ]
    for main_grads, error, message in cases:
        with pytest.raises(error, match=message):
            megamoe.moe_backward(dy, x, ids, s, w13, w2, main_grads=main_grads)
        with pytest.raises(error, match=message):
            megamoe.moe(x, ids, s, w13, w2, main_grads=main_grads)


def test_opcheck_accumulate_ops(gen):
    x, ids, s, w13, w2, dy = make_problem(5, 8, 4, 3, 2, gen=gen)
    empty = dy.new_empty((0,))
    with torch.no_grad():
        torch.library.opcheck(torch.ops.megamoe.moe_backward_accumulate.default,
                              (dy, x, ids, s, w13, w2, empty, torch.zeros(w13.shape), torch.zeros(w2.shape),
                               dy.new_empty((0,)), dy.new_empty((0,)), dy.new_empty((0,))))
