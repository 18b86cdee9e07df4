"""Mistakes a new user makes, each an exception naming the argument (never a silent result, a crash, an out-of-memory
error or another library's message): the modules' inputs checked before any reshape, the helpers' arguments, the
2^31-slot limit before any allocation, the library file, dtype errors listing what the argument allows, and no
contiguity warning for autograd's own expanded gradient."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import megamoe
from megamoe import _lib, op_family
from conftest import make_problem

T, H, I, E, TOPK = 6, 16, 8, 4, 2


@pytest.fixture
def args(gen):
    x, ids, s, w13, w2, _ = make_problem(T, H, I, E, TOPK, dtype=torch.float32, gen=gen)
    return {"x": x.detach(), "topk_ids": ids, "topk_weights": s.detach(), "w13": w13.detach(), "w2": w2.detach()}


def _raises(exc, text, fn):
    with pytest.raises(exc) as info:
        fn()
    assert text in str(info.value), str(info.value)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.bool])
def test_index_dtype_errors_list_only_index_dtypes(args, dtype):
    _raises(TypeError, "topk_ids has dtype", lambda: megamoe.moe(**dict(args, topk_ids=args["topk_ids"].to(dtype))))
    with pytest.raises(TypeError) as info:
        megamoe.moe(**dict(args, topk_ids=args["topk_ids"].to(dtype)))
    assert str(info.value).endswith("allowed: int32 or int64"), str(info.value)
    counts = torch.tensor([T, 0, 0, 0], dtype=dtype)
    with pytest.raises(TypeError) as info:
        megamoe.grouped_moe(args["x"], counts, args["w13"], args["w2"])
    assert "tokens_per_expert has dtype" in str(info.value) and "f32" not in str(info.value), str(info.value)


def test_row_dtype_errors_list_float_dtypes(args):
    with pytest.raises(TypeError) as info:
        megamoe.moe(**dict(args, x=args["x"].to(torch.uint8)))
    assert "x has dtype torch.uint8; allowed: bf16, f16, f32 or f64" in str(info.value), str(info.value)
    assert "int32" not in str(info.value)


@pytest.mark.parametrize("name", ["x", "topk_ids", "topk_weights", "w13", "w2"])
def test_a_missing_input_is_named(args, name):
    _raises(TypeError, f"{name} must be a torch.Tensor, got NoneType", lambda: megamoe.moe(**dict(args, **{name: None})))


def test_recompute_must_be_a_bool(args):
    _raises(TypeError, "recompute must be True or False, got str", lambda: megamoe.moe(**args, recompute="yes"))
    _raises(TypeError, "recompute must be True or False", lambda: megamoe.MoEExperts(E, H, I, recompute="no"))


def test_separate_layout_without_w3_names_w3(args):
    _raises(ValueError, "w3: required by layout.gate_up = separate", lambda: megamoe.moe(**args, layout=megamoe.SEPARATE))


def test_wrong_ranks_with_gradients_are_named(args):
    """With gradients wanted the forward sizes h from topk_ids and w2: a wrong rank there is the library's error
    naming the argument, not an IndexError."""
    leaves = {name: t.requires_grad_(True) if t.is_floating_point() else t for name, t in args.items()}
    _raises(ValueError, "w2: expected 3 dimensions", lambda: megamoe.moe(**dict(leaves, w2=leaves["w2"][0])))
    _raises(ValueError, "topk_ids: expected 2 dimensions",
            lambda: megamoe.moe(**dict(leaves, topk_ids=leaves["topk_ids"][:, 0].contiguous())))


def test_the_slot_limit_comes_before_any_allocation():
    """T * topk >= 2^31 (expanded inputs: no memory) with gradients wanted: the limit, naming topk_ids / x_sorted,
    before the inputs are copied or h allocated (tens of GB here)."""
    big = 2**30 + 1
    x = torch.zeros(1, 8).expand(big, 8).requires_grad_(True)
    ids = torch.zeros(1, 2, dtype=torch.int32).expand(big, 2)
    weights = torch.ones(1, 2).expand(big, 2)
    w13, w2 = torch.zeros(1, 16, 8, requires_grad=True), torch.zeros(1, 8, 8, requires_grad=True)
    _raises(NotImplementedError, f"topk_ids: T * topk = {big} * 2 exceeds 2^31 - 1 slots",
            lambda: megamoe.moe(x, ids, weights, w13, w2))
    rows = torch.zeros(1, 8).expand(2**31, 8).requires_grad_(True)
    _raises(NotImplementedError, "x_sorted: R = 2147483648 rows exceed 2^31 - 1",
            lambda: megamoe.grouped_moe(rows, torch.tensor([2**31]), w13, w2))


def test_manual_backward_names_a_gradient_that_is_no_tensor(args):
    _raises(TypeError, "dy must be a torch.Tensor, got list", lambda: megamoe.moe_backward([[0.0]], **args))


# ---- the modules: every input checked before a reshape could hide or misname it

def test_experts_module_checks_before_reshaping(args):
    experts = megamoe.MoEExperts(E, H, I)
    x, ids, weights = args["x"], args["topk_ids"], args["topk_weights"]
    _raises(ValueError, "x: expected shape [..., H] with H = 16 (the hidden size of this MoEExperts), got [6, 32]",
            lambda: experts(torch.randn(T, 2 * H), ids, weights))  # same element count as ids' T = 12 would give
    _raises(ValueError, "topk_weights: expected the shape of topk_ids [6, 2], got [2, 6]",
            lambda: experts(x, ids, weights.t().contiguous()))  # a transposed topk_weights: never reshaped into place
    _raises(ValueError, "topk_weights: expected the shape of topk_ids", lambda: experts(x, ids, weights[:-1]))
    _raises(ValueError, "topk_ids: expected shape [..., topk] with the leading dimensions of x [2, 3]",
            lambda: experts(x.reshape(2, 3, H), ids, weights))
    _raises(ValueError, "topk_weights: dtype torch.int64 not allowed", lambda: experts(x, ids, weights.long()))
    _raises(TypeError, "x must be a torch.Tensor, got list", lambda: experts(x.tolist(), ids, weights))
    y = experts(x.reshape(2, 3, H), ids.reshape(2, 3, TOPK), weights.reshape(2, 3, TOPK))  # leading dims kept
    assert torch.equal(y.reshape(T, H), experts(x, ids, weights))


def test_block_module_checks_before_reshaping():
    block = megamoe.MoEBlock(H, I, E, TOPK)
    _raises(ValueError, "x: expected shape [..., H] with H = 16 (the hidden size of this MoEBlock), got [6, 17]",
            lambda: block(torch.randn(T, H + 1)))
    _raises(ValueError, "x: expected shape [..., H] with H = 16", lambda: block(torch.randn(H + 2)))
    _raises(TypeError, "x must be a torch.Tensor, got list", lambda: block([[0.0] * H]))


@pytest.mark.parametrize("make, text", [
    (lambda: megamoe.MoEExperts(0, H, I), "num_experts must be > 0, got 0"),
    (lambda: megamoe.MoEExperts(E, -1, I), "hidden must be > 0, got -1"),
    (lambda: megamoe.MoEExperts(E, H, "8"), "intermediate must be an int, got str"),
    (lambda: megamoe.MoEBlock(H, I, E, 1.5), "topk must be an int, got float"),
    (lambda: megamoe.MoEBlock(0, I, E, TOPK), "hidden must be > 0, got 0"),
    (lambda: megamoe.MoEBlock(H, I, E, E + 1), "topk must be in [1, num_experts=4], got 5"),
])
def test_module_sizes_are_checked(make, text):
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    assert text in str(info.value), str(info.value)


# ---- the helpers

def test_arrange_weights_names_its_arguments(args):
    w13, w2 = args["w13"], args["w2"]
    _raises(TypeError, "layout must be a megamoe.Layout (e.g. megamoe.SEPARATE), got str",
            lambda: megamoe.arrange_weights(w13, w2, layout="separate"))
    _raises(ValueError, "w13: expected shape [E, 2I, H]", lambda: megamoe.arrange_weights(w13[0], w2))
    _raises(ValueError, "w13: expected shape [E, 2I, H]", lambda: megamoe.arrange_weights(w13[:, :-1], w2))
    _raises(ValueError, "w2: expected shape [E, H, I] = [4, 16, 8]", lambda: megamoe.arrange_weights(w13, w2[:, :-1]))
    _raises(ValueError, "b13: expected shape [E, 2I] = [4, 16]",
            lambda: megamoe.arrange_weights(w13, w2, b13=torch.zeros(E, 3), layout=megamoe.INTERLEAVED))
    _raises(TypeError, "w13 must be a torch.Tensor, got list", lambda: megamoe.arrange_weights([[1.0]], w2))


@pytest.mark.parametrize("logits, topk, exc, text", [
    (torch.randn(T, E), E + 1, ValueError, "topk must be an int in [1, E=4]"),
    (torch.randn(T, E), 0, ValueError, "topk must be an int in [1, E=4]"),
    (torch.randn(T, E), 1.5, ValueError, "topk must be an int in [1, E=4]"),
    ([], 1, ValueError, "router_logits: an empty list"),
    (torch.zeros(T, E, dtype=torch.int64), 1, TypeError, "router_logits must be a float tensor [..., E]"),
    ([torch.randn(T, E), torch.randn(T, E + 1)], 1, ValueError, "router_logits[1]: E = 5 experts"),
    ("logits", 1, TypeError, "router_logits must be a float tensor [..., E] of router logits, got str"),
])
def test_load_balancing_loss_names_its_arguments(logits, topk, exc, text):
    _raises(exc, text, lambda: megamoe.load_balancing_loss(logits, topk))


def test_clamped_swiglu_takes_numbers():
    _raises(TypeError, "clamped_swiglu: limit must be a number, got str", lambda: megamoe.clamped_swiglu("a"))
    _raises(TypeError, "activation.alpha must be a number, got str", lambda: megamoe.Activation("swiglu", 0.0, "x"))


# ---- the library file and its build

def test_megamoe_library_naming_a_missing_file_is_an_error(tmp_path):
    """MEGAMOE_LIBRARY naming no file: ImportError naming the path (never the installed library in its place)."""
    for value, what in ((str(tmp_path / "libmegamoe.so"), "no such file"), (str(tmp_path), "a directory")):
        code = "import megamoe; megamoe._lib.library()"
        env = dict(os.environ, MEGAMOE_LIBRARY=value)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert result.returncode != 0
        assert f"ImportError: megamoe: MEGAMOE_LIBRARY={value}: {what}" in result.stderr, result.stderr


@pytest.mark.skipif(_lib.has_cuda(), reason="a CUDA build of libmegamoe.so: CUDA tensors run")
def test_a_cpu_only_library_refuses_cuda_tensors_saying_why(args):
    """A CPU-only build (no nvcc when it was built) refuses CUDA tensors naming the build; host memory labelled CUDA
    (no GPU needed: validation, the workspace and path queries read no data)."""
    x, w13, w2 = (args[name].bfloat16() for name in ("x", "w13", "w2"))
    tensors = dict(args, x=x, w13=w13, w2=w2, y=torch.empty_like(x))
    params = _lib.params_of("forward", tensors)
    for name, _ in type(params)._fields_:
        field = getattr(params, name)
        if isinstance(field, _lib.Tensor) and field.ndim:
            field.device_type = _lib.DEVICE_CUDA
    with pytest.raises(NotImplementedError, match="x: CUDA tensors, but this libmegamoe.so was built without CUDA"):
        _lib._query_path("forward", params)


def test_autograds_expanded_gradient_gives_no_contiguity_warning(args, monkeypatch):
    """y.sum().backward() hands the backward an expanded (stride 0) gradient: copied without a word, as the user
    passed no dy; a strided dy the user passes to moe_backward is still warned about once."""
    monkeypatch.setattr(op_family, "_warned", set())  # the warning is once per argument: start from none
    leaves = {name: t.requires_grad_(True) if t.is_floating_point() else t for name, t in args.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megamoe.moe(**leaves).sum().backward()
    assert not [w for w in caught if "megamoe" in str(w.message)], [str(w.message) for w in caught]
    with pytest.warns(UserWarning, match="dy is not contiguous"):
        megamoe.moe_backward(torch.ones(1, 1).expand(T, H), **args)
