"""The layouts on a GPU: CUDA runs only the default layout, SwiGLU and no biases for now, so every other option on CUDA
tensors raises NotImplementedError naming it, from the op and from the path query alike (never a silent fallback),
while the default reports the kernels it runs; and only the needed gradients are computed there too. Skipped, with
the reason, where no GPU is present."""

import pytest
import torch

import megamoe
from layout_models import layout_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")

# (id, layout, activation, biases, what the message names)
UNSUPPORTED = [
    ("separate", megamoe.SEPARATE, megamoe.SWIGLU, (False, False), "layout.gate_up: separate w1 / w3"),
    ("interleaved", megamoe.INTERLEAVED, megamoe.SWIGLU, (False, False), "layout.gate_up: interleaved"),
    ("hf_transposed", megamoe.HF_TRANSPOSED, megamoe.SWIGLU, (False, False), "layout.w13_transposed"),
    ("w2_transposed", megamoe.Layout("concatenated", False, True), megamoe.SWIGLU, (False, False),
     "layout.w2_transposed"),
    ("clamped", megamoe.CONCATENATED, megamoe.GPT_OSS_ACTIVATION, (False, False), "activation.kind: clamped SwiGLU"),
    ("b13", megamoe.CONCATENATED, megamoe.SWIGLU, (True, False), "b13: a bias of the up projection"),
    ("b2", megamoe.CONCATENATED, megamoe.SWIGLU, (False, True), "b2: a bias of the down projection"),
    ("gpt_oss", megamoe.GPT_OSS, megamoe.GPT_OSS_ACTIVATION, (True, True), "layout.gate_up: interleaved"),
]


def _cuda_problem(layout, biases, gen):
    x, ids, s, dy, p = layout_problem(64, 64, 32, 4, 2, layout, *biases, dtype=torch.bfloat16, gen=gen)
    move = lambda t: t.detach().cuda() if t is not None else None  # noqa: E731
    return move(x), ids.cuda(), move(s).float(), move(dy), {name: move(t) for name, t in p.items()}


@pytest.mark.parametrize("name,layout,activation,biases,text", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_cuda_refuses_options_it_does_not_run(name, layout, activation, biases, text, gen):
    x, ids, s, _, p = _cuda_problem(layout, biases, gen)
    for call in (megamoe.moe, megamoe.path_of):
        with pytest.raises(NotImplementedError, match="not supported on CUDA yet") as info:
            call(x, ids, s, p["w13"], p["w2"], w3=p["w3"], b13=p["b13"], b2=p["b2"], layout=layout,
                 activation=activation)
        assert text in str(info.value), str(info.value)
    counts = torch.tensor([16, 16, 16, 16], device="cuda")
    with pytest.raises(NotImplementedError, match="not supported on CUDA yet"):
        megamoe.grouped_moe(x, counts, p["w13"], p["w2"], w3=p["w3"], b13=p["b13"], b2=p["b2"], layout=layout,
                            activation=activation)


def test_path_of_the_default_on_cuda(gen):
    x, ids, s, _, p = _cuda_problem(megamoe.CONCATENATED, (False, False), gen)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert megamoe.path_of(x, ids, s, p["w13"], p["w2"]) == ("sm90" if sm90 else "cuda")
    assert megamoe.path_of(x, ids, s, p["w13"], p["w2"], backward=True) in (
        ("sm90", "sm90+cuda-weight-grads") if sm90 else ("cuda",))
    counts = torch.tensor([16, 16, 16, 16], device="cuda")
    assert megamoe.grouped_path_of(x, counts, p["w13"], p["w2"]) == ("sm90" if sm90 else "cuda")


def test_frozen_experts_skip_the_weight_gradients_on_cuda(gen):
    """dx and d topk_weights of a frozen-experts backward equal the full backward's, bitwise (the skipped GEMMs run
    after them or not at all)."""
    x, ids, s, dy, p = _cuda_problem(megamoe.CONCATENATED, (False, False), gen)
    x.requires_grad_(), s.requires_grad_()
    frozen = torch.autograd.grad(megamoe.moe(x, ids, s, p["w13"], p["w2"]), (x, s), dy)
    w13, w2 = p["w13"].requires_grad_(), p["w2"].requires_grad_()
    full = torch.autograd.grad(megamoe.moe(x, ids, s, w13, w2), (x, s, w13, w2), dy)
    for a, b in zip(frozen, full):
        assert torch.equal(a, b)
