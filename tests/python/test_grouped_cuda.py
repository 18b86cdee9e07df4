"""Grouped rows on a GPU: equal to the whole layer on the same math (the slots sorted by expert, scores = their
topk_weights, rows added back into their tokens) on ragged shapes (sizes off tile multiples, H = 72, I = 40, E = 5,
an empty expert, one expert taking every row, dropped slots, padding rows, sizes off multiples of 8), in both memory
modes (bitwise equal to each other), on the default path and with MEGAMOE_DISABLE_SM90=1 (the two agree); padding
rows exactly zero; invalid counts give NaN, not a fault; CUDA-graph replay; mixed devices. Skipped, with the reason,
where no GPU is present."""

import pytest
import torch

import megamoe
from conftest import grads_of, grouped_as_layer, make_problem, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")

OUTPUTS = ("y", "dx", "dtopk_weights", "dw13", "dw2")
GROUPED_OUTPUTS = ("out", "dx_sorted", "dscores", "dw13", "dw2")
# Grouped rows against the whole layer, and one path against the other, in bf16 / f16: the same GEMMs on the same
# sorted rows; grouped rows round each row's s_r o_r before the rows are added back (the whole layer adds in f32
# first). A real fault (a wrong row, expert, score or gather) gives errors of order 1.
AGREEMENT = 1e-2

# (name, T, H, I, E, topk, routing, padding rows, dtype)
GPU_CASES = [
    ("H72_I40_E5_empty_experts", 150, 72, 40, 5, 2, "half_empty", 5, torch.bfloat16),
    ("one_expert_takes_all", 200, 72, 40, 5, 1, "one_expert", 0, torch.bfloat16),
    ("dropped_slots_padding", 97, 72, 48, 7, 3, "dropped", 9, torch.bfloat16),
    ("off_multiples_of_8", 61, 70, 33, 5, 2, "random", 3, torch.bfloat16),
    ("several_m_tiles", 300, 136, 72, 6, 2, "random", 1, torch.bfloat16),
    ("f16", 90, 72, 40, 5, 2, "dropped", 4, torch.float16),
]


def cuda_problem(case, gen):
    _, T, H, I, E, topk, routing, _, dtype = case
    return [t.detach().cuda().requires_grad_(t.requires_grad)
            for t in make_problem(T, H, I, E, topk, routing, dtype=dtype, gen=gen)]


def check_close(got, want, names, bound, what):
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {name}"
        assert torch.isfinite(a).all(), f"{what}: {name} has non-finite elements"
        err = rel_err(a, b)
        assert err < bound, f"{what}: {name} error {err:.3e}"


@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
@pytest.mark.parametrize("portable", [False, True], ids=["default", "MEGAMOE_DISABLE_SM90"])
def test_grouped_rows_equal_the_whole_layer(case, portable, monkeypatch, gen):
    if portable:
        monkeypatch.setenv("MEGAMOE_DISABLE_SM90", "1")
    num_padding = case[7]
    x, ids, s, w13, w2, dy = cuda_problem(case, gen)
    whole = grads_of(megamoe.moe, x, ids, s, w13, w2, dy)
    kept = grads_of(grouped_as_layer(num_padding, gen=gen), x, ids, s, w13, w2, dy)
    check_close(kept, whole, OUTPUTS, AGREEMENT, "grouped rows (keep h) vs the whole layer")
    recomputed = grads_of(grouped_as_layer(num_padding, recompute=True, gen=gen), x, ids, s, w13, w2, dy)
    for name, a, b in zip(OUTPUTS, recomputed, kept):
        assert torch.equal(a, b), f"{name}: recompute and keep-h modes differ"
    again = grads_of(grouped_as_layer(num_padding, gen=gen), x, ids, s, w13, w2, dy)
    for name, a, b in zip(OUTPUTS, again, kept):
        assert torch.equal(a, b), f"{name}: two runs differ"


def _grouped_leaves(R, H, I, counts, gen, dtype=torch.bfloat16):
    E = len(counts)
    x = (torch.randn(R, H, generator=gen) * 0.5).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
    scores = torch.rand(R, generator=gen) + 0.05
    dout = torch.randn(R, H, generator=gen).to(dtype)
    tensors = [t.cuda() for t in (x, w13, w2, scores, dout)]
    for t in tensors[:4]:
        t.requires_grad_(True)
    x, w13, w2, scores, dout = tensors
    return x, torch.tensor(counts, device="cuda"), w13, w2, scores, dout


def _grouped_grads(x, counts, w13, w2, scores, dout, recompute=False):
    for t in (x, w13, w2, scores):
        t.grad = None
    out = megamoe.grouped_moe(x, counts, w13, w2, scores, recompute=recompute)
    out.backward(dout)
    grads = [out.detach()] + [t.grad.detach().clone() for t in (x, scores, w13, w2)]
    for t in (x, w13, w2, scores):
        t.grad = None
    return grads


@pytest.mark.parametrize("H,I", [(72, 40), (70, 33)], ids=["sm90_sizes", "portable_sizes"])
def test_padding_rows_empty_experts_and_paths(H, I, monkeypatch, gen):
    """Rows past the counts' sum are exact zeros (out, d x_sorted, d scores), experts without rows get zero weight
    gradients, and the default path agrees with MEGAMOE_DISABLE_SM90=1."""
    counts = [40, 0, 57, 33, 12]  # 142 rows, 8 padding rows; expert 1 empty
    x, n, w13, w2, scores, dout = _grouped_leaves(150, H, I, counts, gen)
    default = _grouped_grads(x, n, w13, w2, scores, dout)
    out, dx, ds, dw13, dw2 = default
    assert torch.all(out[142:] == 0) and torch.all(dx[142:] == 0) and torch.all(ds[142:] == 0)
    assert torch.all(dw13[1] == 0) and torch.all(dw2[1] == 0)
    monkeypatch.setenv("MEGAMOE_DISABLE_SM90", "1")
    portable = _grouped_grads(x, n, w13, w2, scores, dout)
    check_close(default, portable, GROUPED_OUTPUTS, AGREEMENT, "default path vs MEGAMOE_DISABLE_SM90=1")
    assert torch.all(portable[0][142:] == 0) and torch.all(portable[1][142:] == 0)


def test_every_row_in_one_expert(gen):
    x, n, w13, w2, scores, dout = _grouped_leaves(300, 72, 40, [0, 0, 300, 0, 0], gen)
    got = _grouped_grads(x, n, w13, w2, scores, dout)
    wide = [t.detach().double().cpu().requires_grad_() for t in (x, w13, w2, scores)]
    ref = megamoe.grouped_moe(wide[0], n.cpu(), wide[1], wide[2], wide[3])  # the CPU reference in f64
    ref.backward(dout.double().cpu())
    want = [ref.detach(), wide[0].grad, wide[3].grad, wide[1].grad, wide[2].grad]
    check_close([g.double().cpu() for g in got], want, GROUPED_OUTPUTS, 2e-2, "vs the f64 CPU reference")
    assert torch.all(got[3][[0, 1, 3, 4]] == 0) and torch.all(got[4][[0, 1, 3, 4]] == 0)


@pytest.mark.parametrize("counts", [[60, -1, 20], [60, 50, 10], [2**31 - 1, 1, 0]],
                         ids=["negative", "sum_past_R", "huge"])
@pytest.mark.parametrize("portable", [False, True], ids=["default", "MEGAMOE_DISABLE_SM90"])
def test_invalid_counts_give_nan_not_a_fault(counts, portable, monkeypatch, gen):
    if portable:
        monkeypatch.setenv("MEGAMOE_DISABLE_SM90", "1")
    x, _, w13, w2, scores, dout = _grouped_leaves(100, 72, 40, [50, 30, 20], gen)
    n = torch.tensor(counts, dtype=torch.int32, device="cuda")
    for name, value in zip(GROUPED_OUTPUTS, _grouped_grads(x, n, w13, w2, scores, dout)):
        assert torch.isnan(value).all(), f"{name}: not NaN everywhere"
    torch.cuda.synchronize()  # no fault
    good = _grouped_grads(x, torch.tensor([50, 30, 20], device="cuda"), w13, w2, scores, dout)
    assert all(torch.isfinite(g).all() for g in good)


def test_cuda_graph_replays_forward_and_backward(gen):
    x, n, w13, w2, scores, dout = [t.detach() for t in _grouped_leaves(130, 72, 40, [30, 0, 60, 35, 0], gen)]
    megamoe.grouped_backward(dout, x, n, w13, w2, scores)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, h = torch.ops.megamoe.grouped_forward(x, n, w13, w2, scores, True)
        grads = megamoe.grouped_backward(dout, x, n, w13, w2, scores, h)
    fresh = _grouped_leaves(130, 72, 40, [10, 50, 0, 40, 25], gen)  # new values, new counts (5 padding rows)
    for dst, src in zip((x, n, w13, w2, scores, dout), fresh):
        dst.copy_(src.detach())
    graph.replay()
    torch.cuda.synchronize()
    eager = [torch.ops.megamoe.grouped_forward(x, n, w13, w2, scores)[0],
             *megamoe.grouped_backward(dout, x, n, w13, w2, scores)]
    for name, replayed, expected in zip(GROUPED_OUTPUTS, [out, *grads], eager):
        assert torch.equal(replayed, expected), f"{name}: replay differs from eager"
    assert torch.all(out[125:] == 0)


def test_counts_on_another_device_are_refused(gen):
    x, n, w13, w2, scores, _ = [t.detach() for t in _grouped_leaves(10, 72, 40, [4, 6], gen)]
    with pytest.raises(ValueError, match="tokens_per_expert: on cpu:0 but x_sorted is on cuda:0"):
        megamoe.grouped_moe(x, n.cpu(), w13, w2, scores)
