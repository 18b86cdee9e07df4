"""Only the gradients autograd needs: frozen experts (or frozen base weights under LoRA) skip dW, inputs that need no
gradient skip dX / d topk_weights. A spy on the C API calls (_lib.call) sees NULL for every skipped gradient; the
computed ones are bitwise those of the full backward."""

import pytest
import torch

import megamoe
from megamoe import _lib
from layout_models import layout_problem

# (case id, the leaves that require grad); the rest are frozen.
CASES = [
    ("frozen_experts", ("x", "topk_weights")),
    ("lora_style_only_x", ("x",)),
    ("router_only", ("topk_weights",)),
    ("weights_only", ("w13", "w3", "w2", "b13", "b2")),
    ("frozen_biases", ("x", "topk_weights", "w13", "w3", "w2")),
    ("only_b2", ("b2",)),
    ("everything", ("x", "topk_weights", "w13", "w3", "w2", "b13", "b2")),
]
GRAD_OF = {"x": "dx", "topk_weights": "dtopk_weights", "w13": "dw13", "w3": "dw3", "w2": "dw2", "b13": "db13",
           "b2": "db2"}


@pytest.fixture
def spy(monkeypatch):
    """Records, per C API backward call (_lib.call of "backward" / "grouped_backward"), the gradient outputs passed
    (name -> whether a buffer was given)."""
    calls = []
    grad_names = {"backward": ("dx", "dtopk_weights", "dw13", "dw2", "dw3", "db13", "db2"),
                  "grouped_backward": ("dx_sorted", "dscores", "dw13", "dw2", "dw3", "db13", "db2")}
    call = _lib.call

    def spied(kind, tensors, *args, **kwargs):
        if kind in grad_names:
            calls.append({grad: tensors.get(grad) is not None for grad in grad_names[kind]})
        return call(kind, tensors, *args, **kwargs)

    monkeypatch.setattr(_lib, "call", spied)
    return calls


def _problem(trainable, gen):
    x, ids, s, dy, p = layout_problem(9, 10, 6, 4, 2, megamoe.Layout("separate", True, False), True, True,
                                      routing="dropped", gen=gen)
    leaves = {"x": x, "topk_weights": s, **p}
    for name, t in leaves.items():
        t.requires_grad_(name in trainable)
    return ids, dy, leaves


def _run(leaves, ids, dy, recompute, entry):
    """y of the whole layer (or of grouped rows made of the same slots) and the gradients of the trainable leaves."""
    kwargs = dict(w3=leaves["w3"], b13=leaves["b13"], b2=leaves["b2"], layout=megamoe.Layout("separate", True, False),
                  activation=megamoe.clamped_swiglu(limit=0.6), recompute=recompute)
    if entry == "moe":
        y = megamoe.moe(leaves["x"], ids, leaves["topk_weights"], leaves["w13"], leaves["w2"], **kwargs)
    else:  # one slot per row: the tokens' first slots, all on their routed experts, sorted by expert
        order = torch.sort(ids[:, 0].clamp(min=0), stable=True).indices
        counts = torch.bincount(ids[:, 0].clamp(min=0)[order], minlength=4)
        y = megamoe.grouped_moe(leaves["x"][order], counts, leaves["w13"], leaves["w2"],
                                leaves["topk_weights"][order, 0], **kwargs)
        dy = dy[order]
    trainable = {name: t for name, t in leaves.items() if t.requires_grad}
    return dict(zip(trainable, torch.autograd.grad(y, list(trainable.values()), dy)))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep_h", "recompute"])
@pytest.mark.parametrize("entry", ["moe", "grouped_moe"])
def test_skipped_gradients_are_not_computed(case, recompute, entry, spy, gen):
    _, trainable = case
    ids, dy, leaves = _problem(trainable, gen)
    got = _run(leaves, ids, dy, recompute, entry)
    assert len(spy) == 1
    passed = spy.pop()
    grouped_name = {"dx": "dx_sorted", "dtopk_weights": "dscores"}
    for name, grad in GRAD_OF.items():
        c_name = grouped_name.get(grad, grad) if entry == "grouped_moe" else grad
        assert passed[c_name] == (name in trainable), f"{c_name}: passed={passed[c_name]}"
    for t in leaves.values():
        t.requires_grad_(True)
    full = _run(leaves, ids, dy, recompute, entry)
    assert len(spy) == 1 and all(spy.pop().values())
    for name, grad in got.items():
        assert torch.equal(grad, full[name]), name


def test_backward_op_returns_placeholders_for_skipped_gradients(gen):
    ids, dy, leaves = _problem(("x",), gen)
    detached = {name: t.detach() for name, t in leaves.items()}
    out = torch.ops.megamoe.moe_backward(dy, detached["x"], ids, detached["topk_weights"], detached["w13"],
                                         detached["w2"], dy.new_empty(0), False, detached["w3"], detached["b13"],
                                         detached["b2"], "separate", True, False, need_dtopk_weights=False,
                                         need_dw13=False, need_dw2=False, need_dw3=False, need_db13=False,
                                         need_db2=False)
    assert out[0].shape == detached["x"].shape
    assert all(t.shape == (0,) for t in out[1:])
    grads = megamoe.moe_backward(dy, detached["x"], ids, detached["topk_weights"], detached["w13"], detached["w2"],
                                 w3=detached["w3"], layout=megamoe.Layout("separate", True, False), grads=("dw3",))
    assert grads.dw3.shape == detached["w3"].shape
    assert grads.dx is None and grads.dw13 is None and grads.db13 is None  # not asked for / b13 not passed


def test_unknown_gradient_name_is_refused(gen):
    ids, dy, leaves = _problem((), gen)
    with pytest.raises(ValueError, match="grads: unknown gradient 'dw1'"):
        megamoe.moe_backward(dy, leaves["x"], ids, leaves["topk_weights"], leaves["w13"], leaves["w2"],
                             grads=("dx", "dw1"))
