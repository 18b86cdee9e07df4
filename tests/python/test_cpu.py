"""The op on CPU tensors (the C++ reference): against an independent float64 PyTorch implementation,
gradcheck, opcheck, torch.compile, the ragged set and low-precision dtypes."""

import pytest
import torch

import megamoe
from conftest import RAGGED, grads_of, make_problem, rel_err, torch_moe


@pytest.mark.parametrize("case", RAGGED, ids=[c[0] for c in RAGGED])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_reference_matches_torch_float64(case, id_dtype, gen):
    _, T, H, I, E, topk, routing = case
    x, ids, s, w13, w2, dy = make_problem(T, H, I, E, topk, routing, gen=gen)
    ids = ids.to(id_dtype)
    ours = grads_of(megamoe.moe, x, ids, s, w13, w2, dy)
    theirs = grads_of(torch_moe, x, ids, s, w13, w2, dy)
    for name, a, b in zip(("y", "dx", "dtopk_weights", "dw13", "dw2"), ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.3e}"


def test_dropped_and_unused_give_exact_zeros(gen):
    x, ids, s, w13, w2, dy = make_problem(8, 12, 6, 6, 2, "half_empty", gen=gen)
    ids[3] = -1
    y, dx, ds, dw13, dw2 = grads_of(megamoe.moe, x, ids, s, w13, w2, dy)
    assert torch.all(y[3] == 0) and torch.all(dx[3] == 0) and torch.all(ds[3] == 0)
    assert torch.all(dw13[1::2] == 0) and torch.all(dw2[1::2] == 0)  # odd experts never chosen
    assert dw13[0].abs().sum() > 0


def test_gradcheck_float64(gen):
    """gradcheck backpropagates one graph many times (retain_graph): recompute mode, since keep-h's backward consumes h."""
    x, ids, s, w13, w2, _ = make_problem(4, 6, 5, 3, 2, "dropped", gen=gen)
    assert torch.autograd.gradcheck(lambda a, b, c, d: megamoe.moe(a, ids, b, c, d, recompute=True), (x, s, w13, w2))


def test_second_backward_of_keep_h_graph_raises_clearly(gen):
    x, ids, s, w13, w2, dy = make_problem(5, 8, 6, 4, 2, gen=gen)
    y = megamoe.moe(x, ids, s, w13, w2)
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute=True"):
        y.backward(dy)
    y = megamoe.moe(x, ids, s, w13, w2, recompute=True)
    first = torch.autograd.grad(y, (x, w13), dy, retain_graph=True)
    second = torch.autograd.grad(y, (x, w13), dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_backward_does_not_materialize_a_gradient_for_h(gen):
    """h is a non-differentiable output: autograd must not build a [T*topk, 2I] of zeros for it each backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.made.append((str(func), tuple(tensor.shape)))
            return out

    x, ids, s, w13, w2, dy = make_problem(5, 8, 6, 4, 2, gen=gen)
    y, h = torch.ops.megamoe.moe_forward(x, ids, s, w13, w2, True)
    assert h.shape == (10, 12) and not h.requires_grad
    with Shapes() as mode:
        torch.autograd.backward(y, dy)
    assert any("moe_backward" in name for name, _ in mode.made), mode.made  # the mode sees the backward's ops
    assert not [op for op in mode.made if op[1] == tuple(h.shape)], mode.made


def test_opcheck(gen):
    """All of opcheck's checks, but for the keep-h forward's AOT-dispatch check: it returns h from the traced function
    while the traced backward writes dh over that same h (moe_backward declares the mutation), which its harness
    rejects. megamoe.moe never returns h; test_torch_compile_fullgraph compiles it, with static and dynamic shapes."""
    x, ids, s, w13, w2, dy = make_problem(5, 8, 6, 4, 2, gen=gen)
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, (x, ids, s, w13, w2, False))
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, (x, ids, s, w13, w2, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    with torch.no_grad():
        _, h = torch.ops.megamoe.moe_forward(x, ids, s, w13, w2, True)
        for saved_h, wgrad_f32 in ((dy.new_empty(0), False), (h, False), (h, True)):
            torch.library.opcheck(torch.ops.megamoe.moe_backward.default,
                                  (dy, x, ids, s, w13, w2, saved_h, wgrad_f32))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_memory_modes_give_the_same_gradients(dtype, gen):
    """Keep-h (default) and recompute: the CPU reads the saved h as given (rounded to dtype) or recomputes it and
    rounds it alike: the same gradients, bitwise, in every dtype (as on CUDA)."""
    x, ids, s, w13, w2, dy = make_problem(9, 16, 8, 4, 3, "dropped", dtype=dtype, gen=gen)
    kept = grads_of(megamoe.moe, x, ids, s, w13, w2, dy)
    recomputed = grads_of(lambda *args: megamoe.moe(*args, recompute=True), x, ids, s, w13, w2, dy)
    for name, a, b in zip(("y", "dx", "dtopk_weights", "dw13", "dw2"), kept, recomputed):
        assert torch.equal(a, b), f"{name}: {rel_err(a, b):.3e}"
    with torch.no_grad():
        y, h = torch.ops.megamoe.moe_forward(x, ids, s, w13, w2, True)
    assert h.shape == (9 * 3, 16) and h.dtype == dtype


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torch_compile_fullgraph(dynamic, gen):
    x, ids, s, w13, w2, dy = make_problem(6, 8, 4, 3, 2, gen=gen)

    def block(x, ids, s, w13, w2):
        return megamoe.moe(torch.tanh(x), ids, s.softmax(-1), w13, w2) * 2

    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    expected = grads_of(block, x, ids, s, w13, w2, dy)
    got = grads_of(compiled, x, ids, s, w13, w2, dy)
    for a, b in zip(got, expected):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_low_precision_tracks_float64(dtype, bound, gen):
    x, ids, s, w13, w2, dy = make_problem(17, 40, 24, 5, 2, "dropped", dtype=dtype, gen=gen)
    ours = grads_of(megamoe.moe, x, ids, s, w13, w2, dy)
    ref = grads_of(torch_moe, *[t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t
                                for t in (x, ids, s, w13, w2)], dy.double())
    for name, a, b in zip(("y", "dx", "dtopk_weights", "dw13", "dw2"), ours, ref):
        assert a.dtype in (dtype, torch.float32), name
        assert rel_err(a, b) < bound, f"{name}: {rel_err(a, b):.3e}"


def test_non_contiguous_inputs_are_copied_with_a_warning(gen):
    x, ids, s, w13, w2, _ = make_problem(5, 8, 6, 4, 2, gen=gen)
    w13_t = w13.detach().transpose(1, 2).contiguous().transpose(1, 2)  # same values, strided
    assert not w13_t.is_contiguous()
    megamoe.op_family._warned.discard("w13")
    with pytest.warns(UserWarning, match="w13 is not contiguous"):
        y = megamoe.moe(x.detach(), ids, s.detach(), w13_t, w2.detach())
    assert rel_err(y, megamoe.moe(x.detach(), ids, s.detach(), w13.detach(), w2.detach())) == 0


def test_nan_passes_through_as_nan(gen):
    x, ids, s, w13, w2, _ = make_problem(4, 8, 6, 4, 2, gen=gen)
    x = x.detach().clone()
    x[2, 3] = float("nan")
    y = megamoe.moe(x, ids, s.detach(), w13.detach(), w2.detach())
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()


def test_empty_batch(gen):
    x, ids, s, w13, w2, dy = make_problem(0, 8, 6, 4, 2, gen=gen)
    y, dx, ds, dw13, dw2 = grads_of(megamoe.moe, x, ids, s, w13, w2, dy)
    assert y.shape == (0, 8) and dx.shape == (0, 8) and ds.shape == (0, 2)
    assert torch.all(dw13 == 0) and torch.all(dw2 == 0)


@pytest.mark.parametrize("recompute", [False, True], ids=["keep_h", "recompute"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_same_results(recompute, use_reentrant, gen):
    """torch.utils.checkpoint around a block with megamoe.moe: the forward runs again in the backward (keep-h mode
    keeps the recomputed forward's h, which that backward consumes); y and every gradient equal the plain run's."""
    from torch.utils.checkpoint import checkpoint

    x, ids, s, w13, w2, dy = make_problem(11, 16, 8, 5, 3, "dropped", gen=gen)

    def block(x, ids, s, w13, w2):
        return megamoe.moe(torch.tanh(x), ids, s, w13, w2, recompute=recompute) * 2

    def checkpointed(x, ids, s, w13, w2):
        return checkpoint(block, x, ids, s, w13, w2, use_reentrant=use_reentrant)

    plain = grads_of(block, x, ids, s, w13, w2, dy)
    again = grads_of(checkpointed, x, ids, s, w13, w2, dy)
    for name, a, b in zip(("y", "dx", "dtopk_weights", "dw13", "dw2"), again, plain):
        assert torch.equal(a, b), f"{name}: checkpointed differs from the plain run"
