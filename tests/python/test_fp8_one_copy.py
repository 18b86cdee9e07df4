"""One-copy FP8 expert weights: megamoe.fp8.quantize_experts(w13, w2, transposes=False) (w13_t and w2_t None, one
byte per weight element; the backward transposes in its workspace) and megamoe.fp8.set_cached_transposes, the cache's
form.

CPU (any machine): the one-copy Fp8Experts holds the same w13, w2 and scales as the default (fp8_reference's bytes)
and None for the transposed copies; the custom op megamoe::quantize_experts returns empty [0] tensors for them, its
fake kernel the same shapes (opcheck), and torch.compile(fullgraph=True) traces it; transposes and the setting refuse
non-bools; with the library's calls replaced by a recorder, megamoe.moe / grouped_moe pass the absent copies as None
(the C API's absent tensors) to the forward and the backward, eager and compiled; the cache's entries take the
setting's form, and an entry of the other form is replaced; an Fp8Experts with empty transposed copies is one-copy.

GPU (a compute capability 9.0 CUDA device; skipped, with the reason, elsewhere): quantize_experts' one-copy tensors
bitwise the default's; y and every gradient of megamoe.moe / grouped_moe (keep-h and recompute, eager and compiled)
bitwise equal with and without the transposed copies, through fp8_experts and through the cache's setting; the
one-copy FP8 weights take half the bytes.
"""

import pytest
import torch

import megamoe
from conftest import grads_of, group_rows, make_problem
from megamoe import fp8

E, H, I = 3, 256, 128


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="no compute capability 9.0 CUDA device: the FP8 kernels "
                                                          "(precision='fp8') run on a Hopper GPU (sm_90) only")
OUTPUTS = ("y", "dx", "dtopk_weights", "dw13", "dw2")


@pytest.fixture
def cache_form():
    """set_cached_transposes for one test: the cache emptied and the default form restored after it."""
    yield fp8.set_cached_transposes
    fp8.set_cached_transposes(True)
    fp8.clear_cache()


def weights(gen, device="cpu"):
    w13 = torch.randn(E, 2 * I, H, generator=gen).to(torch.bfloat16).to(device)
    w2 = torch.randn(E, H, I, generator=gen).to(torch.bfloat16).to(device)
    return w13, w2


def bits(t):
    return t.view(torch.uint8)


def assert_same_bytes(one, full):
    for name in ("w13", "w13_scales", "w2", "w2_scales"):
        a, b = getattr(one, name), getattr(full, name)
        assert a.shape == b.shape and torch.equal(bits(a).cpu(), bits(b).cpu()), name


# ---------------------------------------------------------------- CPU

def test_quantize_experts_without_transposes(gen):
    w13, w2 = weights(gen)
    full, one = fp8.quantize_experts(w13, w2), fp8.quantize_experts(w13, w2, transposes=False)
    assert one.w13_t is None and one.w2_t is None and full.w13_t is not None
    assert_same_bytes(one, full)
    with pytest.raises(TypeError, match="transposes"):
        fp8.quantize_experts(w13, w2, transposes=1)
    assert "one-copy" in fp8.Fp8Experts.__doc__ and "Memory" in fp8.Fp8Experts.__doc__


def test_the_op_returns_empty_transposes_and_its_fake_kernel_agrees(gen):
    w13, w2 = weights(gen)
    out = torch.ops.megamoe.quantize_experts(w13, w2, False)
    assert len(out) == 6
    for name, t in zip(fp8.Fp8Experts._fields, out):
        if name in ("w13_t", "w2_t"):
            assert t.shape == (0,) and t.dtype == torch.float8_e4m3fn, name
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.megamoe.quantize_experts(mode.from_tensor(w13), mode.from_tensor(w2), False)
        assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in out]
        assert [t.dtype for t in fake] == [t.dtype for t in out]
    torch.library.opcheck(torch.ops.megamoe.quantize_experts.default, (w13, w2, False))
    torch.library.opcheck(torch.ops.megamoe.quantize_experts.default, (w13[:, :200, :100].contiguous(),
                                                                       w2[:, :100, :100].contiguous(), False))


def test_torch_compile_fullgraph_traces_the_one_copy_quantization(gen):
    w13, w2 = weights(gen)

    def quantize(w13, w2):
        experts = fp8.quantize_experts(w13, w2, transposes=False)
        return experts.w13, experts.w13_t is None, experts.w2_t is None

    torch._dynamo.reset()
    q, no_w13_t, no_w2_t = torch.compile(quantize, fullgraph=True)(w13, w2)
    assert no_w13_t and no_w2_t
    assert torch.equal(bits(q), bits(fp8.quantize_experts(w13, w2).w13))


def test_the_cache_setting(gen, cache_form):
    fp8.clear_cache()
    w13, w2 = (torch.nn.Parameter(w) for w in weights(gen))
    assert fp8.cached_transposes() is True
    full = fp8.experts_for(w13, w2)
    assert full.w13_t is not None and fp8.experts_for(w13, w2) is full
    cache_form(False)
    assert fp8.cached_transposes() is False
    one = fp8.experts_for(w13, w2)
    assert one is not full and one.w13_t is None and one.w2_t is None and fp8.cache_size() == 1
    assert fp8.experts_for(w13, w2) is one  # one quantization per step, as with the copies
    assert_same_bytes(one, full)
    cache_form(True)
    again = fp8.experts_for(w13, w2)
    assert again is not one and again.w13_t is not None
    for bad in (0, "no", None):
        with pytest.raises(TypeError, match="set_cached_transposes"):
            fp8.set_cached_transposes(bad)


def _transposes_of(call):
    return call.tensors.get("fp8_w13_t"), call.tensors.get("fp8_w2_t")


def test_the_ops_pass_absent_transposes(recorder, gen, cache_form):
    fp8.clear_cache()
    x, ids, s, w13, w2, dy = make_problem(6, H, I, E, 2, "random", dtype=torch.bfloat16, gen=gen)
    one = fp8.quantize_experts(w13, w2, transposes=False)
    megamoe.moe(x, ids, s, w13, w2, precision="fp8", fp8_experts=one).backward(dy)
    x_, s_, w13_, w2_ = (t.detach() for t in (x, s, w13, w2))
    megamoe.moe_backward(dy, x_, ids, s_, w13_, w2_, precision="fp8", fp8_experts=one)
    counts = torch.bincount(ids[:, 0], minlength=E)
    out = megamoe.grouped_moe(x[ids[:, 0].argsort()], counts, w13, w2, precision="fp8", fp8_experts=one)
    out.backward(torch.ones_like(out))
    empties = one._replace(w13_t=torch.empty(0, dtype=torch.float8_e4m3fn),
                           w2_t=torch.empty(0, dtype=torch.float8_e4m3fn))  # the op's stand-ins: absent too
    megamoe.moe(x, ids, s, w13, w2, precision="fp8", fp8_experts=empties).backward(dy)
    cache_form(False)
    megamoe.moe(x, ids, s, w13, w2, precision="fp8").backward(dy)  # the cache's one-copy entry

    def compiled_layer(x, ids, s, w13, w2):
        return megamoe.moe(x, ids, s, w13, w2, precision="fp8") * 2  # quantized in the graph, one-copy

    torch._dynamo.reset()
    torch.compile(compiled_layer, fullgraph=True)(x, ids, s, w13, w2).backward(dy)
    kinds = [call.kind for call in recorder]
    assert kinds == ["forward", "backward", "backward", "grouped_forward", "grouped_backward", "forward",
                     "backward", "forward", "backward", "forward", "backward"]
    for call in recorder:
        assert call.options["precision"] == "fp8" and _transposes_of(call) == (None, None), call.kind
        assert call.tensors["fp8_w13"] is not None and call.tensors["fp8_w2_scales"] is not None, call.kind
    with pytest.raises(TypeError, match="fp8_experts"):
        megamoe.moe(x, ids, s, w13, w2, precision="fp8", fp8_experts=one._replace(w13=None))


# ---------------------------------------------------------------- GPU

def _cuda_problem(gen, T=96, E_=4, topk=2):
    problem = make_problem(T, H, I, E_, topk, "dropped", dtype=torch.bfloat16, gen=gen)
    return [t.detach().cuda().requires_grad_(t.requires_grad) for t in problem]


@requires_sm90
def test_one_copy_quantization_is_the_defaults_bitwise(gen):
    w13, w2 = weights(gen, "cuda")
    full, one = fp8.quantize_experts(w13, w2), fp8.quantize_experts(w13, w2, transposes=False)
    torch.cuda.synchronize()
    assert one.w13_t is None and one.w2_t is None
    assert_same_bytes(one, full)
    size = sum(t.numel() * t.element_size() for t in one if t is not None)
    full_size = sum(t.numel() * t.element_size() for t in full)
    assert full_size - size == E * 3 * I * H  # one byte per weight element less


@requires_sm90
@pytest.mark.parametrize("recompute", [False, True])
def test_the_backward_without_transposes_is_bitwise(recompute, gen):
    x, ids, s, w13, w2, dy = _cuda_problem(gen)
    full, one = fp8.quantize_experts(w13, w2), fp8.quantize_experts(w13, w2, transposes=False)

    def run(experts):
        return grads_of(lambda *a: megamoe.moe(*a, recompute=recompute, precision="fp8", fp8_experts=experts),
                        x, ids, s, w13, w2, dy)

    for name, a, b in zip(OUTPUTS, run(full), run(one)):
        assert torch.equal(a, b), f"{name}: one-copy FP8 weights differ from the default's"
    rows, counts, scores, _ = group_rows(x.detach(), ids, s.detach(), w13.shape[0], num_padding=5, gen=gen)
    rows, scores = rows.requires_grad_(), scores.requires_grad_()

    def grouped(experts):
        out = megamoe.grouped_moe(rows, counts, w13, w2, scores, recompute=recompute, precision="fp8",
                                  fp8_experts=experts)
        grads = torch.autograd.grad(out, (rows, scores, w13, w2), torch.ones_like(out))
        return (out.detach(), *grads)

    for a, b in zip(grouped(full), grouped(one)):
        assert torch.equal(a, b), "grouped rows: one-copy FP8 weights differ from the default's"


@requires_sm90
def test_the_cache_setting_and_torch_compile_are_bitwise(gen, cache_form):
    x, ids, s, w13, w2, dy = _cuda_problem(gen)

    def layer(x, ids, s, w13, w2):
        return megamoe.moe(x, ids, s, w13, w2, precision="fp8") * 2  # exact: bitwise comparable

    fp8.clear_cache()
    default = grads_of(layer, x, ids, s, w13, w2, dy)
    cache_form(False)
    eager = grads_of(layer, x, ids, s, w13, w2, dy)
    assert fp8.experts_for(w13, w2).w13_t is None
    torch._dynamo.reset()
    compiled = grads_of(torch.compile(layer, fullgraph=True), x, ids, s, w13, w2, dy)
    for name, a, b, c in zip(OUTPUTS, default, eager, compiled):
        assert torch.equal(a, b), f"{name}: the one-copy cache differs from the default"
        assert torch.equal(a, c), f"{name}: compiled one-copy differs from the default"
