"""Bad input from Python: a clear exception naming the argument, never a crash or a wrong answer."""

import ctypes

import pytest
import torch

import megamoe
from megamoe import _lib
from conftest import make_problem

T, H, I, E, TOPK = 6, 10, 4, 3, 2


@pytest.fixture
def good(gen):
    x, ids, s, w13, w2, _ = make_problem(T, H, I, E, TOPK, dtype=torch.float32, gen=gen)
    return {"x": x.detach(), "topk_ids": ids, "topk_weights": s.detach(), "w13": w13.detach(), "w2": w2.detach()}


def _ids(value, where=(1, 1)):
    def mutate(a):
        a["topk_ids"] = a["topk_ids"].clone()
        a["topk_ids"][where] = value
    return mutate


def _set(name, fn):
    def mutate(a):
        a[name] = fn(a[name])
    return mutate


CASES = [
    # (case id, mutation, exception, text the message must contain)
    ("x_rank", _set("x", lambda t: t[None]), ValueError, "x: expected 2 dimensions"),
    ("x_int", _set("x", lambda t: t.to(torch.int32)), ValueError, "x: dtype i32 not allowed"),
    ("x_uint8", _set("x", lambda t: t.to(torch.uint8)), TypeError, "x has dtype torch.uint8"),
    ("x_not_tensor", _set("x", lambda t: t.tolist()), TypeError, "x must be a torch.Tensor"),
    ("x_meta_device", _set("x", lambda t: t.to("meta")), ValueError, "x is on meta"),
    ("w13_H_mismatch", _set("w13", lambda t: t[:, :, :-1].contiguous()), ValueError, "w13: expected shape"),
    ("w13_rows_mismatch", _set("w13", lambda t: t[:, :-1].contiguous()), ValueError, "w13: expected shape"),
    ("w2_E_mismatch", _set("w2", lambda t: t[:-1].contiguous()), ValueError, "w2: expected shape"),
    ("w2_dtype", _set("w2", lambda t: t.double()), ValueError, "w2: dtype f64 not allowed"),
    ("ids_float", _set("topk_ids", lambda t: t.float()), ValueError, "topk_ids: dtype f32 not allowed"),
    ("ids_T_mismatch", _set("topk_ids", lambda t: t[:-1]), ValueError, "topk_ids: expected shape"),
    ("ids_too_high", _ids(E), ValueError, "topk_ids: value 3 at [1, 1] is out of range [-1, E=3)"),
    ("ids_too_low", _ids(-5, (0, 0)), ValueError, "topk_ids: value -5 at [0, 0]"),
    ("weights_shape", _set("topk_weights", lambda t: t[:, :1].contiguous()), ValueError, "topk_weights: expected shape"),
    ("weights_dtype", _set("topk_weights", lambda t: t.to(torch.int64)), ValueError, "topk_weights: dtype i64"),
    ("topk_zero", lambda a: a.update(topk_ids=a["topk_ids"][:, :0], topk_weights=a["topk_weights"][:, :0]),
     ValueError, "topk_ids: topk must be > 0"),
    ("no_experts", lambda a: a.update(w13=a["w13"][:0], w2=a["w2"][:0]), ValueError, "w13: number of experts E"),
    ("hidden_zero", lambda a: a.update(x=a["x"][:, :0], w13=a["w13"][:, :, :0], w2=a["w2"][:, :0]),
     ValueError, "x: hidden size H must be > 0"),
    ("intermediate_zero", lambda a: a.update(w13=a["w13"][:, :0], w2=a["w2"][:, :, :0]),
     ValueError, "w2: intermediate size I must be > 0"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(good, case):
    _, mutate, exc, text = case
    mutate(good)
    with pytest.raises(exc) as info:
        megamoe.moe(**good)
    assert text in str(info.value), str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: mixed-device case needs a GPU")
def test_mixed_devices(good):
    good["w2"] = good["w2"].cuda()
    with pytest.raises(ValueError, match="w2: on cuda:0 but x is on cpu"):
        megamoe.moe(**good)


# The layouts, activations and biases (layouts.py): each bad argument named, for the whole layer and grouped rows.
@pytest.fixture
def gpt_oss(gen):
    """A valid gpt-oss-layout call: x, topk_ids, topk_weights, w13 [E, H, 2I], w2 [E, I, H], b13, b2, options."""
    x, ids, s, w13, w2, _ = make_problem(T, H, I, E, TOPK, dtype=torch.float32, gen=gen)
    return {"x": x.detach(), "topk_ids": ids, "topk_weights": s.detach(),
            "w13": w13.detach().transpose(1, 2).contiguous(), "w2": w2.detach().transpose(1, 2).contiguous(),
            "b13": torch.randn(E, 2 * I), "b2": torch.randn(E, H), "layout": megamoe.GPT_OSS,
            "activation": megamoe.GPT_OSS_ACTIVATION}


LAYOUT_CASES = [
    ("w13_untransposed", _set("w13", lambda t: t.transpose(1, 2).contiguous()), ValueError,
     "w13: expected shape [E, H, 2I] (E from w13, I from w2, H from x; layout.gate_up = interleaved, w13_transposed = 1"),
    ("w2_H_mismatch", _set("w2", lambda t: t[:, :, :-1].contiguous()), ValueError, "w2: expected shape [E, I, H]"),
    ("w3_without_separate", lambda a: a.update(w3=a["w13"][:, :, :I].contiguous()), ValueError,
     "w3: given, but layout.gate_up = interleaved keeps the up rows in w13"),
    ("separate_without_w3", lambda a: a.update(layout=megamoe.Layout("separate", True, True),
                                               w13=a["w13"][:, :, :I].contiguous()),
     ValueError, "w3: required by layout.gate_up = separate"),
    ("separate_w3_shape", lambda a: a.update(layout=megamoe.Layout("separate", True, True),
                                             w13=a["w13"][:, :, :I].contiguous(), w3=a["w13"][:, :-1, :I].contiguous()),
     ValueError, "w3: expected shape [E, H, I]"),
    ("separate_w3_dtype", lambda a: a.update(layout=megamoe.Layout("separate", True, True),
                                             w13=a["w13"][:, :, :I].contiguous(), w3=a["w13"][:, :, I:].double()),
     ValueError, "w3: dtype f64 not allowed"),
    ("b13_shape", _set("b13", lambda t: t[:, :-1].contiguous()), ValueError, "b13: expected shape [E, 2I]"),
    ("b13_rank", _set("b13", lambda t: t[None]), ValueError, "b13: expected 2 dimensions"),
    ("b13_dtype", _set("b13", lambda t: t.double()), ValueError, "b13: dtype f64 not allowed"),
    ("b2_shape", _set("b2", lambda t: t[:-1].contiguous()), ValueError, "b2: expected shape [E, H]"),
    ("b2_not_tensor", _set("b2", lambda t: t.tolist()), TypeError, "b2 must be a torch.Tensor"),
    ("limit_zero", lambda a: a.update(activation=megamoe.clamped_swiglu(limit=0.0)), ValueError,
     "activation.limit: must be finite and > 0 for clamped SwiGLU, got 0"),
    ("limit_inf", lambda a: a.update(activation=megamoe.clamped_swiglu(limit=float("inf"))), ValueError,
     "activation.limit: must be finite"),
    ("alpha_nan", lambda a: a.update(activation=megamoe.clamped_swiglu(alpha=float("nan"))), ValueError,
     "activation.alpha: must be finite and > 0"),
    ("swiglu_with_alpha", lambda a: a.update(activation=megamoe.Activation("swiglu", 0.0, 1.702)), ValueError,
     "activation.alpha: must be 0 for SwiGLU"),
    ("swiglu_with_limit", lambda a: a.update(activation=megamoe.Activation("swiglu", 7.0)), ValueError,
     "activation.limit: must be 0 for SwiGLU"),
    ("layout_not_a_layout", lambda a: a.update(layout="gpt_oss"), TypeError, "layout must be a megamoe.Layout"),
    ("activation_not_an_activation", lambda a: a.update(activation="clamped_swiglu"), TypeError,
     "activation must be a megamoe.Activation"),
]


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
@pytest.mark.parametrize("entry", ["moe", "grouped_moe"])
def test_bad_layout_input_names_the_argument(gpt_oss, case, entry):
    _, mutate, exc, text = case
    mutate(gpt_oss)
    args = gpt_oss
    if entry == "grouped_moe":
        args = {key: value for key, value in gpt_oss.items() if key not in ("topk_ids", "topk_weights")}
        args["x_sorted"], args["tokens_per_expert"] = args.pop("x"), torch.tensor([T, 0, 0])
        text = text.replace("H from x;", "H from x_sorted;")
    with pytest.raises(exc) as info:
        (megamoe.moe if entry == "moe" else megamoe.grouped_moe)(**args)
    assert text in str(info.value), str(info.value)


def test_unknown_layout_and_activation_names():
    with pytest.raises(ValueError, match="layout.gate_up: unknown arrangement 'fused'"):
        megamoe.Layout("fused")
    with pytest.raises(ValueError, match="activation.kind: unknown activation 'gelu'"):
        megamoe.Activation("gelu")


def test_unknown_names_through_the_op(good):
    """torch.ops callers pass the names as strings: the binding refuses an unknown one naming the argument."""
    args = (good["x"], good["topk_ids"], good["topk_weights"], good["w13"], good["w2"])
    with pytest.raises(ValueError, match="gate_up: unknown arrangement 'stacked'"):
        torch.ops.megamoe.moe_forward(*args, gate_up="stacked")
    with pytest.raises(ValueError, match="activation: unknown activation 'relu'"):
        torch.ops.megamoe.moe_forward(*args, activation="relu")


def _as_cuda(params):
    """The params with every present tensor labelled CUDA (host memory: only validation may run on them)."""
    for name, _ in type(params)._fields_:
        field = getattr(params, name)
        if isinstance(field, _lib.Tensor) and (field.data or field.ndim):
            field.device_type = _lib.DEVICE_CUDA
    return params


CUDA_OPTION_CASES = [
    ("separate", dict(gate_up="separate"), None),  # None: the sm_90a kernels take the option
    ("interleaved", dict(gate_up="interleaved"), None),
    ("w13_transposed", dict(w13_transposed=True), None),
    ("w2_transposed", dict(w2_transposed=True), None),
    ("clamped", dict(activation="clamped_swiglu", limit=7.0, alpha=1.702), None),
    ("b13", dict(), None),
    ("b2", dict(), None),
]


@pytest.mark.skipif(not _lib.has_cuda(), reason="a CPU-only libmegamoe.so (built without nvcc) refuses CUDA tensors")
@pytest.mark.parametrize("case", CUDA_OPTION_CASES, ids=[c[0] for c in CUDA_OPTION_CASES])
def test_cuda_accepts_the_new_options(good, case):
    """Without a GPU: the C API's validation of CUDA-labelled tensors (the workspace and path queries read no data)
    accepts every option; the workspace is the default's; every option (the separate layout included) takes the
    default's path, with no reason."""
    name, options, text = case
    x, w13, w2 = good["x"].bfloat16(), good["w13"].bfloat16(), good["w2"].bfloat16()
    default = dict(x=x, topk_ids=good["topk_ids"], topk_weights=good["topk_weights"], w13=w13, w2=w2,
                   y=torch.empty_like(x))
    if options.get("gate_up") == "separate":
        w13 = w13[:, :I].contiguous()
    if options.get("w13_transposed"):
        w13 = w13.transpose(1, 2).contiguous()
    if options.get("w2_transposed"):
        w2 = w2.transpose(1, 2).contiguous()
    tensors = dict(default, w13=w13, w2=w2, w3=w13 if name == "separate" else None,
                   b13=torch.zeros(E, 2 * I, dtype=x.dtype) if name == "b13" else None,
                   b2=torch.zeros(E, H, dtype=x.dtype) if name == "b2" else None)
    lib = _lib.library()
    sizes = []
    for call_tensors, call_options in ((default, None), (tensors, options)):
        params, size = _as_cuda(_lib.params_of("forward", call_tensors, call_options)), ctypes.c_size_t(0)
        _lib.check(lib.megamoe_forward_workspace_size(ctypes.byref(params), ctypes.byref(size)))
        sizes.append(size.value)
    assert sizes[0] == sizes[1]
    path = _lib._query_path("forward", params)
    if text is None:
        assert path == _lib._query_path("forward", _as_cuda(_lib.params_of("forward", default, None)))
        assert path.reason is None, path.reason
    else:
        assert path == "cuda"
        assert path.reason is None or text in path.reason, path.reason
