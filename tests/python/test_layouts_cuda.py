"""The layouts on a GPU: every layout x activation x bias combination runs on CUDA tensors (on a Hopper GPU the fused
sm_90a kernels, which take every option, the separate layout included, and again on the portable kernels with
MEGAMOE_DISABLE_SM90=1; the path asserted) and matches the CPU float64 reference on the same bf16 values, whole layer
and grouped rows, every gradient, with every output NaN-poisoned before the run, reruns bitwise equal and the memory
modes bitwise equal to each other. The backward's reference reads the CUDA forward's h (so that the clamps of the
activation decide alike on both sides). path_of reports sm90 for the options the sm_90a kernels take (all of them) and
names what keeps a call off them (a misaligned w3), a one-time warning says so, and only the needed gradients are
computed.
Skipped, with the reason, where no GPU is present."""

import os
import random
import warnings

import pytest
import torch

import megamoe
from megamoe import _lib
from conftest import group_rows, rel_err
from layout_models import ACTIVATIONS, BIASES, COMBINATIONS, LAYOUTS, layout_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")

SHAPE = (37, 72, 40, 5, 2)  # T, H, I, E, topk: tails off every tile, dropped slots
I = SHAPE[2]
BF16_TOLERANCE = 2e-2  # as the C++ CUDA tests (kBf16Tolerance): a few bf16 roundings of the intermediates
GRAD_NAMES = ("dx", "dtopk_weights", "dw13", "dw3", "dw2", "db13", "db2")
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _cuda_problem(layout, biases, gen, shape=SHAPE, routing="dropped"):
    x, ids, s, dy, p = layout_problem(*shape, layout, *biases, routing=routing, dtype=torch.bfloat16, gen=gen)
    move = lambda t: t.detach().cuda() if t is not None else None  # noqa: E731
    return move(x), ids.cuda(), move(s).float(), move(dy), {name: move(t) for name, t in p.items()}


def _same_bits(a, b):
    """Bitwise equality (NaN rows left unwritten, e.g. saved_h past the routed rows, compare equal)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def _nan_like(t):
    return torch.full_like(t, float("nan")) if t is not None else None


def _run(x, ids, s, dy, p, options, h_in=None, keep_h=True, poison=True):
    """Forward (saved_h when keep_h) and backward through the C API into NaN-filled outputs; the backward reads h_in
    when given (the reference: the CUDA forward's h), else the forward's h. Returns y, the forward's h and the
    gradients by name."""
    fill = _nan_like if poison else torch.zeros_like
    experts = dict(w3=p["w3"], b13=p["b13"], b2=p["b2"])
    y = fill(x)
    two_i = 2 * (p["w2"].numel() // (p["w2"].shape[0] * x.shape[1]))  # w2 [E, H, I] or [E, I, H]
    h = x.new_full((ids.numel(), two_i), float("nan")) if keep_h else None
    _lib.forward_into(x, ids, s, p["w13"], p["w2"], y, h, options, **experts)
    h_fwd = h.clone() if h is not None else None
    saved = h_in.clone() if h_in is not None else h
    grads = dict(dx=fill(x), dtopk_weights=fill(s), dw13=fill(p["w13"]), dw3=_nan_like(p["w3"]), dw2=fill(p["w2"]),
                 db13=_nan_like(p["b13"]), db2=_nan_like(p["b2"]))
    _lib.backward_into(dy, x, ids, s, p["w13"], p["w2"], grads["dx"], grads["dtopk_weights"], grads["dw13"],
                       grads["dw2"], saved, options, dw3=grads["dw3"], db13=grads["db13"], db2=grads["db2"], **experts)
    if x.is_cuda:
        torch.cuda.synchronize()
    return y, h_fwd, grads


def _cpu64(tensors):
    return {k: (v.detach().cpu().double() if v is not None and v.is_floating_point() else
                (v.cpu() if v is not None else None)) for k, v in tensors.items()}


def _check_all_close(got, want, what):
    for name, value in want.items():
        if value is None:
            assert got[name] is None, f"{what}: {name}"
            continue
        assert torch.isfinite(got[name]).all(), f"{what}: {name} has unwritten (NaN) or non-finite elements"
        err = rel_err(got[name], value)
        assert err < BF16_TOLERANCE, f"{what}: {name} error {err:.3e}"


def _expect_path(layout, x, ids, s, p, activation, portable):
    """sm90 where the sm_90a kernels take the options (every layout; SHAPE's H and I are multiples of 8) on a Hopper GPU,
    unless MEGAMOE_DISABLE_SM90; else the portable kernels."""
    experts = dict(w3=p["w3"], b13=p["b13"], b2=p["b2"], layout=LAYOUTS[layout], activation=ACTIVATIONS[activation])
    sm90 = SM90 and not portable
    assert megamoe.path_of(x, ids, s, p["w13"], p["w2"], **experts) == ("sm90" if sm90 else "cuda")
    assert megamoe.path_of(x, ids, s, p["w13"], p["w2"], backward=True, **experts) in (
        ("sm90", "sm90+cuda-weight-grads") if sm90 else ("cuda",))


def _check_layer(x, ids, s, dy, p, options, what):
    """The whole layer on CUDA (keep-h) against the CPU float64 reference on the same values (its backward reading the
    CUDA forward's h), then recompute mode bitwise equal to keep-h on CUDA (h rounded alike in both). Returns the
    forward's y and h and the keep-h gradients."""
    y, h, grads = _run(x, ids, s, dy, p, options)
    c = _cpu64(dict(x=x, s=s, dy=dy, h=h, **p))
    y_ref, _, ref = _run(c["x"], ids.cpu(), c["s"], c["dy"], {k: c[k] for k in p}, options, h_in=c["h"],
                         poison=False)
    _check_all_close({"y": y, **grads}, {"y": y_ref, **ref}, what)
    _, _, recomputed = _run(x, ids, s, dy, p, options, keep_h=False)
    for name in GRAD_NAMES:
        if grads[name] is not None and x.is_cuda:  # the CPU reference recomputes h unrounded
            assert _same_bits(recomputed[name], grads[name]), f"{what}: {name} keep-h and recompute differ"
    return y, h, grads


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("layout,activation,bias", COMBINATIONS, ids=["-".join(c) for c in COMBINATIONS])
def test_every_combination_matches_the_reference(layout, activation, bias, portable, gen, monkeypatch):
    if portable:
        monkeypatch.setenv("MEGAMOE_DISABLE_SM90", "1")
    x, ids, s, dy, p = _cuda_problem(LAYOUTS[layout], BIASES[bias], gen)
    _expect_path(layout, x, ids, s, p, activation, portable)
    options = megamoe.layouts.op_options(LAYOUTS[layout], ACTIVATIONS[activation])
    what = f"{layout}/{activation}/{bias}"
    y, h, grads = _check_layer(x, ids, s, dy, p, options, what)
    y2, h2, again = _run(x, ids, s, dy, p, options)
    assert _same_bits(y2, y) and _same_bits(h2, h), f"{what}: the forward's rerun differs"
    for name in GRAD_NAMES:
        if grads[name] is not None:
            assert _same_bits(again[name], grads[name]), f"{what}: {name} rerun differs"


def _grouped_run(x_sorted, counts, scores, dout, p, options, h_in=None, poison=True):
    fill = _nan_like if poison else torch.zeros_like
    experts = dict(w3=p["w3"], b13=p["b13"], b2=p["b2"])
    out = fill(x_sorted)
    two_i = 2 * (p["w2"].numel() // (p["w2"].shape[0] * x_sorted.shape[1]))
    h = x_sorted.new_full((x_sorted.shape[0], two_i), float("nan"))
    _lib.grouped_forward_into(x_sorted, counts, scores, p["w13"], p["w2"], out, h, options, **experts)
    h_fwd = h.clone()
    grads = dict(dx=fill(x_sorted), dtopk_weights=fill(scores), dw13=fill(p["w13"]), dw3=_nan_like(p["w3"]),
                 dw2=fill(p["w2"]), db13=_nan_like(p["b13"]), db2=_nan_like(p["b2"]))
    _lib.grouped_backward_into(dout, x_sorted, counts, scores, p["w13"], p["w2"], grads["dx"], grads["dtopk_weights"],
                               grads["dw13"], grads["dw2"], h_in.clone() if h_in is not None else h, options,
                               dw3=grads["dw3"], db13=grads["db13"], db2=grads["db2"], **experts)
    if x_sorted.is_cuda:
        torch.cuda.synchronize()
    return out, h_fwd, grads


WIDE = (200, 264, 200, 2, 2)  # sm_90a: two n-tiles of gate / up pairs and of H, M tiles in shared-B pairs
WIDE_CASES = [(layout, "clamped", "both") for layout in LAYOUTS] + [("gpt_oss", "swiglu", "none")]


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("layout,activation,bias", WIDE_CASES, ids=["-".join(c) for c in WIDE_CASES])
def test_wide_shape_matches_the_reference(layout, activation, bias, portable, gen, monkeypatch):
    """I and H past one tile (the second n-tile's gate / up columns, biases and pairs), every layout."""
    if portable:
        monkeypatch.setenv("MEGAMOE_DISABLE_SM90", "1")
    x, ids, s, dy, p = _cuda_problem(LAYOUTS[layout], BIASES[bias], gen, shape=WIDE, routing="random")
    _expect_path(layout, x, ids, s, p, activation, portable)
    options = megamoe.layouts.op_options(LAYOUTS[layout], ACTIVATIONS[activation])
    _check_layer(x, ids, s, dy, p, options, f"wide {layout}/{activation}/{bias}")


GROUPED_CASES = ([(layout, "clamped_tight", "both") for layout in LAYOUTS] +
                 [("gpt_oss", activation, bias) for activation in ACTIVATIONS for bias in BIASES])


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("layout,activation,bias", GROUPED_CASES, ids=["-".join(c) for c in GROUPED_CASES])
def test_grouped_rows_match_the_reference(layout, activation, bias, portable, gen, monkeypatch):
    """Rows sorted by expert with an empty expert (dropped slots: some experts get none) and 3 padding rows."""
    if portable:
        monkeypatch.setenv("MEGAMOE_DISABLE_SM90", "1")
    x, ids, s, dy, p = _cuda_problem(LAYOUTS[layout], BIASES[bias], gen)
    x_sorted, counts, scores, _ = group_rows(x, ids, s, SHAPE[3], num_padding=3, gen=gen)
    counts = counts.cuda()
    dout = torch.randn(x_sorted.shape, generator=gen).to(x_sorted.dtype).cuda()
    options = megamoe.layouts.op_options(LAYOUTS[layout], ACTIVATIONS[activation])
    out, h, grads = _grouped_run(x_sorted, counts, scores, dout, p, options)
    c = _cpu64(dict(x_sorted=x_sorted, scores=scores, dout=dout, h=h, **p))
    out_ref, _, ref = _grouped_run(c["x_sorted"], counts.cpu(), c["scores"], c["dout"], {k: c[k] for k in p},
                                   options, h_in=c["h"], poison=False)
    what = f"grouped {layout}/{activation}/{bias}"
    _check_all_close({"out": out, **grads}, {"out": out_ref, **ref}, what)
    rows = int(counts.sum())
    assert torch.all(out[rows:] == 0) and torch.all(grads["dx"][rows:] == 0), f"{what}: padding rows"
    out2, _, again = _grouped_run(x_sorted, counts, scores, dout, p, options)
    assert _same_bits(out2, out), f"{what}: out rerun differs"
    for name in GRAD_NAMES:
        if grads[name] is not None:
            assert _same_bits(again[name], grads[name]), f"{what}: {name} rerun differs"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_autograd_through_the_ops_on_cuda(layout, gen):
    """megamoe.moe and megamoe.grouped_moe with gpt-oss's activation and both biases, differentiated on CUDA, against
    the CPU float64 op; the gradients come back in each parameter's layout and dtype."""
    x, ids, s, dy, p = _cuda_problem(LAYOUTS[layout], (True, True), gen)
    options = dict(layout=LAYOUTS[layout], activation=megamoe.GPT_OSS_ACTIVATION)
    leaves = {"x": x, "topk_weights": s, **{k: v for k, v in p.items() if v is not None}}
    for t in leaves.values():
        t.requires_grad_(True)
    c = {k: v.detach().cpu().double().requires_grad_() for k, v in leaves.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = megamoe.moe(x, ids, s, **{k: leaves.get(k) for k in p}, **options)
    got = torch.autograd.grad(y, list(leaves.values()), dy)
    y_ref = megamoe.moe(c["x"], ids.cpu(), c["topk_weights"], **{k: c.get(k) for k in p}, **options)
    want = torch.autograd.grad(y_ref, list(c.values()), dy.cpu().double())
    assert rel_err(y, y_ref) < BF16_TOLERANCE
    for name, a, b, leaf in zip(leaves, got, want, leaves.values()):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape, name
        assert rel_err(a, b) < BF16_TOLERANCE, f"{layout}: {name} error {rel_err(a, b):.3e}"


# (id, layout, activation, biases, what the reason names: None where the sm_90a kernels take the options; a
# misaligned w3, one element past its storage's start, is what keeps the separate layout off them)
OPTION_CASES = [
    ("separate", megamoe.SEPARATE, megamoe.SWIGLU, (False, False), None),
    ("separate_gpt_oss", megamoe.Layout("separate", True, True), megamoe.GPT_OSS_ACTIVATION, (True, True), None),
    ("separate_misaligned_w3", megamoe.SEPARATE, megamoe.SWIGLU, (False, False), "w3 not 16-byte aligned"),
    ("separate_gpt_oss_misaligned_w3", megamoe.Layout("separate", True, True), megamoe.GPT_OSS_ACTIVATION,
     (True, True), "w3 not 16-byte aligned"),
    ("interleaved", megamoe.INTERLEAVED, megamoe.SWIGLU, (False, False), None),
    ("hf_transposed", megamoe.HF_TRANSPOSED, megamoe.SWIGLU, (False, False), None),
    ("w2_transposed", megamoe.Layout("concatenated", False, True), megamoe.SWIGLU, (False, False), None),
    ("clamped", megamoe.CONCATENATED, megamoe.GPT_OSS_ACTIVATION, (False, False), None),
    ("b13", megamoe.CONCATENATED, megamoe.SWIGLU, (True, False), None),
    ("b2", megamoe.CONCATENATED, megamoe.SWIGLU, (False, True), None),
    ("gpt_oss", megamoe.GPT_OSS, megamoe.GPT_OSS_ACTIVATION, (True, True), None),
]

ALIGNED = (64, 64, 32, 4, 2)  # sizes the sm_90a kernels take


def _misaligned_copy(t):
    """t's values in a contiguous tensor one element past its storage's start (2 bytes: not 16-byte aligned)."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = storage[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("name,layout,activation,biases,text", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_path_of_names_the_portable_path_and_the_option(name, layout, activation, biases, text, gen):
    x, ids, s, _, p = _cuda_problem(layout, biases, gen, shape=ALIGNED, routing="random")
    if name.endswith("misaligned_w3"):
        p["w3"] = _misaligned_copy(p["w3"])
    experts = dict(w3=p["w3"], b13=p["b13"], b2=p["b2"], layout=layout, activation=activation)
    counts = torch.tensor([32, 32, 32, 32], device="cuda")
    paths = [megamoe.path_of(x, ids, s, p["w13"], p["w2"], **experts),
             megamoe.path_of(x, ids, s, p["w13"], p["w2"], backward=True, **experts),
             megamoe.grouped_path_of(x.repeat(2, 1), counts, p["w13"], p["w2"], **experts),
             megamoe.grouped_path_of(x.repeat(2, 1), counts, p["w13"], p["w2"], backward=True, **experts)]
    for path in paths:
        if text is None:  # on sm_90a where the GPU is a Hopper one
            assert path in (("sm90", "sm90+cuda-weight-grads") if SM90 else ("cuda",)), path
            assert path.reason is None
            continue
        assert path == "cuda"
        if SM90:
            assert path.reason is not None and text in path.reason, path.reason
            assert "portable CUDA kernels" in path.reason
        else:
            assert path.reason is None  # not a Hopper GPU: the option is not what keeps it off sm_90a
    _lib._checked_portable.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megamoe.moe(x, ids, s, p["w13"], p["w2"], **experts)
        megamoe.moe(x, ids, s, p["w13"], p["w2"], **experts)
    said = [str(w.message) for w in caught if "portable CUDA kernels" in str(w.message)]
    assert len(said) == (1 if SM90 and text is not None else 0), said
    assert all(text in message for message in said), said


def test_path_of_the_default_on_cuda(gen):
    x, ids, s, _, p = _cuda_problem(megamoe.CONCATENATED, (False, False), gen, shape=ALIGNED, routing="random")
    forward = megamoe.path_of(x, ids, s, p["w13"], p["w2"])
    assert forward == ("sm90" if SM90 else "cuda") and forward.reason is None
    assert megamoe.path_of(x, ids, s, p["w13"], p["w2"], backward=True) in (
        ("sm90", "sm90+cuda-weight-grads") if SM90 else ("cuda",))
    counts = torch.tensor([32, 32, 32, 32], device="cuda")
    assert megamoe.grouped_path_of(x.repeat(2, 1), counts, p["w13"], p["w2"]) == ("sm90" if SM90 else "cuda")


@pytest.mark.parametrize("layout", ["concatenated", "gpt_oss", "separate_transposed"])
def test_frozen_experts_skip_the_weight_gradients_on_cuda(layout, gen):
    """dx and d topk_weights of a frozen-experts backward equal the full backward's, bitwise (the skipped GEMMs and
    column sums run after them or not at all)."""
    x, ids, s, dy, p = _cuda_problem(LAYOUTS[layout], (True, True), gen)
    options = dict(layout=LAYOUTS[layout], activation=megamoe.GPT_OSS_ACTIVATION)
    x.requires_grad_(), s.requires_grad_()
    frozen = torch.autograd.grad(megamoe.moe(x, ids, s, **p, **options), (x, s), dy)
    weights = {k: v.requires_grad_() if v is not None else None for k, v in p.items()}
    full = torch.autograd.grad(megamoe.moe(x, ids, s, **weights, **options),
                               (x, s, *[v for v in weights.values() if v is not None]), dy)
    for a, b in zip(frozen, full):
        assert torch.equal(a, b)


def test_accumulated_weight_gradients_with_options_on_cuda(gen):
    """main_grads with gpt-oss's layout, activation and biases: every backward adds the gradient into the f32
    buffers (the first backward's buffers, added once more, equal twice the gradient up to f32 rounding)."""
    x, ids, s, dy, p = _cuda_problem(megamoe.GPT_OSS, (True, True), gen)
    options = dict(layout=megamoe.GPT_OSS, activation=megamoe.GPT_OSS_ACTIVATION)
    weights = {k: v.requires_grad_() for k, v in p.items() if v is not None}
    fresh = torch.autograd.grad(megamoe.moe(x, ids, s, **weights, **options), list(weights.values()), dy)
    buffers = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in weights.items()}
    for _ in range(2):
        megamoe.moe(x, ids, s, **weights, **options, main_grads=buffers).backward(dy)
    for (name, buffer), grad in zip(buffers.items(), fresh):
        assert rel_err(buffer, 2 * grad.float()) < BF16_TOLERANCE, name


GPU_SWEEP_SEED = int(os.environ.get("MEGAMOE_SWEEP_SEED", "12"))
GPU_SWEEP_CASES = int(os.environ.get("MEGAMOE_GPU_SWEEP_CASES", "32"))  # raise it for a longer sweep


def _gpu_sweep_case(index):
    """Case `index` of the GPU sweep: larger than the CPU sweep's (tiles and their tails), H and I multiples of 8 in
    half the cases (the sm_90a kernels' condition) and any size in the others (the portable kernels)."""
    rng = random.Random(GPU_SWEEP_SEED * 100019 + index)
    aligned = rng.random() < 0.5
    size = (lambda lo, hi: 8 * rng.randint(lo // 8, hi // 8)) if aligned else rng.randint
    E = rng.choice([1, 2, 3, 5, 8, 16])
    case = dict(T=rng.choice([0, 1, 3, 17, 64, 150, 300]), H=size(8, 272), I=size(8, 208), E=E,
                topk=rng.randint(1, min(E, 4)), routing=rng.choice(["random", "dropped", "one_expert", "half_empty"]),
                layout=rng.choice(list(LAYOUTS)), activation=rng.choice(list(ACTIVATIONS)),
                bias=rng.choice(list(BIASES)))
    if case["routing"] == "half_empty" and E == 1:
        case["routing"] = "random"
    return case


@pytest.mark.parametrize("index", range(GPU_SWEEP_CASES))
def test_seeded_sweep_on_cuda(index, gen):
    """Random shapes (T = 0 and tails off every tile included), routings, layouts, activations, biases and memory
    modes on CUDA against the CPU float64 reference on the same bf16 values (_check_layer), outputs NaN-poisoned;
    the case is fixed by MEGAMOE_SWEEP_SEED and its index, the data by the test's seed; the path is whichever the
    call takes (printed)."""
    c = _gpu_sweep_case(index)
    x, ids, s, dy, p = _cuda_problem(LAYOUTS[c["layout"]], BIASES[c["bias"]], gen,
                                     shape=(c["T"], c["H"], c["I"], c["E"], c["topk"]), routing=c["routing"])
    experts = dict(w3=p["w3"], b13=p["b13"], b2=p["b2"], layout=LAYOUTS[c["layout"]],
                   activation=ACTIVATIONS[c["activation"]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        print(c, "path:", megamoe.path_of(x, ids, s, p["w13"], p["w2"], **experts))
    options = megamoe.layouts.op_options(LAYOUTS[c["layout"]], ACTIVATIONS[c["activation"]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _check_layer(x, ids, s, dy, p, options, str(c))
