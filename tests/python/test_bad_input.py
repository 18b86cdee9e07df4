"""Bad input from Python: a clear exception naming the argument, never a crash or a wrong answer."""

import pytest
import torch

import megamoe
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
