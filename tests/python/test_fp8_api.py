"""The Python face of precision="fp8" (blockwise FP8): megamoe.fp8 (Fp8Experts, quantize_experts, the
cache experts_for), the precision option and the FP8 weights threaded through megamoe.moe / grouped_moe, their
backwards, path_of, the custom ops, autograd and torch.compile, the modules and adapters.

CPU (any machine): unknown precisions are ValueErrors naming `precision`; FP8 on CPU tensors is the library's
NotImplementedError (NOT_SUPPORTED) naming FP8; the ctypes structs have the library's sizes; the cache's identity and
version rules; with the library's calls replaced by a recorder, the FP8 weights the forward gets are the ones its
backward gets (autograd, manual, accumulating, grouped, compiled) and adapters pass the precision through.

GPU (a compute capability 9.0 CUDA device; skipped, with the reason, elsewhere): quantize_experts bitwise against
fp8_reference.quantize_blocks; the layer's forward and backward against the recipe as the kernels run it
(recipe_as_run: fp8_reference's quantization with the 16-bit rounding points of the CUDA path) within 1e-2, against
fp8_reference.moe_reference within 3e-2, and far closer to either than to the unquantized layer; keep-h and recompute
bitwise; torch.compile(fullgraph=True) bitwise equal to eager; path_of "sm90-fp8"; grouped rows; main_grads.
"""

import ctypes
import gc
import pathlib
import re
import types

import pytest
import torch

import megamoe
from conftest import grads_of, group_rows, make_problem, rel_err
from megamoe import _lib, fp8, fp8_reference
from megamoe.layouts import op_options

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "megamoe" / "megamoe.h"
OUTPUTS = ("y", "dx", "dtopk_weights", "dw13", "dw2")


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="no compute capability 9.0 CUDA device: the FP8 kernels "
                                                          "(precision='fp8') run on a Hopper GPU (sm_90) only")


def small_problem(gen, T=6, H=128, I=128, E=3, topk=2, dtype=torch.bfloat16):
    return make_problem(T, H, I, E, topk, "random", dtype=dtype, gen=gen)


# ---------------------------------------------------------------- CPU: the API's checks

def _entry_calls(x, ids, s, w13, w2, dy):
    """Every entry point taking a precision, as (name, call(precision))."""
    x_, s_, w13_, w2_ = (t.detach() for t in (x, s, w13, w2))
    counts = torch.bincount(ids[:, 0], minlength=w13.shape[0])
    return [
        ("moe", lambda p: megamoe.moe(x, ids, s, w13, w2, precision=p)),
        ("moe_backward", lambda p: megamoe.moe_backward(dy, x_, ids, s_, w13_, w2_, precision=p)),
        ("path_of", lambda p: megamoe.path_of(x, ids, s, w13, w2, precision=p)),
        ("grouped_moe", lambda p: megamoe.grouped_moe(x, counts, w13, w2, precision=p)),
        ("grouped_backward", lambda p: megamoe.grouped_backward(dy, x_, counts, w13_, w2_, precision=p)),
        ("grouped_path_of", lambda p: megamoe.grouped_path_of(x, counts, w13, w2, precision=p)),
    ]


def test_unknown_precision_is_a_value_error_naming_it(gen):
    x, ids, s, w13, w2, dy = small_problem(gen)
    for name, call in _entry_calls(x, ids, s, w13, w2, dy):
        for precision in ("fp4", "FP8", "float8", None):
            with pytest.raises(ValueError, match="precision"):
                call(precision)
    with pytest.raises(ValueError, match="precision"):
        torch.ops.megamoe.moe_forward(x.detach(), ids, s.detach(), w13.detach(), w2.detach(), precision="int8")
    for make in (lambda: megamoe.MoEExperts(3, 128, 128, precision="e5m2"),
                 lambda: megamoe.MoEBlock(128, 128, 3, 2, precision="e5m2"),
                 lambda: megamoe.adapters.prime_rl.MegamoeExpertCompute(precision="e5m2")):
        with pytest.raises(ValueError, match="precision"):
            make()


def test_fp8_on_cpu_tensors_is_the_librarys_not_supported(gen):
    """The CPU tensors get their FP8 weights (quantize_experts runs fp8_reference on the CPU), so the call reaches the
    library, whose validation refuses FP8 off CUDA: NOT_SUPPORTED, raised as NotImplementedError saying what was
    passed (precision="fp8", never the C API's FP8_BLOCKWISE) and why (CUDA only, x a CPU tensor)."""
    x, ids, s, w13, w2, dy = small_problem(gen)
    for name, call in _entry_calls(x, ids, s, w13, w2, dy):
        with pytest.raises(NotImplementedError, match='precision="fp8" runs on CUDA') as info:
            call("fp8")
        assert "CPU tensor" in str(info.value) and "FP8_BLOCKWISE" not in str(info.value), name
    module = megamoe.MoEExperts(3, 128, 128, dtype=torch.bfloat16, precision="fp8")
    with pytest.raises(NotImplementedError, match='precision="fp8"'):
        module(x, ids, s)


def test_fp8_options_and_weights_are_checked(gen):
    x, ids, s, w13, w2, dy = small_problem(gen)
    with pytest.raises(NotImplementedError, match="interleaved"):
        megamoe.moe(x, ids, s, w13.transpose(1, 2), w2.transpose(1, 2), layout=megamoe.GPT_OSS, precision="fp8")
    experts = fp8.quantize_experts(w13, w2)
    with pytest.raises(ValueError, match="fp8_experts"):
        megamoe.moe(x, ids, s, w13, w2, fp8_experts=experts)  # precision "bf16"
    for bad in ((experts.w13, experts.w2), "fp8", experts[:5] + (None,)):
        with pytest.raises(TypeError, match="fp8_experts"):
            megamoe.moe(x, ids, s, w13, w2, precision="fp8", fp8_experts=bad)
    with pytest.raises(ValueError, match="w13"):
        fp8.quantize_experts(w13[0], w2)


def _enum(value_name):
    """The value of an enumerator of include/megamoe/megamoe.h."""
    return int(re.search(rf"\b{value_name} = (\d+)", HEADER.read_text()).group(1))


def test_ctypes_structs_match_the_library_and_the_header():
    lib = _lib.library()
    assert _lib.ABI_VERSION == lib.megamoe_abi_version() == 5
    assert set(_lib.ABI_STRUCTS) == set(range(8)) and _lib.ABI_STRUCTS[7] is _lib.CFp8Experts
    for kind, struct in _lib.ABI_STRUCTS.items():
        assert lib.megamoe_struct_size(kind) == ctypes.sizeof(struct), struct.__name__
    assert ctypes.sizeof(_lib.CFp8Experts) == 6 * ctypes.sizeof(_lib.Tensor)
    for params in (_lib.ForwardParams, _lib.BackwardParams, _lib.GroupedForwardParams, _lib.GroupedBackwardParams):
        assert [name for name, _ in params._fields_[-2:]] == ["precision", "fp8"], params.__name__
    assert _lib._DTYPE_CODES[torch.float8_e4m3fn] == _enum("MEGAMOE_DTYPE_E4M3") == 6
    assert _lib.PRECISION_CODES == {"bf16": _enum("MEGAMOE_PRECISION_DEFAULT"),
                                    "fp8": _enum("MEGAMOE_PRECISION_FP8_BLOCKWISE")}
    lib.megamoe_path_string.restype = ctypes.c_char_p
    code = _enum("MEGAMOE_PATH_SM90_FP8")
    assert lib.megamoe_path_string(code).decode() == _lib.PATH_NAMES[code] == "sm90-fp8"


def test_fp8_experts_fields_and_the_quantize_op(gen):
    assert fp8.Fp8Experts._fields == _lib.FP8_FIELDS == tuple(name for name, _ in _lib.CFp8Experts._fields_)
    assert fp8.Fp8Experts._fields == ("w13", "w13_t", "w13_scales", "w2", "w2_t", "w2_scales")
    assert "Memory" in fp8.Fp8Experts.__doc__ and "transpose" in fp8.Fp8Experts.__doc__
    E, H, I = 2, 384, 128
    w13 = torch.randn(E, 2 * I, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=gen).to(torch.bfloat16)
    experts = fp8.quantize_experts(w13, w2)  # CPU: fp8_reference
    shapes = dict(w13=(E, 2 * I, H), w13_t=(E, H, 2 * I), w13_scales=(E, 2, 3), w2=(E, H, I), w2_t=(E, I, H),
                  w2_scales=(E, 3, 1))
    for name, tensor in experts._asdict().items():
        assert tuple(tensor.shape) == shapes[name] and tensor.is_contiguous(), name
        assert tensor.dtype == (torch.float32 if name.endswith("scales") else torch.float8_e4m3fn), name
    for q, q_t, scales, w in ((experts.w13, experts.w13_t, experts.w13_scales, w13),
                              (experts.w2, experts.w2_t, experts.w2_scales, w2)):
        want_q, want_scales = fp8_reference.quantize_blocks(w)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)
        assert torch.equal(q_t.view(torch.uint8), q.transpose(1, 2).view(torch.uint8))
    torch.library.opcheck(torch.ops.megamoe.quantize_experts.default, (w13, w2))
    torch.library.opcheck(torch.ops.megamoe.quantize_experts.default, (w13[:, :200, :300].contiguous(),
                                                                       w2[:, :300, :100].contiguous()))


def test_op_schemas_carry_the_precision_and_the_fp8_weights():
    for op in ("moe_forward", "moe_backward", "moe_backward_accumulate", "grouped_forward", "grouped_backward",
               "grouped_backward_accumulate"):
        schema = str(getattr(torch.ops.megamoe, op).default._schema)
        assert 'str precision="bf16"' in schema, schema
        for name in _lib.FP8_ARGS:
            assert f"Tensor? {name}=None" in schema, (op, name)
    schema = str(torch.ops.megamoe.quantize_experts.default._schema)
    assert schema.startswith("megamoe::quantize_experts(Tensor w13, Tensor w2, bool transposes=True) -> (Tensor, "
                             "Tensor"), schema


# ---------------------------------------------------------------- CPU: the cache

@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach", "custom"])
def test_cache_quantizes_again_after_every_optimizer_step(gen, optimizer):
    """Fused optimizers update weights without bumping their version counters (AdamW(fused=True): checked on torch
    2.15): the cache must still see the step (the 8-layer training example trained on stale FP8 copies before it did:
    bench/results/2026-12-02-nvidia-h200-760dd9d-notes.md)."""
    fp8.clear_cache()
    w13 = torch.nn.Parameter(torch.randn(2, 256, 128, generator=gen).to(torch.bfloat16))
    w2 = torch.nn.Parameter(torch.randn(2, 128, 128, generator=gen).to(torch.bfloat16))
    if optimizer == "custom":  # a torch.optim subclass writing through .data: only the step hook can tell
        class DataWriter(torch.optim.Optimizer):
            def __init__(self, params):
                super().__init__(params, {})

            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.data.add_(1.0)
        step = DataWriter([w13, w2])
    else:
        step = torch.optim.AdamW([w13, w2], lr=0.5, fused=optimizer == "adamw-fused",
                                 foreach=None if optimizer == "adamw-fused" else True)
    first = fp8.experts_for(w13, w2)
    assert fp8.experts_for(w13, w2) is first
    w13.grad, w2.grad = torch.ones_like(w13), torch.ones_like(w2)
    step.step()
    second = fp8.experts_for(w13, w2)
    assert second is not first, f"{optimizer}: the cache served the previous step's FP8 weights"
    assert not torch.equal(second.w13.view(torch.uint8), first.w13.view(torch.uint8))
    assert fp8.experts_for(w13, w2) is second  # and one quantization per step again
    fp8.weights_changed()  # the explicit call for writes the cache cannot see
    assert fp8.experts_for(w13, w2) is not second
    fp8.clear_cache()


def test_cache_keeps_one_quantization_until_an_inplace_update(gen, monkeypatch):
    fp8.clear_cache()
    made = []
    quantize = fp8.quantize_experts
    monkeypatch.setattr(fp8, "quantize_experts", lambda w13, w2, **kw: made.append(1) or quantize(w13, w2, **kw))
    w13 = torch.nn.Parameter(torch.randn(2, 256, 128, generator=gen).to(torch.bfloat16))
    w2 = torch.nn.Parameter(torch.randn(2, 128, 128, generator=gen).to(torch.bfloat16))
    first = fp8.experts_for(w13, w2)
    assert fp8.experts_for(w13, w2) is first and len(made) == 1
    assert fp8.experts_for(w13.view(w13.shape), w2) is first  # a view made per call: the same weights
    with torch.no_grad():
        w13.add_(1)
    second = fp8.experts_for(w13, w2)
    assert second is not first and len(made) == 2
    assert not torch.equal(second.w13.view(torch.uint8), first.w13.view(torch.uint8))
    assert torch.equal(second.w2.view(torch.uint8), first.w2.view(torch.uint8))
    assert fp8.experts_for(w13, w2) is second
    w2.grad = torch.ones_like(w2)
    torch.optim.SGD([w2], lr=0.5).step()  # an optimizer's in-place update of the other weight
    third = fp8.experts_for(w13, w2)
    assert third is not second and fp8.experts_for(w13, w2) is third and len(made) == 3
    other = torch.randn(2, 256, 128, generator=gen).to(torch.bfloat16)
    assert fp8.experts_for(other, w2) is not third and fp8.experts_for(w13, w2) is third  # keyed per pair
    size = fp8.cache_size()
    del other
    gc.collect()
    assert fp8.cache_size() == size - 1  # dropped with its weights
    fp8.clear_cache()
    assert fp8.cache_size() == 0 and fp8.experts_for(w13, w2) is not third


# ---------------------------------------------------------------- CPU: the FP8 weights through the ops

def _fp8_of(call):
    return [call.tensors.get(name) for name in _lib.FP8_ARGS]


def _same_tensors(a, b):
    return all(s is not None and t is not None and s.data_ptr() == t.data_ptr() for s, t in zip(a, b))


@pytest.mark.parametrize("recompute", [False, True])
def test_the_backward_reads_the_fp8_weights_its_forward_read(recompute, recorder, gen):
    fp8.clear_cache()
    x, ids, s, w13, w2, dy = small_problem(gen)
    megamoe.moe(x, ids, s, w13, w2, recompute=recompute, precision="fp8").backward(dy)
    forward, backward = recorder
    assert (forward.kind, backward.kind) == ("forward", "backward")
    assert forward.options["precision"] == backward.options["precision"] == "fp8"
    cached = fp8.experts_for(w13, w2)
    assert _same_tensors(_fp8_of(forward), cached) and _same_tensors(_fp8_of(backward), cached)
    assert (backward.tensors["saved_h"] is None) == recompute
    # the caller's FP8 weights; the cache cleared and refilled between forward and backward changes nothing
    mine = fp8.quantize_experts(w13, w2)
    y = megamoe.moe(x, ids, s, w13, w2, recompute=recompute, precision="fp8", fp8_experts=mine)
    fp8.clear_cache()
    fp8.experts_for(w13, w2)
    y.backward(dy)
    assert _same_tensors(_fp8_of(recorder[2]), mine) and _same_tensors(_fp8_of(recorder[3]), mine)
    # bf16: no FP8 weights anywhere
    megamoe.moe(x, ids, s, w13, w2).backward(dy)
    assert recorder[4].options["precision"] == "bf16" and _fp8_of(recorder[4]) == [None] * 6
    assert _fp8_of(recorder[5]) == [None] * 6


def test_manual_grouped_and_accumulating_backwards_get_the_fp8_weights(recorder, gen):
    fp8.clear_cache()
    x, ids, s, w13, w2, dy = small_problem(gen)
    x_, s_, w13_, w2_ = (t.detach() for t in (x, s, w13, w2))
    mine = fp8.quantize_experts(w13, w2)
    megamoe.moe_backward(dy, x_, ids, s_, w13_, w2_, precision="fp8", fp8_experts=mine)
    megamoe.moe_backward(dy, x_, ids, s_, w13_, w2_, precision="fp8")  # the cache's
    bufs = (torch.zeros(w13.shape), torch.zeros(w2.shape))
    megamoe.moe(x, ids, s, w13, w2, precision="fp8", main_grads=bufs).backward(dy)
    counts = torch.bincount(ids[:, 0], minlength=w13.shape[0])
    rows = x[ids[:, 0].argsort()]
    out = megamoe.grouped_moe(rows, counts, w13, w2, precision="fp8", fp8_experts=mine)
    out.backward(torch.ones_like(out))
    megamoe.grouped_backward(dy, x_, counts, w13_, w2_, precision="fp8", fp8_experts=mine)
    kinds = [call.kind for call in recorder]
    assert kinds == ["backward", "backward", "forward", "backward", "grouped_forward", "grouped_backward",
                     "grouped_backward"]
    detached, leaves = fp8.experts_for(w13_, w2_), fp8.experts_for(w13, w2)  # the cache's, per pair of tensors
    for call, want in zip(recorder, (mine, detached, leaves, leaves, mine, mine, mine)):
        assert call.options["precision"] == "fp8" and _same_tensors(_fp8_of(call), want), call.kind
    assert _same_tensors([recorder[3].tensors["dw13"], recorder[3].tensors["dw2"]], bufs)  # accumulated into


def test_one_quantization_serves_every_microbatch_of_a_step(recorder, gen, monkeypatch):
    fp8.clear_cache()
    made = []
    quantize = fp8.quantize_experts
    monkeypatch.setattr(fp8, "quantize_experts", lambda w13, w2, **kw: made.append(1) or quantize(w13, w2, **kw))
    x, ids, s, w13, w2, dy = small_problem(gen)
    w13, w2 = torch.nn.Parameter(w13.detach()), torch.nn.Parameter(w2.detach())
    optimizer = torch.optim.SGD([w13, w2], lr=0.1)
    for step in range(2):
        for _ in range(3):
            megamoe.moe(x, ids, s, w13, w2, precision="fp8").backward(dy)
        assert len(made) == step + 1
        optimizer.step()
        optimizer.zero_grad()


def test_torch_compile_fullgraph_traces_the_fp8_call(recorder, gen):
    """Compiled, the quantization is in the graph (megamoe::quantize_experts) and the layer's ops get its FP8 weights:
    the same bytes as eager's (the cache's)."""
    fp8.clear_cache()
    x, ids, s, w13, w2, dy = small_problem(gen)

    def layer(x, ids, s, w13, w2):
        return megamoe.moe(x, ids, s, w13, w2, precision="fp8") * 2

    mine = fp8.quantize_experts(w13, w2)

    def explicit(x, ids, s, w13, w2):
        return megamoe.moe(x, ids, s, w13, w2, precision="fp8", fp8_experts=mine) * 2

    torch._dynamo.reset()
    torch.compile(layer, fullgraph=True)(x, ids, s, w13, w2).backward(dy)
    torch.compile(explicit, fullgraph=True)(x, ids, s, w13, w2).backward(dy)
    layer(x, ids, s, w13, w2).backward(dy)
    assert [call.kind for call in recorder] == ["forward", "backward"] * 3
    eager = recorder[4:]
    for compiled in (recorder[0:2], recorder[2:4]):
        for a, b in zip(compiled, eager):
            assert a.options["precision"] == b.options["precision"] == "fp8"
            for got, want in zip(_fp8_of(a), _fp8_of(b)):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_modules_and_adapters_pass_the_precision(recorder, gen):
    x, ids, s, w13, w2, dy = small_problem(gen)
    module = megamoe.MoEExperts(3, 128, 128, dtype=torch.bfloat16, precision="fp8")
    assert "precision='fp8'" in repr(module)
    module(x, ids, s)
    block = megamoe.MoEBlock(128, 128, 3, 2, dtype=torch.bfloat16, precision="fp8")
    assert block.experts.precision == "fp8"
    block(x.detach())
    counts = torch.bincount(ids[:, 0], minlength=3)
    experts = types.SimpleNamespace(gate_up_proj=w13.detach(), down_proj=w2.detach())  # prime-rl's fused storage
    megamoe.adapters.prime_rl.MegamoeExpertCompute(precision="fp8")(experts, x.detach(), counts)
    megamoe.adapters.megatron.te_grouped_mlp(x.detach(), counts, s[:, 0].detach().contiguous(), w13.detach(),
                                             w2.detach(), precision="fp8")
    E, two_i, H = w13.shape  # the legacy GroupedMLP's transposed storage: weight1 [H, E*2I], weight2 [E*I, H]
    weight1 = w13.detach().transpose(1, 2).contiguous().view(H, E * two_i)
    weight2 = w2.detach().transpose(1, 2).contiguous().view(E * two_i // 2, H)
    megamoe.adapters.megatron.grouped_mlp(x.detach(), counts, s[:, 0].detach().contiguous(), weight1, weight2, E,
                                          precision="fp8")
    titan = megamoe.adapters.torchtitan.GroupedExperts(H, two_i // 2, E, dtype=torch.bfloat16, precision="fp8")
    titan(x.detach(), counts)  # torchtitan's separate w1 / w3
    routed = megamoe.adapters.torchtitan.RoutedExperts(H, two_i // 2, E, dtype=torch.bfloat16, precision="fp8")
    routed(x.detach(), s.detach(), ids)
    assert [call.options["precision"] for call in recorder] == ["fp8"] * 7
    assert all(call.tensors["fp8_w13"] is not None for call in recorder)


# ---------------------------------------------------------------- GPU: the recipe as the kernels run it

def recipe_as_run(x, ids, s, w13, w2, dy, low=torch.bfloat16):
    """The layer under the recipe (fp8_reference's quantization and blockwise GEMMs, float64 between them) with the
    16-bit rounding points of the CUDA path: a rounded to x's dtype before its quantization (the up GEMM's epilogue
    quantizes the a it stores), the backward's h rounded (saved or recomputed, h is x's dtype), dh rounded before its
    quantization pass, and the weight gradients from the 16-bit dh, x, dy and s a, unquantized (megamoe.h:
    FP8_BLOCKWISE computes them as DEFAULT does). low=None: no rounding (then y, dx and d
    topk_weights are fp8_reference.moe_reference's). Returns (y, dx, dtopk_weights, dw13, dw2) in float64, on the
    CPU."""
    f64 = torch.float64
    rnd = (lambda t: t) if low is None else (lambda t: t.to(low).to(f64))
    x, s, w13, w2, dy = (t.detach().cpu() for t in (x, s, w13, w2, dy))
    ids = ids.cpu()
    T, H = x.shape
    E, two_i, _ = w13.shape
    I, topk = two_i // 2, ids.shape[1]

    def along(v):  # quantized in 1 x 128 groups along the last dimension, back in float64
        return fp8_reference.dequantize_groups(*fp8_reference.quantize_groups(v), dtype=f64)

    def along_tokens(v):  # the weight gradients' operands: the 16-bit values, in float64
        return v.to(f64)

    w13_q, w2_q = (fp8_reference.dequantize_blocks(*fp8_reference.quantize_blocks(w), dtype=f64) for w in (w13, w2))
    x_q, dy_q = along(x), along(dy)  # [T, H]
    y, dx = torch.zeros(T, H, dtype=f64), torch.zeros(T, H, dtype=f64)
    dtopk = torch.zeros(T * topk, dtype=f64)
    dw13, dw2 = torch.zeros(E, two_i, H, dtype=f64), torch.zeros(E, H, I, dtype=f64)
    flat = ids.reshape(-1)
    for e in range(E):
        slots = (flat == e).nonzero().flatten()  # the expert's rows, in slot order
        if slots.numel() == 0:
            continue
        tokens = slots // topk
        weight = s.reshape(-1)[slots].to(f64).unsqueeze(1)  # [n, 1]
        h = x_q[tokens] @ w13_q[e].T  # [n, 2I]
        a = rnd(torch.nn.functional.silu(h[:, :I]) * h[:, I:])  # [n, I]
        y.index_add_(0, tokens, weight * (along(a) @ w2_q[e].T))
        h = rnd(h)
        gate, up = h[:, :I], h[:, I:]
        sig = torch.sigmoid(gate)
        a = gate * sig * up  # from the 16-bit h, as the dSwiGLU epilogue has it
        p = dy_q[tokens] @ w2_q[e]  # [n, I]
        dtopk[slots] = (p * a).sum(dim=1)
        d_act = weight * p
        dh = rnd(torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * gate * sig], dim=1))  # [n, 2I]
        dx.index_add_(0, tokens, along(dh) @ w13_q[e])
        dw13[e] = along_tokens(dh).T @ along_tokens(x[tokens])
        dw2[e] = along_tokens(dy[tokens]).T @ along_tokens(rnd(weight * a))
    return y, dx, dtopk.reshape(T, topk), dw13, dw2


def test_recipe_as_run_without_rounding_is_the_reference(gen):
    """The test's reference is fp8_reference's recipe: unrounded, its y, dx and d topk_weights are moe_reference's."""
    x, ids, s, w13, w2, dy = make_problem(40, 256, 128, 4, 2, "dropped", dtype=torch.bfloat16, gen=gen)
    ours = recipe_as_run(x, ids, s, w13, w2, dy, low=None)
    spec = fp8_reference.moe_reference(x, ids, s, w13, w2, dy)
    for name, a, b in zip(OUTPUTS[:3], ours, spec):
        assert rel_err(a, b) < 1e-12, name


# (name, T, H, I, E, topk, routing, dtype): H and I multiples of 128 (the FP8 kernels' blocks)
CASES = [
    ("basic", 256, 256, 256, 4, 2, "random", torch.bfloat16),
    ("dropped_ragged", 300, 384, 256, 8, 2, "dropped", torch.bfloat16),
    ("empty_experts", 37, 128, 384, 16, 2, "half_empty", torch.bfloat16),
    ("one_expert_takes_all", 200, 256, 128, 4, 1, "one_expert", torch.bfloat16),
    ("f16", 130, 256, 128, 5, 3, "random", torch.float16),
]
BOUND_RUN = 1e-2  # against recipe_as_run
BOUND_SPEC = 3e-2  # against fp8_reference.moe_reference (y, dx, d topk_weights)


def _cuda_leaves(x, ids, s, w13, w2, dy):
    return [t.detach().cuda().requires_grad_(t.requires_grad) for t in (x, ids, s, w13, w2, dy)]


def _fp8_run(problem, **kwargs):
    x, ids, s, w13, w2, dy = _cuda_leaves(*problem)
    return grads_of(lambda *a: megamoe.moe(*a, precision="fp8", **kwargs), x, ids, s, w13, w2, dy)


@requires_sm90
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_and_backward_against_the_recipe(case, gen):
    """Tolerances: the kernels and recipe_as_run quantize the same values but for f32 accumulation (the kernels) vs
    float64 (the reference), which flips an e4m3 or 16-bit rounding of a, h or dh now and then, and the 16-bit
    rounding of o per slot; on the CPU an f32 emulation of the same steps stays within 2e-3 of recipe_as_run, the
    bound is 1e-2. fp8_reference.moe_reference keeps a and dh in float64 before quantizing them: rounding them to
    16 bits first moves ~1/64 of their e4m3 roundings by one e4m3 step (2^-4..2^-3 relative), 1.1-1.4e-2 on y and
    dx (2.5e-3 on d topk_weights), bound 3e-2; it quantizes the weight gradients' operands too (not compared). For
    scale, the unquantized layer is ~6e-2 away from either (asserted at least 4x farther than recipe_as_run), and
    the 16-bit megamoe layer ~3e-3 from float64 (printed)."""
    _, T, H, I, E, topk, routing, dtype = case
    problem = make_problem(T, H, I, E, topk, routing, dtype=dtype, gen=gen)
    ours = _fp8_run(problem)
    for name, got in zip(OUTPUTS, ours):
        assert torch.isfinite(got).all(), f"{name}: non-finite elements"
    assert ours[0].dtype == dtype and ours[1].dtype == dtype and ours[3].dtype == dtype
    run = recipe_as_run(*problem, low=dtype)
    spec = fp8_reference.moe_reference(*problem)
    x, ids, s, w13, w2, dy = problem
    unquantized = grads_of(megamoe.moe, *[t.detach().double().requires_grad_() if t.is_floating_point() else t
                                          for t in (x, ids, s, w13, w2)], dy.double())  # CPU reference, f64
    sixteen_bit = grads_of(megamoe.moe, *_cuda_leaves(*problem)[:5], dy.cuda())
    for index, name in enumerate(OUTPUTS):
        err, err_spec = rel_err(ours[index], run[index]), rel_err(ours[index], spec[index])
        err_unq, err_16 = rel_err(ours[index], unquantized[index]), rel_err(sixteen_bit[index], unquantized[index])
        what = (f"{name}: fp8 vs recipe_as_run {err:.2e}, vs moe_reference {err_spec:.2e}, vs unquantized f64 "
                f"{err_unq:.2e} (16-bit megamoe vs f64: {err_16:.2e})")
        print(what)
        assert err < BOUND_RUN, what
        assert err * 4 < err_unq, what + ": no closer to the recipe than to the unquantized layer"
        if index < 3:
            assert err_spec < BOUND_SPEC, what
    recomputed = _fp8_run(problem, recompute=True)
    for name, kept, again in zip(OUTPUTS, ours, recomputed):
        assert torch.equal(kept, again), f"{name}: keep-h and recompute modes differ"
    rerun = _fp8_run(problem)
    for name, first, second in zip(OUTPUTS, ours, rerun):
        assert torch.equal(first, second), f"{name}: two runs differ"


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_experts_is_the_reference_bitwise(dtype, gen):
    E, H, I = 3, 384, 256
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * torch.rand(E, 2 * I, 1, generator=gen) * 4).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) * torch.rand(E, 1, I, generator=gen) * 4).to(dtype)
    w13[1, 128:256, :128] = 0  # a block of zeros: scale 1, bytes 0
    w2[2, 128:256, 128:256] *= 1e-30 if dtype == torch.float32 else 1e-3  # tiny values: small scales
    w2[0, 5, 130] = float("inf")  # a block with an infinity: NaN scale, every byte 0x7F
    w13[2, 300, 7] = float("nan")
    experts = fp8.quantize_experts(w13.cuda(), w2.cuda())
    torch.cuda.synchronize()
    for q, q_t, scales, w, name in ((experts.w13, experts.w13_t, experts.w13_scales, w13, "w13"),
                                    (experts.w2, experts.w2_t, experts.w2_scales, w2, "w2")):
        want_q, want_scales = fp8_reference.quantize_blocks(w)
        assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8)), f"{name}: bytes"
        assert torch.equal(q_t.cpu().view(torch.uint8), want_q.transpose(1, 2).contiguous().view(torch.uint8)), \
            f"{name}_t: bytes"
        torch.testing.assert_close(scales.cpu(), want_scales, rtol=0, atol=0, equal_nan=True,
                                   msg=f"{name}_scales differ")
    assert experts.w13_scales[1, 1, 0].item() == 1.0 and torch.isnan(experts.w2_scales[0, 0, 1])
    fp8.clear_cache()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in
               zip(fp8.experts_for(w13.cuda(), w2.cuda()), experts))


@requires_sm90
def test_torch_compile_fullgraph_equals_eager(gen):
    problem = make_problem(96, 256, 128, 4, 2, "dropped", dtype=torch.bfloat16, gen=gen)
    x, ids, s, w13, w2, dy = _cuda_leaves(*problem)

    def layer(x, ids, s, w13, w2):
        return megamoe.moe(x, ids, s, w13, w2, precision="fp8") * 2  # exact: bitwise comparable

    def with_weights(fp8_experts):
        return lambda x, ids, s, w13, w2: megamoe.moe(x, ids, s, w13, w2, precision="fp8",
                                                      fp8_experts=fp8_experts) * 2

    torch._dynamo.reset()
    eager = grads_of(layer, x, ids, s, w13, w2, dy)
    compiled = grads_of(torch.compile(layer, fullgraph=True), x, ids, s, w13, w2, dy)
    mine = fp8.quantize_experts(w13, w2)
    explicit = grads_of(torch.compile(with_weights(mine), fullgraph=True), x, ids, s, w13, w2, dy)
    for name, a, b, c in zip(OUTPUTS, eager, compiled, explicit):
        assert torch.equal(a, b), f"{name}: compiled differs from eager"
        assert torch.equal(a, c), f"{name}: compiled with the caller's fp8_experts differs from eager"


@requires_sm90
def test_opcheck_with_the_fp8_weights(gen):
    """The ops' schemas, fake kernels and autograd registration with the FP8 weights given (torch.library.opcheck)."""
    x, ids, s, w13, w2, dy = [t.detach() for t in _cuda_leaves(*small_problem(gen, T=40, H=256, I=128, E=4))]
    options = dict(precision="fp8", **dict(zip(_lib.FP8_ARGS, fp8.quantize_experts(w13, w2))))
    torch.library.opcheck(torch.ops.megamoe.quantize_experts.default, (w13, w2))
    # test_schema left out where an input is e4m3: its mutation check compares inputs by torch.allclose, which torch
    # 2.11 does not implement for float8_e4m3fn ("mul_cuda" not implemented); the schema's declared mutations are
    # those of the bf16 ops, which test it.
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, (x, ids, s, w13, w2, False), options,
                          test_utils=checks)
    with torch.no_grad():
        for needs in ({}, {"need_dx": False}):
            torch.library.opcheck(torch.ops.megamoe.moe_backward.default,
                                  (dy, x, ids, s, w13, w2, dy.new_empty(0), False), {**options, **needs},
                                  test_utils=checks)


@requires_sm90
def test_path_of_is_sm90_fp8(gen):
    x, ids, s, w13, w2, _ = _cuda_leaves(*small_problem(gen, T=64, H=256, I=128, E=4))
    counts = torch.bincount(ids[:, 0], minlength=4)
    for backward in (False, True):
        assert megamoe.path_of(x, ids, s, w13, w2, backward=backward, precision="fp8") == "sm90-fp8"
        assert megamoe.path_of(x, ids, s, w13, w2, backward=backward, precision="fp8",
                               fp8_experts=fp8.quantize_experts(w13, w2)) == "sm90-fp8"
        assert megamoe.grouped_path_of(x, counts, w13, w2, backward=backward, precision="fp8") == "sm90-fp8"
        assert megamoe.path_of(x, ids, s, w13, w2, backward=backward) != "sm90-fp8"


@requires_sm90
def test_unsupported_options_are_refused_on_the_gpu(gen):
    x, ids, s, w13, w2, _ = _cuda_leaves(*small_problem(gen, T=16, H=256, I=128, E=4))
    with pytest.raises(NotImplementedError, match="bias"):
        megamoe.moe(x, ids, s, w13, w2, b2=torch.zeros(4, 256, dtype=x.dtype, device="cuda"), precision="fp8")
    with pytest.raises(NotImplementedError, match="SwiGLU"):
        megamoe.moe(x, ids, s, w13, w2, activation=megamoe.clamped_swiglu(), precision="fp8")
    x, ids, s, w13, w2, _ = _cuda_leaves(*small_problem(gen, T=16, H=200, I=128, E=4))
    with pytest.raises(NotImplementedError, match="128"):
        megamoe.moe(x, ids, s, w13, w2, precision="fp8")


@requires_sm90
def test_grouped_rows_against_the_recipe(gen):
    """grouped_moe(precision="fp8") on the whole layer's slots as grouped rows (plus padding rows), added back into
    their tokens: the layer's recipe_as_run, bound 1e-2 as for the layer; padding rows exact zeros."""
    problem = make_problem(160, 256, 256, 6, 2, "dropped", dtype=torch.bfloat16, gen=gen)
    x, ids, s, w13, w2, dy = _cuda_leaves(*problem)
    outs = []

    def layer(x, ids, s, w13, w2, recompute=False):
        x_sorted, counts, scores, token_of_row = group_rows(x, ids, s, w13.shape[0], num_padding=7, gen=gen)
        out = megamoe.grouped_moe(x_sorted, counts, w13, w2, scores, recompute=recompute, precision="fp8")
        outs.append(out.detach())
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return y.index_add(0, token_of_row, out[:token_of_row.numel()].float()).to(x.dtype)

    ours = grads_of(layer, x, ids, s, w13, w2, dy)
    assert torch.equal(outs[0][-7:], torch.zeros_like(outs[0][-7:])), "padding rows are not zero"
    run = recipe_as_run(*problem)
    for name, got, want in zip(OUTPUTS, ours, run):
        assert rel_err(got, want) < BOUND_RUN, f"{name}: {rel_err(got, want):.2e}"
    recomputed = grads_of(lambda *a: layer(*a, recompute=True), x, ids, s, w13, w2, dy)
    for name, a, b in zip(OUTPUTS, ours, recomputed):
        assert torch.equal(a, b), f"{name}: keep-h and recompute modes differ"


@requires_sm90
def test_main_grads_accumulate_the_fp8_weight_gradients(gen):
    problem = make_problem(120, 256, 128, 4, 2, "random", dtype=torch.bfloat16, gen=gen)
    x, ids, s, w13, w2, dy = [t.detach() for t in _cuda_leaves(*problem)]
    previous13 = torch.randn(w13.shape, generator=gen).cuda()
    previous2 = torch.randn(w2.shape, generator=gen).cuda()
    fresh = megamoe.moe_backward(dy, x, ids, s, w13, w2, None, True, precision="fp8")
    buf13, buf2 = previous13.clone(), previous2.clone()
    grads = megamoe.moe_backward(dy, x, ids, s, w13, w2, precision="fp8", main_grads=(buf13, buf2))
    assert grads.dw13 is buf13 and grads.dw2 is buf2
    assert torch.equal(buf13, previous13 + fresh.dw13) and torch.equal(buf2, previous2 + fresh.dw2)
    run = recipe_as_run(*problem)
    assert rel_err(fresh.dw13, run[3]) < BOUND_RUN and rel_err(fresh.dw2, run[4]) < BOUND_RUN
    # autograd: two micro-batches add twice; the weights get no autograd gradient
    w13.requires_grad_(), w2.requires_grad_()
    buf13, buf2 = previous13.clone(), previous2.clone()
    for _ in range(2):
        megamoe.moe(x, ids, s, w13, w2, precision="fp8", main_grads=(buf13, buf2)).backward(dy)
    assert w13.grad is None and w2.grad is None
    assert torch.equal(buf13, previous13 + fresh.dw13 + fresh.dw13) and torch.equal(buf2, previous2 + fresh.dw2
                                                                                     + fresh.dw2)


@requires_sm90
def test_explicit_fp8_experts_equal_the_cache_and_are_read_by_the_backward(gen):
    problem = make_problem(64, 128, 128, 3, 2, "random", dtype=torch.bfloat16, gen=gen)
    fp8.clear_cache()
    cached = _fp8_run(problem)
    x, ids, s, w13, w2, dy = _cuda_leaves(*problem)
    mine = fp8.quantize_experts(w13, w2)
    explicit = grads_of(lambda *a: megamoe.moe(*a, precision="fp8", fp8_experts=mine), x, ids, s, w13, w2, dy)
    for name, a, b in zip(OUTPUTS, cached, explicit):
        assert torch.equal(a, b), f"{name}: the caller's fp8_experts differ from the cache's"
    # other FP8 weights (of other values) change the result: they are read, not recomputed
    other = fp8.quantize_experts(w13 * 2, w2)
    doubled = grads_of(lambda *a: megamoe.moe(*a, precision="fp8", fp8_experts=other), x, ids, s, w13, w2, dy)
    assert not torch.equal(doubled[0], cached[0])


def test_default_layout_weights_of_every_layout(gen):
    """The FP8 copies of the separate and transposed layouts come from their weights brought into the default layout
    (the gate rows, then the up rows; untransposed); the interleaved layout is refused."""
    _, _, _, w13, w2, _ = small_problem(gen, H=128, I=128, E=2)
    gate, up = w13[:, :128], w13[:, 128:]
    cases = {
        "concatenated": (megamoe.CONCATENATED, (w13, w2, None)),
        "hf_transposed": (megamoe.HF_TRANSPOSED, (w13.transpose(1, 2), w2.transpose(1, 2), None)),
        "separate": (megamoe.SEPARATE, (gate, w2, up)),
        "separate_transposed": (megamoe.Layout("separate", True, True),
                                (gate.transpose(1, 2), w2.transpose(1, 2), up.transpose(1, 2))),
    }
    for name, (layout, (a, b, c)) in cases.items():
        options = op_options(layout, None)
        got13, got2 = fp8.default_layout_weights(a, b, c, options)
        assert torch.equal(got13, w13) and torch.equal(got2, w2), name
    with pytest.raises(NotImplementedError, match="interleaved"):
        fp8.default_layout_weights(w13, w2, None, op_options(megamoe.INTERLEAVED, None))


@requires_sm90
@pytest.mark.parametrize("name", ["hf_transposed", "separate", "separate_transposed"])
def test_layouts_run_the_default_layouts_fp8_bits(gen, name):
    """A layout other than the default, stored from the same weights, gives the default layout's FP8 y, dx and
    d topk_weights bitwise (the FP8 kernels read the same default-layout copies) and its weight gradients in the
    layout's arrangement."""
    x, ids, s, w13, w2, dy = _cuda_leaves(*small_problem(gen, T=64, H=256, I=128, E=4))
    want = grads_of(lambda *a: megamoe.moe(*a, precision="fp8"), x, ids, s, w13, w2, dy)
    I = w2.shape[2]
    t = lambda w: w.detach().transpose(1, 2).contiguous().requires_grad_()  # noqa: E731
    leaf = lambda w: w.detach().clone().requires_grad_()  # noqa: E731
    if name == "hf_transposed":
        a, b, c, layout = t(w13), t(w2), None, megamoe.HF_TRANSPOSED
    else:
        transposed = name == "separate_transposed"
        arrange = t if transposed else leaf
        a, b, c = arrange(w13[:, :I]), arrange(w2) if not transposed else t(w2), arrange(w13[:, I:])
        layout = megamoe.Layout("separate", transposed, transposed)
    y = megamoe.moe(x, ids, s, a, b, precision="fp8", layout=layout, w3=c)
    y.backward(dy)
    assert megamoe.path_of(x, ids, s, a, b, layout=layout, w3=c, precision="fp8") == "sm90-fp8"
    assert torch.equal(y.detach(), want[0]), f"{name}: y"
    assert torch.equal(x.grad, want[1]) and torch.equal(s.grad, want[2]), f"{name}: dx, d topk_weights"
    back = (lambda g: g.transpose(1, 2)) if layout.w13_transposed else (lambda g: g)
    dw13 = back(a.grad) if c is None else torch.cat([back(a.grad), back(c.grad)], dim=1)
    dw2 = b.grad.transpose(1, 2) if layout.w2_transposed else b.grad
    # The weight gradients are the 16-bit K-grouped GEMMs of each layout (operands swapped where transposed): the
    # same sums, within their bf16 rounding.
    assert rel_err(dw13, want[3]) < 4e-3 and rel_err(dw2, want[4]) < 4e-3, f"{name}: the weight gradients"
