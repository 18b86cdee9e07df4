"""Layouts, activations and biases on CPU tensors (the C++ reference): every layout x activation x bias combination
against plain PyTorch float64 (layout_models.torch_experts) and against the default layout on the same experts
(bitwise: the gradients come back in each parameter's own layout), the frameworks' own experts (HF Qwen3-MoE, HF
is_transposed, gpt-oss, torchtitan and its fused w13), gradcheck, the clamp's boundary, both memory modes, grouped rows
against the whole layer, opcheck, torch.compile and which path runs."""

import os
import random

import pytest
import torch

import megamoe
from conftest import group_rows, rel_err
from layout_models import (ACTIVATIONS, BIASES, COMBINATIONS, LAYOUTS, gpt_oss_experts, hf_qwen3_experts,
                           hf_transposed_experts, layout_problem, to_layout, torch_experts, torchtitan_experts,
                           torchtitan_fused_experts)

PARAM_NAMES = ("w13", "w3", "w2", "b13", "b2")
SHAPE = (11, 12, 7, 5, 3)  # T, H, I, E, topk


def _grads(fn, x, ids, s, dy, params, **options):
    """y and the gradients of <dy, fn(...)> by name (x, topk_weights and the present parameters)."""
    leaves = {"x": x, "topk_weights": s, **{k: v for k, v in params.items() if v is not None}}
    y = fn(x, ids, s, **params, **options)
    grads = torch.autograd.grad(y, list(leaves.values()), dy)
    return {"y": y.detach(), **dict(zip(leaves, grads))}


def _assert_close(ours, theirs, bound=1e-12, what=""):
    assert ours.keys() == theirs.keys(), what
    for name in theirs:
        a, b = ours[name], theirs[name]
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {name}"
        assert rel_err(a, b) < bound, f"{what} {name}: {rel_err(a, b):.3e}"


@pytest.mark.parametrize("layout,activation,bias", COMBINATIONS, ids=["-".join(c) for c in COMBINATIONS])
def test_every_combination_matches_plain_pytorch(layout, activation, bias, gen):
    x, ids, s, dy, params = layout_problem(*SHAPE, LAYOUTS[layout], *BIASES[bias], routing="dropped", gen=gen)
    options = dict(layout=LAYOUTS[layout], activation=ACTIVATIONS[activation])
    ours = _grads(megamoe.moe, x, ids, s, dy, params, **options)
    theirs = _grads(torch_experts, x, ids, s, dy, params, **options)
    _assert_close(ours, theirs, what=f"{layout}/{activation}/{bias}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_layout_equals_the_default_layout_bitwise(layout, activation, gen):
    """The same experts stored in another layout give bitwise the default layout's outputs and gradients, the
    gradients stored in that layout: the reference reads every layout into the same canonical arrays."""
    x, ids, s, dy, canonical = layout_problem(*SHAPE, megamoe.CONCATENATED, True, True, routing="dropped", gen=gen)
    stored = to_layout(canonical["w13"].detach(), canonical["w2"].detach(), canonical["b13"].detach(), LAYOUTS[layout])
    stored = {name: t.requires_grad_() if t is not None else None for name, t in stored.items()}
    stored["b2"] = canonical["b2"]
    act = ACTIVATIONS[activation]
    ours = _grads(megamoe.moe, x, ids, s, dy, stored, layout=LAYOUTS[layout], activation=act)
    default = _grads(megamoe.moe, x, ids, s, dy, canonical, activation=act)
    for name in ("y", "x", "topk_weights", "b2"):
        assert torch.equal(ours[name], default[name]), name
    expected = to_layout(default["w13"], default["w2"], default["b13"], LAYOUTS[layout])
    for name, grad in expected.items():
        if grad is not None:
            assert torch.equal(ours[name], grad), name


# (id, layout, the framework's experts called with the parameters by megamoe's names)
FRAMEWORKS = [
    ("hf_qwen3", megamoe.CONCATENATED, lambda x, ids, s, w13, w2, **_: hf_qwen3_experts(x, ids, s, w13, w2)),
    ("hf_transposed", megamoe.HF_TRANSPOSED,
     lambda x, ids, s, w13, w2, **_: hf_transposed_experts(x, ids, s, w13, w2)),
    ("torchtitan", megamoe.SEPARATE, lambda x, ids, s, w13, w3, w2, **_: torchtitan_experts(x, ids, s, w13, w2, w3)),
    ("torchtitan_fused", megamoe.INTERLEAVED,
     lambda x, ids, s, w13, w2, **_: torchtitan_fused_experts(x, ids, s, w13, w2)),
]


@pytest.mark.parametrize("name,layout,experts", FRAMEWORKS, ids=[f[0] for f in FRAMEWORKS])
def test_framework_experts(name, layout, experts, gen):
    """Each framework's own experts on its own storage (layout_models.py) against megamoe reading it in place."""
    x, ids, s, dy, p = layout_problem(*SHAPE, layout, False, False, gen=gen)
    _assert_close(_grads(megamoe.moe, x, ids, s, dy, p, layout=layout), _grads(experts, x, ids, s, dy, p))


@pytest.mark.parametrize("limit", [7.0, 0.3], ids=["gpt_oss_limit", "tight_limit"])
def test_gpt_oss_experts(limit, gen):
    """gpt-oss: interleaved transposed gate_up_proj [E, H, 2I] with its bias, down_proj [E, I, H] with its bias,
    clamped SwiGLU; the tight limit clamps many entries (their gradient is zero)."""
    x, ids, s, dy, p = layout_problem(*SHAPE, megamoe.GPT_OSS, True, True, routing="dropped", gen=gen)
    activation = megamoe.clamped_swiglu(limit=limit, alpha=1.702)
    ours = _grads(megamoe.moe, x, ids, s, dy, p, layout=megamoe.GPT_OSS, activation=activation)

    def gpt_oss(x, ids, s, w13, w2, b13, b2, **_):
        return gpt_oss_experts(x, ids, s, w13, b13, w2, b2, limit=limit, alpha=1.702)
    _assert_close(ours, _grads(gpt_oss, x, ids, s, dy, p))


def test_torchtitan_experts(gen):
    x, ids, s, dy, p = layout_problem(*SHAPE, megamoe.SEPARATE, False, False, gen=gen)
    ours = _grads(megamoe.moe, x, ids, s, dy, p, layout=megamoe.SEPARATE)
    theirs = _grads(lambda x, ids, s, w13, w3, w2, **_: torchtitan_experts(x, ids, s, w13, w2, w3), x, ids, s, dy, p)
    _assert_close(ours, theirs)


def test_torchtitan_fused_interleaved_experts(gen):
    x, ids, s, dy, p = layout_problem(*SHAPE, megamoe.INTERLEAVED, False, False, gen=gen)
    ours = _grads(megamoe.moe, x, ids, s, dy, p, layout=megamoe.INTERLEAVED)
    theirs = _grads(lambda x, ids, s, w13, w2, **_: torchtitan_fused_experts(x, ids, s, w13, w2), x, ids, s, dy, p)
    _assert_close(ours, theirs)


GRADCHECK_CASES = list(dict.fromkeys([(layout, "clamped_tight", "both") for layout in LAYOUTS] +
                                     [("gpt_oss", activation, bias) for activation in ACTIVATIONS for bias in BIASES]))


@pytest.mark.parametrize("layout,activation,bias", GRADCHECK_CASES, ids=["-".join(c) for c in GRADCHECK_CASES])
def test_gradcheck_float64(layout, activation, bias, gen):
    """recompute=True: gradcheck backpropagates one graph many times, and keep-h's backward consumes h. Fast mode (a
    random projection of the Jacobian) but for gpt-oss's layout with both biases and the tight clamp."""
    x, ids, s, _, params = layout_problem(4, 5, 3, 3, 2, LAYOUTS[layout], *BIASES[bias], routing="dropped", gen=gen)
    names = [name for name in PARAM_NAMES if params[name] is not None]

    def fn(x, s, *tensors):
        return megamoe.moe(x, ids, s, recompute=True, layout=LAYOUTS[layout], activation=ACTIVATIONS[activation],
                           **dict(zip(names, tensors)))
    fast_mode = (layout, activation, bias) != ("gpt_oss", "clamped_tight", "both")
    assert torch.autograd.gradcheck(fn, (x, s, *[params[name] for name in names]), fast_mode=fast_mode)


def test_clamp_boundary_gradients():
    """H = 1, x = 1: g and u are the weights themselves, so they can sit exactly on the limit. The gradient is zero
    where a clamp is active (g > limit, |u| > limit) and on the limit itself (the minimum-norm subgradient, as
    F.hardtanh's and, since pytorch#184572, torch.clamp's), nonzero elsewhere. Compared with plain PyTorch only where
    its clamp follows that convention (older torch passes the gradient on the limit)."""
    limit = 0.75
    gate = torch.tensor([limit, limit + 0.25, limit - 0.5, -3.0, limit, 0.1], dtype=torch.float64)
    up = torch.tensor([limit, -limit, limit + 0.5, -limit - 2.0, 0.2, -0.3], dtype=torch.float64)
    I = gate.numel()
    w13 = torch.cat([gate, up]).reshape(1, 2 * I, 1).requires_grad_()  # [E=1, 2I, H=1]
    w2 = torch.linspace(0.5, 1.5, I, dtype=torch.float64).reshape(1, 1, I).requires_grad_()
    x = torch.ones(1, 1, dtype=torch.float64, requires_grad=True)
    ids, s = torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 1), 0.7, dtype=torch.float64, requires_grad=True)
    activation = megamoe.clamped_swiglu(limit=limit, alpha=1.702)
    ours = torch.autograd.grad(megamoe.moe(x, ids, s, w13, w2, activation=activation), (x, s, w13, w2))
    probe = torch.tensor(1.0, requires_grad=True)
    if torch.autograd.grad(probe.clamp(max=1.0), probe)[0] == 0:
        theirs = torch.autograd.grad(torch_experts(x, ids, s, w13, w2, activation=activation), (x, s, w13, w2))
        for a, b in zip(ours, theirs):
            assert rel_err(a, b) < 1e-14
    dgate, dup = ours[2][0, :I, 0], ours[2][0, I:, 0]
    assert dgate[[0, 1, 4]].eq(0).all() and dgate[[2, 3, 5]].ne(0).all()  # g >= limit: no gradient
    assert dup[[0, 1, 2, 3]].eq(0).all() and dup[[4, 5]].ne(0).all()  # |u| >= limit: no gradient


@pytest.mark.parametrize("layout", ["gpt_oss", "separate", "interleaved"])
def test_memory_modes_give_the_same_gradients(layout, gen):
    """Keep-h stores h = [g, u] with the bias, by sorted row, whatever the layout; recompute recomputes it."""
    x, ids, s, dy, p = layout_problem(*SHAPE, LAYOUTS[layout], True, True, routing="dropped", gen=gen)
    options = dict(layout=LAYOUTS[layout], activation=megamoe.clamped_swiglu(limit=0.5))
    kept = _grads(megamoe.moe, x, ids, s, dy, p, **options)
    recomputed = _grads(megamoe.moe, x, ids, s, dy, p, recompute=True, **options)
    _assert_close(kept, recomputed, bound=1e-13)


def _grouped_as_layer(num_padding, gen):
    """megamoe.moe's signature through megamoe.grouped_moe (conftest.grouped_as_layer with the expert options)."""
    def layer(x, topk_ids, topk_weights, w13, w2, w3=None, b13=None, b2=None, **options):
        x_sorted, counts, scores, token_of_row = group_rows(x, topk_ids, topk_weights, w13.shape[0], num_padding, gen)
        out = megamoe.grouped_moe(x_sorted, counts, w13, w2, scores, w3=w3, b13=b13, b2=b2, **options)
        return torch.zeros_like(x).index_add(0, token_of_row, out[: token_of_row.numel()])
    return layer


GROUPED_CASES = ([(layout, "clamped", "both") for layout in LAYOUTS] +
                 [("gpt_oss", activation, bias) for activation in ACTIVATIONS for bias in BIASES])


@pytest.mark.parametrize("layout,activation,bias", GROUPED_CASES, ids=["-".join(c) for c in GROUPED_CASES])
@pytest.mark.parametrize("num_padding", [0, 3])
def test_grouped_rows_equal_the_whole_layer(layout, activation, bias, num_padding, gen):
    x, ids, s, dy, params = layout_problem(*SHAPE, LAYOUTS[layout], *BIASES[bias], routing="dropped", gen=gen)
    options = dict(layout=LAYOUTS[layout], activation=ACTIVATIONS[activation])
    whole = _grads(megamoe.moe, x, ids, s, dy, params, **options)
    grouped = _grads(_grouped_as_layer(num_padding, gen), x, ids, s, dy, params, **options)
    _assert_close(grouped, whole, what=f"{layout}/{activation}/{bias}")


def test_grouped_rows_padding_gets_no_bias(gen):
    """Padding rows are no expert's: exact zeros out and gradients, biases included."""
    E, H, I = 3, 8, 5
    x, ids, s, dy, p = layout_problem(6, H, I, E, 1, megamoe.GPT_OSS, True, True, gen=gen)
    x_sorted = x.detach()[:6].requires_grad_()
    counts, scores = torch.tensor([2, 0, 2]), torch.rand(6, dtype=torch.float64).requires_grad_()
    out = megamoe.grouped_moe(x_sorted, counts, p["w13"], p["w2"], scores, b13=p["b13"], b2=p["b2"],
                              layout=megamoe.GPT_OSS, activation=megamoe.GPT_OSS_ACTIVATION)
    dx, ds, db13, db2 = torch.autograd.grad(out, (x_sorted, scores, p["b13"], p["b2"]), dy[:6])
    assert torch.all(out[4:] == 0) and torch.all(dx[4:] == 0) and torch.all(ds[4:] == 0)
    assert torch.all(db13[1] == 0) and torch.all(db2[1] == 0) and db2[0].abs().sum() > 0


def test_backward_returns_gradients_in_the_parameters_layout_and_dtype(gen):
    """megamoe.moe_backward directly: dw13 / dw3 / dw2 shaped as their parameters, biases' gradients as theirs, all
    in f32 with wgrad_f32 (bf16 parameters)."""
    x, ids, s, dy, p = layout_problem(*SHAPE, megamoe.Layout("separate", True, True), True, True,
                                      dtype=torch.bfloat16, gen=gen)
    layout = megamoe.Layout("separate", True, True)
    with torch.no_grad():
        grads = megamoe.moe_backward(dy, x, ids, s.float(), p["w13"], p["w2"], None, True, w3=p["w3"], b13=p["b13"],
                                     b2=p["b2"], layout=layout)
    for name in PARAM_NAMES:
        grad = getattr(grads, "d" + name)
        assert grad.shape == p[name].shape and grad.dtype == torch.float32, name


def test_opcheck_with_options(gen):
    x, ids, s, dy, p = layout_problem(5, 8, 6, 4, 2, megamoe.GPT_OSS, True, True, gen=gen)
    x, s, dy = x.detach(), s.detach(), dy.detach()
    p = {name: t.detach() if t is not None else None for name, t in p.items()}
    options = dict(gate_up="interleaved", w13_transposed=True, w2_transposed=True, activation="clamped_swiglu",
                   limit=0.5, alpha=1.702)
    args = (x, ids, s, p["w13"], p["w2"])
    extras = (p["w3"], p["b13"], p["b2"])
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, (*args, False, *extras), options)
    with torch.no_grad():
        for needs in ({}, {"need_dx": False, "need_dw13": False, "need_db2": False}):
            torch.library.opcheck(torch.ops.megamoe.moe_backward.default,
                                  (dy, *args, dy.new_empty(0), False, *extras), {**options, **needs})


def test_torch_compile_fullgraph_with_options(gen):
    x, ids, s, dy, p = layout_problem(6, 8, 4, 3, 2, megamoe.GPT_OSS, True, True, gen=gen)

    def block(x, ids, s, w13, w2, b13, b2, **_):
        return megamoe.moe(torch.tanh(x), ids, s.softmax(-1), w13, w2, b13=b13, b2=b2, layout=megamoe.GPT_OSS,
                           activation=megamoe.GPT_OSS_ACTIVATION) * 2

    compiled = torch.compile(block, fullgraph=True)
    _assert_close(_grads(compiled, x, ids, s, dy, p), _grads(block, x, ids, s, dy, p))


def test_path_of_cpu_is_the_reference(gen):
    x, ids, s, _, p = layout_problem(*SHAPE, megamoe.GPT_OSS, True, True, gen=gen)
    options = dict(layout=megamoe.GPT_OSS, activation=megamoe.GPT_OSS_ACTIVATION, b13=p["b13"], b2=p["b2"])
    for backward in (False, True):
        assert megamoe.path_of(x, ids, s, p["w13"], p["w2"], backward=backward, **options) == "reference"
    x_sorted, counts = x.detach(), torch.tensor([4, 0, 3, 2, 2])
    for backward in (False, True):
        assert megamoe.grouped_path_of(x_sorted, counts, p["w13"], p["w2"], backward=backward,
                                       **options) == "reference"


SWEEP_SEED = int(os.environ.get("MEGAMOE_SWEEP_SEED", "12"))
SWEEP_CASES = int(os.environ.get("MEGAMOE_SWEEP_CASES", "24"))  # small in CI; raise it for a longer sweep


def _sweep_case(index):
    """Case `index` of the seeded sweep: E, T, topk, routing, layout, activation, biases, entry point."""
    rng = random.Random(SWEEP_SEED * 100003 + index)
    E = rng.choice([1, 2, 3, 5, 8])
    case = dict(T=rng.choice([0, 1, 2, 7, 13, 30]), H=rng.randint(1, 20), I=rng.randint(1, 12), E=E,
                topk=rng.randint(1, min(E, 4)), routing=rng.choice(["random", "dropped", "one_expert", "half_empty"]),
                layout=rng.choice(list(LAYOUTS)), activation=rng.choice(list(ACTIVATIONS)),
                bias=rng.choice(list(BIASES)), recompute=rng.random() < 0.5, grouped=rng.random() < 0.3)
    if case["routing"] == "half_empty" and E == 1:
        case["routing"] = "random"
    return case


@pytest.mark.parametrize("index", range(SWEEP_CASES))
def test_seeded_sweep(index, gen):
    """Random shapes (T = 0 included), routings (dropped slots, empty experts), layouts, activations, biases, memory
    modes and entry points against plain PyTorch float64; the case is fixed by MEGAMOE_SWEEP_SEED and its index, the
    data by the test's seed."""
    c = _sweep_case(index)
    print(c)
    layout, activation = LAYOUTS[c["layout"]], ACTIVATIONS[c["activation"]]
    x, ids, s, dy, params = layout_problem(c["T"], c["H"], c["I"], c["E"], c["topk"], layout, *BIASES[c["bias"]],
                                           routing=c["routing"], gen=gen)
    fn = _grouped_as_layer(2, gen) if c["grouped"] else megamoe.moe
    options = dict(layout=layout, activation=activation)
    ours = _grads(lambda *args, **kw: fn(*args, **kw, **({} if c["grouped"] else {"recompute": c["recompute"]})),
                  x, ids, s, dy, params, **options)
    theirs = _grads(torch_experts, x, ids, s, dy, params, **options)
    for name in theirs:
        a, b = ours[name], theirs[name]
        assert a.shape == b.shape, name
        assert rel_err(a, b) < 1e-12 or (b.abs().max() == 0 and a.abs().max() == 0), f"{c} {name}"
