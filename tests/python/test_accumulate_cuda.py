"""Weight gradients accumulated into f32 buffers (main_grads) on a GPU, on each kernel choice of the weight gradients:
the sm_90a K-grouped kernel (the default on Hopper), the portable one after the sm_90a GEMMs (the test override
TEST_PORTABLE_WEIGHT_GRADS) and the portable path (MEGAMOE_DISABLE_SM90=1). Ragged shapes (empty experts, one expert
taking every slot, dropped slots, sizes off tile multiples, f16), buffers filled with random values first:
buffer == previous + the same path's fresh f32 gradient (bitwise), bitwise run to run, the added gradient against the
CPU reference, empty experts untouched; the autograd path adding twice; grouped rows. Skipped, with the reason,
without a GPU (the sm_90a choices without a compute capability 9.0 device)."""

import pytest
import torch

import megamoe
from megamoe import _lib
from conftest import make_problem, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")

# (name, T, H, I, E, topk, routing, dtype); aligned: H and I multiples of 8 (else every choice runs the portable path)
CASES = [
    ("T1_E1", 1, 64, 32, 1, 1, "random", torch.bfloat16),
    ("one_expert_takes_all", 300, 136, 72, 4, 1, "one_expert", torch.bfloat16),
    ("most_experts_empty", 5, 64, 40, 64, 2, "half_empty", torch.bfloat16),
    ("dropped_tails", 37, 200, 72, 5, 2, "dropped", torch.bfloat16),
    ("k_and_n_tails", 260, 520, 200, 8, 2, "random", torch.bfloat16),
    ("long_experts_odd_pairs", 600, 712, 392, 2, 2, "random", torch.bfloat16),
    ("off_multiples_of_8", 61, 70, 33, 5, 2, "random", torch.bfloat16),
    ("f16_dropped", 97, 72, 48, 7, 2, "dropped", torch.float16),
]
# kernel choice -> (environment, test overrides, the backward path it must take on aligned shapes)
CHOICES = {
    "sm90": ({}, 0, "sm90"),
    "sm90+portable_wgrad": ({}, _lib.TEST_PORTABLE_WEIGHT_GRADS, "sm90+cuda-weight-grads"),
    "portable": ({"MEGAMOE_DISABLE_SM90": "1"}, 0, "cuda"),
}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _choose(choice, monkeypatch, overrides):
    env, flags, path = CHOICES[choice]
    if choice != "portable" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("device is not compute capability 9.0: the sm_90a kernels need a Hopper GPU")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    overrides(flags)
    return path


def _cuda_problem(case, gen):
    _, T, H, I, E, topk, routing, dtype = case
    cpu = make_problem(T, H, I, E, topk, routing, dtype=dtype, gen=gen)
    return cpu, [t.detach().cuda() for t in cpu]


def _unused_experts(ids, num_experts):
    unused = torch.ones(num_experts, dtype=torch.bool)
    unused[ids[ids >= 0].cpu()] = False
    return unused


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_accumulates_against_fresh_and_reference(case, choice, monkeypatch, overrides, gen):
    path = _choose(choice, monkeypatch, overrides)
    cpu, (x, ids, s, w13, w2, dy) = _cuda_problem(case, gen)
    if case[2] % 8 == 0 and case[3] % 8 == 0:
        assert megamoe.path_of(x, ids, s, w13, w2, backward=True) == path
    previous13 = torch.randn(w13.shape, generator=gen).cuda()
    previous2 = torch.randn(w2.shape, generator=gen).cuda()
    fresh = megamoe.moe_backward(dy, x, ids, s, w13, w2, None, True)
    runs = []
    for _ in range(2):
        buf13, buf2 = previous13.clone(), previous2.clone()
        grads = megamoe.moe_backward(dy, x, ids, s, w13, w2, main_grads=(buf13, buf2))
        assert grads.dw13 is buf13 and grads.dw2 is buf2
        runs.append((buf13, buf2))
    torch.cuda.synchronize()
    (buf13, buf2), (again13, again2) = runs
    assert torch.equal(buf13, again13) and torch.equal(buf2, again2), "accumulation differs run to run"
    assert torch.equal(buf13, previous13 + fresh.dw13), "dw13 != previous + this path's fresh gradient"
    assert torch.equal(buf2, previous2 + fresh.dw2), "dw2 != previous + this path's fresh gradient"
    reference = megamoe.moe_backward(*(cpu[5], *cpu[:5]), None, True)
    bound = TOLERANCE[case[7]]
    assert rel_err((buf13 - previous13).cpu().double(), reference.dw13.double()) < bound
    assert rel_err((buf2 - previous2).cpu().double(), reference.dw2.double()) < bound
    unused = _unused_experts(ids, w13.shape[0]).cuda()
    assert torch.equal(buf13[unused], previous13[unused]) and torch.equal(buf2[unused], previous2[unused])


@pytest.mark.parametrize("choice", list(CHOICES))
def test_empty_batch_leaves_the_buffers_untouched(choice, monkeypatch, overrides, gen):
    _choose(choice, monkeypatch, overrides)
    _, (x, ids, s, w13, w2, dy) = _cuda_problem(("empty", 0, 64, 32, 3, 2, "random", torch.bfloat16), gen)
    buf13, buf2 = torch.randn(w13.shape, generator=gen).cuda(), torch.randn(w2.shape, generator=gen).cuda()
    before13, before2 = buf13.clone(), buf2.clone()
    megamoe.moe_backward(dy, x, ids, s, w13, w2, main_grads=(buf13, buf2))
    assert torch.equal(buf13, before13) and torch.equal(buf2, before2)


@pytest.mark.parametrize("choice", list(CHOICES))
def test_autograd_main_grads_add_twice(choice, monkeypatch, overrides, gen):
    _choose(choice, monkeypatch, overrides)
    _, (x, ids, s, w13, w2, dy) = _cuda_problem(CASES[2], gen)
    fresh = megamoe.moe_backward(dy, x, ids, s, w13, w2, None, True)
    buf13, buf2 = torch.randn(w13.shape, generator=gen).cuda(), torch.randn(w2.shape, generator=gen).cuda()
    before13, before2 = buf13.clone(), buf2.clone()
    x_leaf, w13_leaf, w2_leaf = (t.clone().requires_grad_() for t in (x, w13, w2))
    first = megamoe.moe(x_leaf, ids, s, w13_leaf, w2_leaf, main_grads=(buf13, buf2))
    second = megamoe.moe(x_leaf, ids, s, w13_leaf, w2_leaf, main_grads=(buf13, buf2))
    first.backward(dy)
    second.backward(dy)
    assert w13_leaf.grad is None and w2_leaf.grad is None
    assert torch.equal(buf13, before13 + fresh.dw13 + fresh.dw13)
    assert torch.equal(buf2, before2 + fresh.dw2 + fresh.dw2)


@pytest.mark.parametrize("choice", list(CHOICES))
def test_grouped_rows_accumulate(choice, monkeypatch, overrides, gen):
    _choose(choice, monkeypatch, overrides)
    counts = torch.tensor([5, 0, 300, 0, 17], device="cuda")
    R, H, I, E = 340, 136, 72, 5
    x = (torch.randn(R, H, generator=gen) * 0.5).bfloat16().cuda()
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).bfloat16().cuda()
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).bfloat16().cuda()
    scores = (torch.rand(R, generator=gen) + 0.05).cuda()
    dout = torch.randn(R, H, generator=gen).bfloat16().cuda()
    fresh = megamoe.grouped_backward(dout, x, counts, w13, w2, scores, None, True)
    buf13, buf2 = torch.randn(w13.shape, generator=gen).cuda(), torch.randn(w2.shape, generator=gen).cuda()
    before13, before2 = buf13.clone(), buf2.clone()
    megamoe.grouped_backward(dout, x, counts, w13, w2, scores, main_grads=(buf13, buf2))
    assert torch.equal(buf13, before13 + fresh.dw13) and torch.equal(buf2, before2 + fresh.dw2)
    assert torch.equal(buf13[[1, 3]], before13[[1, 3]]) and torch.equal(buf2[[1, 3]], before2[[1, 3]])
