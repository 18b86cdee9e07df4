"""The CPU reference of the blockwise FP8 recipe (megamoe.fp8_reference): the quantization rules (scale =
amax / 448, each value multiplied by the factor 448 / amax, or 1 / scale for power-of-two scales) checked
against loops written out element by element, the edge cases the module defines (zero groups, the E4M3 limit, NaN
and infinities, partial groups, power-of-two scales), and the recipe's GEMM against float64 on the dequantized
operands, and the whole layer under the recipe against the unquantized layer. Fresh random data each run (the gen
fixture prints its seed)."""
import math

import pytest
import torch

from conftest import grads_of, make_problem, rel_err, torch_moe
from megamoe import fp8_reference as fp8

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).float()
FINITE_E4M3 = E4M3_VALUES[torch.isfinite(E4M3_VALUES)]


def random_bf16(shape, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


def group_amax_loop(x, group):
    """[rows, ceil(K / group)] amax of each group of x [rows, K], by Python loops."""
    rows, K = x.shape
    out = torch.empty(rows, -(-K // group))
    for r in range(rows):
        for g in range(out.shape[1]):
            out[r, g] = max(abs(float(v)) for v in x[r, g * group:(g + 1) * group])
    return out


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("K", [128, 300, 1])
def test_groups_follow_the_rules(gen, pow2, K):
    x = random_bf16((7, K), gen, scale=3.0)
    q, scales = fp8.quantize_groups(x, pow2=pow2)
    assert q.dtype == fp8.E4M3 and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (7, -(-K // 128))
    amax = group_amax_loop(x.float(), 128)
    want_scales = amax / 448.0
    if pow2:
        want_scales = torch.tensor([[2.0 ** math.ceil(math.log2(float(s))) for s in row] for row in want_scales])
    assert torch.equal(scales, want_scales)
    # q: every element, written out (the f32 product with the group's factor, 448 / amax or 1 / scale for pow2,
    # clamped, rounded to the nearest e4m3, ties to even)
    xf = x.float()
    factors = torch.ones_like(scales) / scales if pow2 else torch.full_like(amax.float(), 448.0) / amax.float()
    for r in range(x.shape[0]):
        for k in range(K):
            ratio = torch.tensor(float(xf[r, k]), dtype=torch.float32) * factors[r, k // 128]
            ratio = min(max(float(ratio), -448.0), 448.0)
            nearest = FINITE_E4M3[(FINITE_E4M3 - ratio).abs().argmin()]
            assert abs(float(q[r, k].float()) - ratio) <= abs(float(nearest) - ratio)
    # back: within half an e4m3 step of x (relative 2^-4 in the normal range, 2^-10 of the scale below it)
    back = fp8.dequantize_groups(q, scales)
    bound = 2.0 ** -4 * xf.abs() * (1 + 1e-6) + 2.0 ** -10 * scales.repeat_interleave(128, dim=1)[:, :K]
    assert bool(((back - xf).abs() <= bound).all())


def test_group_max_reaches_the_e4m3_limit(gen):
    x = random_bf16((5, 256), gen)
    q, scales = fp8.quantize_groups(x)
    for r in range(5):
        for g in range(2):
            group = x[r, g * 128:(g + 1) * 128].float()
            idx = group.abs().argmax()
            assert float(q[r, g * 128 + idx].float().abs()) == 448.0


def test_pow2_scales_make_exact_values_round_trip(gen):
    codes = FINITE_E4M3[torch.randint(len(FINITE_E4M3), (4, 256), generator=gen)]
    codes[:, 0] = 448.0  # each group's amax at the limit, so the scale is exactly its power of two
    codes[:, 128] = -448.0
    exponents = torch.randint(-20, 20, (4, 2), generator=gen).float()
    x = codes * torch.exp2(exponents).repeat_interleave(128, dim=1)
    q, scales = fp8.quantize_groups(x, pow2=True)
    assert torch.equal(scales, torch.exp2(exponents))
    assert torch.equal(fp8.dequantize_groups(q, scales), x)


def test_zero_groups_get_scale_one(gen):
    x = random_bf16((3, 384), gen)
    x[1, 128:256] = 0
    q, scales = fp8.quantize_groups(x)
    assert scales[1, 1] == 1.0
    assert bool((q[1, 128:256].float() == 0).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_values_poison_their_group_only(gen, bad):
    x = random_bf16((3, 384), gen).float()
    clean_q, clean_scales = fp8.quantize_groups(x)
    x[2, 200] = bad
    q, scales = fp8.quantize_groups(x)
    assert math.isnan(float(scales[2, 1]))
    assert bool((q[2, 128:256].view(torch.uint8) == fp8.E4M3_NAN_BITS).all())
    keep = torch.ones_like(scales, dtype=torch.bool)
    keep[2, 1] = False
    assert torch.equal(scales[keep], clean_scales[keep])
    keep_q = torch.ones(x.shape, dtype=torch.bool)
    keep_q[2, 128:256] = False
    assert torch.equal(q.view(torch.uint8)[keep_q], clean_q.view(torch.uint8)[keep_q])


@pytest.mark.parametrize("pow2", [False, True])
def test_tiny_scales_stay_positive(pow2):
    x = torch.full((1, 128), 1e-44)  # amax / 448 underflows to 0 in f32
    q, scales = fp8.quantize_groups(x, pow2=pow2)
    assert float(scales[0, 0]) == math.ldexp(1.0, -149)
    assert bool(torch.isfinite(fp8.dequantize_groups(q, scales)).all())


def test_known_bytes():
    """A group worked by hand (tests/cpp/test_fp8_quant_cuda.cpp holds the kernel to the same bytes): amax 896 gives
    scale 2; 896 -> 448 = 1.75 * 2^8 (0x7E), 1 -> 0.5 (0x30), -3 -> -1.5 (0xBC), 0 -> 0x00."""
    x = torch.zeros(1, 128)
    x[0, :3] = torch.tensor([896.0, 1.0, -3.0])
    q, scales = fp8.quantize_groups(x)
    assert scales.tolist() == [[2.0]]
    assert q.view(torch.uint8)[0, :4].tolist() == [0x7E, 0x30, 0xBC, 0x00]


def test_groups_along_tokens_are_the_transposed_groups(gen):
    x = random_bf16((300, 64), gen)
    q, scales = fp8.quantize_groups(x, dim=0)
    q_t, scales_t = fp8.quantize_groups(x.T.contiguous(), dim=-1)
    assert scales.shape == (3, 64)
    assert torch.equal(q.view(torch.uint8), q_t.T.contiguous().view(torch.uint8))
    assert torch.equal(scales, scales_t.T)


@pytest.mark.parametrize("pow2", [False, True])
def test_blocks_follow_the_rules(gen, pow2):
    w = random_bf16((2, 200, 300), gen, scale=0.05)
    q, scales = fp8.quantize_blocks(w, pow2=pow2)
    assert q.shape == w.shape and scales.shape == (2, 2, 3)
    for e in range(2):
        for nb in range(2):
            for kb in range(3):
                block = w[e, nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128].float()
                scale = torch.tensor(float(block.abs().max()), dtype=torch.float32) / 448.0
                if pow2:
                    scale = torch.tensor(2.0 ** math.ceil(math.log2(float(scale))))
                assert float(scales[e, nb, kb]) == float(scale)
                factor = torch.tensor(1.0) / scale if pow2 else torch.tensor(448.0) / block.abs().max()  # f32
                want = torch.clamp(block * factor, -448, 448).to(fp8.E4M3)
                got = q[e, nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    back = fp8.dequantize_blocks(q, scales)
    assert float((back - w.float()).norm() / w.float().norm()) < 2.0 ** -4


def test_blockwise_gemm_is_the_dequantized_product(gen):
    a_q, a_scales = fp8.quantize_groups(random_bf16((33, 300), gen))
    b_q, b_scales = fp8.quantize_blocks(random_bf16((140, 300), gen))
    got = fp8.blockwise_gemm(a_q, a_scales, b_q, b_scales)
    # float64 operands (q * scale needs 4 + 24 significant bits: exact in float64, not in float32)
    a = fp8.dequantize_groups(a_q, a_scales, dtype=torch.float64)
    b = fp8.dequantize_blocks(b_q, b_scales, dtype=torch.float64)
    want = a @ b.T
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="quantize_groups: x"):
        fp8.quantize_groups(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="group must be positive"):
        fp8.quantize_groups(torch.ones(4, 4), group=0)
    with pytest.raises(TypeError, match="quantize_blocks: w"):
        fp8.quantize_blocks(torch.ones(4))
    a_q, a_s = fp8.quantize_groups(torch.ones(2, 128))
    b_q, b_s = fp8.quantize_blocks(torch.ones(2, 256))
    with pytest.raises(ValueError, match="K differs"):
        fp8.blockwise_gemm(a_q, a_s, b_q, b_s)


LAYER_CASES = [  # (name, T, H, I, E, topk, routing): partial groups and blocks, dropped slots, an empty expert
    ("ragged", 150, 200, 136, 4, 2, "random"),
    ("dropped_slots", 90, 256, 128, 3, 3, "dropped"),
    ("half_empty", 70, 130, 72, 6, 2, "half_empty"),
    ("topk1", 40, 128, 64, 2, 1, "random"),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layer_is_close_to_the_unquantized_one(gen, case):
    _, T, H, I, E, topk, routing = case
    x, ids, s, w13, w2, dy = make_problem(T, H, I, E, topk, routing, gen=gen)
    want = grads_of(torch_moe, x, ids, s, w13, w2, dy)
    got = fp8.moe_reference(x, ids, s, w13, w2, dy)
    for name, g, w in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, want):
        err = rel_err(g, w)
        # e4m3 rounds each operand by ~2.6 % RMS (3 mantissa bits); two quantized GEMMs in a row give 5-8 % on
        # these sizes (d topk_weights, a few dozen values, swings most). Never exact: the quantization happened.
        assert 1e-4 < err < 0.12, f"{name}: relative error {err:.3g} against the unquantized layer"
    for e in range(E):  # an expert no slot routes to has zero weight gradients
        if not bool((ids == e).any()):
            assert not bool(got[3][e].any()) and not bool(got[4][e].any())


@pytest.mark.parametrize("pow2", [False, True])
def test_layer_backward_scales_exactly_with_dy(gen, pow2):
    """Scaling dy by 2^k scales every group's amax and scale by 2^k and leaves every e4m3 value as it was: the
    gradients scale by exactly 2^k (y does not move)."""
    x, ids, s, w13, w2, dy = make_problem(60, 256, 128, 3, 2, gen=gen)
    base = fp8.moe_reference(x, ids, s, w13, w2, dy, pow2=pow2)
    scaled = fp8.moe_reference(x, ids, s, w13, w2, dy * 8.0, pow2=pow2)
    assert torch.equal(base[0], scaled[0])
    for b, t in zip(base[1:], scaled[1:]):
        assert torch.equal(b * 8.0, t)


def test_layer_forward_is_two_blockwise_gemms(gen):
    """One expert, topk 1: y = s (a_q . w2_q) with a = SwiGLU(x_q . w13_q), each a blockwise_gemm of the operands
    quantized as the recipe says (x and a along their K, the weights in blocks)."""
    x, ids, s, w13, w2, dy = make_problem(50, 300, 136, 1, 1, gen=gen)
    h = fp8.blockwise_gemm(*fp8.quantize_groups(x), *fp8.quantize_blocks(w13[0]))
    a = torch.nn.functional.silu(h[:, :136]) * h[:, 136:]
    want = s.detach() * fp8.blockwise_gemm(*fp8.quantize_groups(a), *fp8.quantize_blocks(w2[0]))
    got = fp8.moe_reference(x, ids, s, w13, w2, dy)[0]
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())


def test_layer_refuses_out_of_range_ids(gen):
    x, ids, s, w13, w2, dy = make_problem(8, 128, 64, 2, 1, gen=gen)
    ids = ids.clone()
    ids[0, 0] = 2
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        fp8.moe_reference(x, ids, s, w13, w2, dy)


@pytest.mark.parametrize("pow2", [False, True])
def test_expert_rows_groups_restart_at_each_expert(gen, pow2):
    """Along tokens, the groups are 128 of an expert's rows from its first row, tile-padded: tile i (the routing's M
    tile i) at q_t's columns [128 i, 128 i + 128), the expert's rows then zero bytes, its scales in row i of the
    tile-major scales; the bytes are each expert's rows quantized on their own. Experts of 130 rows (a tile and 2
    rows), none, 5, 256 (two whole tiles), 1, 128 (one whole tile) and 129."""
    counts = [130, 0, 5, 256, 1, 128, 129]
    rows = random_bf16((sum(counts), 40), gen)
    q_t, scales = fp8.quantize_expert_rows(rows, counts, pow2=pow2)
    tiles = [-(-c // 128) for c in counts]
    assert q_t.dtype == fp8.E4M3 and q_t.shape == (40, 128 * sum(tiles))
    assert scales.dtype == torch.float32 and scales.shape == (sum(tiles), 40)
    first, tile = 0, 0
    for count, num_tiles in zip(counts, tiles):
        if count:
            q, s = fp8.quantize_groups(rows[first:first + count], dim=0, pow2=pow2)
            columns = q_t[:, 128 * tile:128 * (tile + num_tiles)].view(torch.uint8)
            assert torch.equal(columns[:, :count], q.T.contiguous().view(torch.uint8))
            assert torch.equal(columns[:, count:], torch.zeros(40, 128 * num_tiles - count, dtype=torch.uint8))
            assert torch.equal(scales[tile:tile + num_tiles], s)
        first, tile = first + count, tile + num_tiles
    # a group never spans two experts: expert 2's 5 rows (tile 2) have a scale of their own
    want = rows[130:135].float().abs().amax(dim=0) / 448.0
    if not pow2:
        assert torch.equal(scales[2], want)
    back = fp8.dequantize_expert_rows(q_t, scales, counts)
    assert back.dtype == torch.float64 and back.shape == rows.shape
    assert float((back - rows.double()).norm() / rows.double().norm()) < 2.0 ** -4
    # dequantize_expert_rows is q times its tile's scale, row by row in the sorted order
    first, tile = 0, 0
    for count, num_tiles in zip(counts, tiles):
        for j in range(count):
            i = tile + j // 128
            want_row = q_t[:, 128 * tile + j].double() * scales[i].double()
            assert torch.equal(back[first + j], want_row)
        first, tile = first + count, tile + num_tiles


def test_expert_rows_pad_stays_zero_beside_a_nan(gen):
    """A NaN in a partial tile: that column's scale NaN and its rows' bytes 0x7F, the pad bytes still 0x00; the other
    columns as they were."""
    counts = [3, 128]
    rows = random_bf16((sum(counts), 8), gen)
    rows[1, 2] = float("nan")
    q_t, scales = fp8.quantize_expert_rows(rows, counts)
    assert torch.isnan(scales[0, 2]) and not torch.isnan(scales[0, :2]).any() and not torch.isnan(scales[1]).any()
    assert torch.equal(q_t[2, :3].view(torch.uint8), torch.full((3,), fp8.E4M3_NAN_BITS, dtype=torch.uint8))
    assert torch.equal(q_t[:, 3:128].view(torch.uint8), torch.zeros(8, 125, dtype=torch.uint8))
    back = fp8.dequantize_expert_rows(q_t, scales, counts)
    assert torch.isnan(back[:3, 2]).all() and not torch.isnan(back[3:]).any()


def test_expert_rows_of_no_rows():
    q_t, scales = fp8.quantize_expert_rows(torch.empty(0, 6, dtype=torch.bfloat16), [0, 0])
    assert q_t.shape == (6, 0) and scales.shape == (0, 6)
    assert fp8.dequantize_expert_rows(q_t, scales, [0, 0]).shape == (0, 6)


def test_expert_rows_refuse_counts_that_do_not_add_up(gen):
    with pytest.raises(ValueError, match="quantize_expert_rows: counts"):
        fp8.quantize_expert_rows(random_bf16((10, 8), gen), [4, 5])
