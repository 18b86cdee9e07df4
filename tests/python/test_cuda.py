"""The CUDA path on a GPU: against the float64 CPU reference on the ragged set (outputs poisoned before
every run), bitwise-equal reruns, CUDA-graph capture and replay, bad ids, and the four reference shapes
against an fp32 computation on token / expert subsets. Skipped, with the reason, where no GPU is present."""

import pathlib
import sys

import pytest
import torch

import megamoe
from megamoe import _lib
from conftest import RAGGED, grads_of, make_problem, rel_err, torch_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")

OUTPUTS = ("y", "dx", "dtopk_weights", "dw13", "dw2")


def poisoned_run(x, ids, s, w13, w2, dy, keep_h=False):
    """Forward and backward through the C API into outputs filled with NaN first, so an element the
    kernels never write shows up as NaN. keep_h: the forward writes saved_h (NaN first), the backward reads it."""
    y = torch.full_like(x, float("nan"))
    dx = torch.full_like(x, float("nan"))
    ds = torch.full_like(s, float("nan"))
    dw13 = torch.full_like(w13, float("nan"))
    dw2 = torch.full_like(w2, float("nan"))
    saved_h = x.new_full((ids.numel(), 2 * w2.shape[2]), float("nan")) if keep_h else None  # [T*topk, 2I]
    _lib.forward_into(x, ids, s, w13, w2, y, saved_h)
    _lib.backward_into(dy, x, ids, s, w13, w2, dx, ds, dw13, dw2, saved_h)
    torch.cuda.synchronize()
    return [y, dx, ds, dw13, dw2]


def detached(*tensors):
    return [t.detach() for t in tensors]


def bf16_bound(err_torch_bf16):
    """Allowed error: a small multiple of what plain PyTorch bf16 errs on the same inputs."""
    return 3 * err_torch_bf16 + 1e-3


@pytest.mark.parametrize("case", RAGGED, ids=[c[0] for c in RAGGED])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_on_ragged_set(case, dtype, gen):
    _, T, H, I, E, topk, routing = case
    x, ids, s, w13, w2, dy = make_problem(T, H, I, E, topk, routing, dtype=dtype, gen=gen)
    ref = grads_of(megamoe.moe, *[t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t
                                  for t in (x, ids, s, w13, w2)], dy.double())  # CPU reference, f64
    low = grads_of(torch_moe, x, ids, s, w13, w2, dy)  # plain PyTorch in the low dtype, on the CPU
    ours = poisoned_run(*detached(*[t.cuda() for t in (x, ids, s, w13, w2, dy)]))
    for name, got, want, floor in zip(OUTPUTS, ours, ref, low):
        assert torch.isfinite(got).all(), f"{name}: unwritten (NaN) or non-finite elements"
        err, err_floor = rel_err(got, want), rel_err(floor, want)
        assert err <= bf16_bound(err_floor), f"{name}: error {err:.3e} vs torch {dtype} {err_floor:.3e}"
    again = poisoned_run(*detached(*[t.cuda() for t in (x, ids, s, w13, w2, dy)]))
    for name, first, second in zip(OUTPUTS, ours, again):
        assert torch.equal(first, second), f"{name}: two runs differ"
    kept = poisoned_run(*detached(*[t.cuda() for t in (x, ids, s, w13, w2, dy)]), keep_h=True)
    for name, recomputed, kept_h in zip(OUTPUTS, ours, kept):
        assert torch.equal(recomputed, kept_h), f"{name}: keep-h and recompute modes differ"


def test_skewed_routing_is_deterministic(gen):
    x, ids, s, w13, w2, dy = make_problem(300, 64, 96, 16, 4, "one_expert", dtype=torch.bfloat16, gen=gen)
    args = detached(*[t.cuda() for t in (x, ids, s, w13, w2, dy)])
    first, second = poisoned_run(*args), poisoned_run(*args)
    for name, a, b in zip(OUTPUTS, first, second):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name}: two runs differ"


def test_cuda_graph_replays_forward_and_backward(gen):
    x, ids, s, w13, w2, dy = detached(*[t.cuda() for t in make_problem(64, 96, 40, 8, 2, "dropped",
                                                                       dtype=torch.bfloat16, gen=gen)])
    megamoe.moe_backward(dy, x, ids, s, w13, w2)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = torch.ops.megamoe.moe_forward(x, ids, s, w13, w2, True)
        grads = megamoe.moe_backward(dy, x, ids, s, w13, w2, h)
    fresh = make_problem(64, 96, 40, 8, 2, "dropped", dtype=torch.bfloat16, gen=gen)
    for dst, src in zip((x, ids, s, w13, w2, dy), fresh):
        dst.copy_(src.detach())  # new values in the captured buffers
    graph.replay()
    torch.cuda.synchronize()
    eager = [torch.ops.megamoe.moe_forward(x, ids, s, w13, w2)[0], *megamoe.moe_backward(dy, x, ids, s, w13, w2)]
    for name, replayed, expected in zip(OUTPUTS, [y, *grads], eager):
        assert torch.equal(replayed, expected), f"{name}: replay differs from eager"


def test_autograd_through_the_op(gen):
    x, ids, s, w13, w2, dy = [t.detach().cuda().requires_grad_(t.requires_grad)
                              for t in make_problem(20, 32, 24, 4, 2, dtype=torch.bfloat16, gen=gen)]
    want = poisoned_run(*detached(x, ids, s, w13, w2, dy))
    for recompute in (False, True):
        got = grads_of(lambda *args: megamoe.moe(*args, recompute=recompute), x, ids, s, w13, w2, dy)
        for name, a, b in zip(OUTPUTS, got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name} (recompute={recompute})"


def test_weight_gradients_in_f32(gen):
    x, ids, s, w13, w2, dy = detached(*[t.cuda() for t in make_problem(40, 64, 48, 4, 2, "dropped",
                                                                       dtype=torch.bfloat16, gen=gen)])
    _, _, dw13, dw2, *_ = megamoe.moe_backward(dy, x, ids, s, w13, w2)
    _, _, dw13_f32, dw2_f32, *_ = megamoe.moe_backward(dy, x, ids, s, w13, w2, None, True)
    assert dw13_f32.dtype == dw2_f32.dtype == torch.float32
    assert torch.equal(dw13_f32.bfloat16(), dw13) and torch.equal(dw2_f32.bfloat16(), dw2)


def test_bad_ids_give_nan_rows_not_a_crash(gen):
    x, ids, s, w13, w2, dy = detached(*[t.cuda() for t in make_problem(8, 16, 8, 4, 2, dtype=torch.bfloat16,
                                                                       gen=gen)])
    ids = ids.clone()
    ids[3, 1] = 4  # == E
    ids[5, 0] = -7
    y, dx, ds, dw13, dw2 = poisoned_run(x, ids, s, w13, w2, dy)
    bad, good = [3, 5], [0, 1, 2, 4, 6, 7]
    assert torch.isnan(y[bad]).all() and torch.isfinite(y[good]).all()
    assert torch.isnan(dx[bad]).all() and torch.isfinite(dx[good]).all()
    assert torch.isnan(ds[bad]).all() and torch.isfinite(ds[good]).all()


def test_empty_batch(gen):
    x, ids, s, w13, w2, dy = detached(*[t.cuda() for t in make_problem(0, 16, 8, 4, 2, dtype=torch.bfloat16,
                                                                       gen=gen)])
    y, dx, ds, dw13, dw2 = poisoned_run(x, ids, s, w13, w2, dy)
    assert y.shape == (0, 16) and torch.all(dw13 == 0) and torch.all(dw2 == 0)


def test_cpu_only_dtypes_are_refused_on_cuda(gen):
    x, ids, s, w13, w2, _ = detached(*[t.cuda() for t in make_problem(4, 8, 4, 2, 1, dtype=torch.float32, gen=gen)])
    with pytest.raises(NotImplementedError, match="x: dtype f32 is not supported on CUDA"):
        megamoe.moe(x, ids, s, w13, w2)


BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b"])
def test_reference_shapes(shape):
    """Full-size problems; checked on 64 tokens and 4 experts (most and least loaded, two random) against an
    fp32 computation of DESIGN section 1 from the same bf16 inputs (bench/reference.py)."""
    sys.path.insert(0, str(BENCH))
    import reference
    import workloads

    case = workloads.make_case(shape, workloads.SHAPES[shape], "balanced", "cuda", seed=torch.seed() % 2**31)
    tokens, experts = workloads.check_subsets(case.ids, case.dims[3], 64)
    want = reference.reference_outputs(case, tokens, experts, torch.float32)
    got = reference.path_outputs(megamoe.moe, case, tokens, experts, backward=True)
    floor = {k: v.to(torch.bfloat16) for k, v in want.items()}  # bf16 rounding of the exact answer
    with torch.no_grad():
        y_full = megamoe.moe(case.x, case.ids, case.s, case.w13, case.w2)
    assert torch.isfinite(y_full).all()
    for name in OUTPUTS:
        err = rel_err(got[name], want[name])
        assert err <= bf16_bound(rel_err(floor[name], want[name])) + 5e-3, f"{name}: {err:.3e}"


@pytest.mark.parametrize("recompute", [False, True], ids=["keep_h", "recompute"])
def test_activation_checkpointing_gives_the_same_results(recompute, gen):
    """torch.utils.checkpoint (non-reentrant) around megamoe.moe on CUDA: bitwise the plain run (the recomputed
    forward rewrites h; the kernels are deterministic)."""
    from torch.utils.checkpoint import checkpoint

    x, ids, s, w13, w2, dy = [t.detach().cuda().requires_grad_(t.requires_grad)
                              for t in make_problem(70, 64, 48, 6, 2, "dropped", dtype=torch.bfloat16, gen=gen)]

    def block(x, ids, s, w13, w2):
        return megamoe.moe(x, ids, s, w13, w2, recompute=recompute)

    plain = grads_of(block, x, ids, s, w13, w2, dy)
    again = grads_of(lambda *a: checkpoint(block, *a, use_reentrant=False), x, ids, s, w13, w2, dy)
    for name, a, b in zip(OUTPUTS, again, plain):
        assert torch.equal(a, b), f"{name}: checkpointed differs from the plain run"
