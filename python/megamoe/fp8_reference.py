"""The CPU reference of the blockwise FP8 recipe (DeepSeek-V3, arXiv 2412.19437 section 3.3): what the
FP8 kernels' quantized operands and scales must equal bitwise, and the GEMM they compute.

Quantization of a tensor along one axis (the GEMM's K) in groups of `group` elements (1 x 128 tiles of activations),
or over square blocks of the last two axes (128 x 128 blocks of weights):

    amax   = max |v| over the group, in f32 (bf16 / f16 inputs are widened exactly)
    scale  = amax / 448 (f32 division, round to nearest even); pow2=True: the smallest power of two >= that quotient
             (then v * factor and q * scale are exact operations, and a re-quantization along the other axis is cheap)
    factor = 448 / amax (f32 division; DeepSeek-V3's cast multiplies by it); pow2=True: 1 / scale (exact); at most
             the largest finite f32
    q      = e4m3(clamp(v * factor, -448, 448)) (one f32 multiplication), round to nearest even
             (torch.float8_e4m3fn); v = q * scale back

Defined edge cases (never a silent wrong number):
  - a group of zeros: scale 1, factor 1, q 0 (dequantizes to the zeros);
  - a group holding a NaN or an infinity: scale NaN, every q the NaN byte 0x7F (the whole group reads back NaN).
    torch's own e4m3 cast would turn an infinity into 448, a finite number nobody asked for;
  - a scale below 2^-149 (the smallest positive f32: amax under ~6e-43) is raised to it, pow2 or not; a factor past
    the largest finite f32 (amax under ~1.3e-36, or a power-of-two scale under 2^-127) is lowered to it.
A partial last group (K not a multiple of `group`) is a group of its own. Along tokens (the weight gradients'
operands, quantize_expert_rows) the groups are 128 of one expert's rows from its first row, never two experts', each
written into 128 columns of its own (zero-padded) as the kernels lay them out.

This module is the specification; it is not tuned (f32 torch on the CPU). Dequantized products go through float64
in `blockwise_gemm`, the recipe's GEMM: out = sum over K groups of (a_q . b_q) * a_scale * b_scale, and in
`moe_reference`, the whole layer's forward and backward with every GEMM operand quantized as the recipe says.
"""
import math

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GROUP = 128  # elements per scale along K (activations: 1 x 128 tiles; weights: 128 x 128 blocks)
_MIN_SCALE = math.ldexp(1.0, -149)  # the smallest positive f32 (a denormal)


def _scales_from_amax(amax, pow2):
    """f32 scales of f32 amax values (same shape): see the module's rules."""
    finite = torch.isfinite(amax)
    safe = torch.where(finite & (amax > 0), amax, torch.ones_like(amax))
    scale = torch.clamp(safe / E4M3_MAX, min=_MIN_SCALE)  # f32, round to nearest even; at least 2^-149
    if pow2:
        mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # already a power of two: keep it
        scale = torch.ldexp(torch.ones_like(scale), exponent)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(finite, scale, torch.full_like(scale, float("nan")))


E4M3_NAN_BITS = 0x7F  # the one NaN encoding written (e4m3fn has two, 0x7F and 0xFF)


_MAX_FACTOR = torch.finfo(torch.float32).max


def _factors_from_amax(amax, scale, pow2):
    """f32 factors of the groups (amax, scale and the result of one shape): see the module's rules."""
    safe = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
    # f32 tensor / tensor divisions, round to nearest even (torch computes `scalar / tensor` as a reciprocal times the
    # scalar: two roundings)
    factor = torch.ones_like(scale) / scale if pow2 else torch.full_like(safe, E4M3_MAX) / safe
    factor = torch.clamp(torch.where(amax == 0, torch.ones_like(factor), factor), max=_MAX_FACTOR)
    return torch.where(torch.isnan(factor), torch.ones_like(factor), factor)  # a NaN scale: unused (0x7F bytes)


def _cast(values, scale, factor):
    """e4m3 of values * factor (f32 tensors broadcast together), clamped to +-448; a NaN scale gives 0x7F
    everywhere (the kernels write the same byte, whatever the sign of the NaN)."""
    ratio = torch.clamp(values * factor, -E4M3_MAX, E4M3_MAX)
    q = ratio.to(E4M3)
    q.view(torch.uint8)[torch.isnan(scale).expand_as(ratio)] = E4M3_NAN_BITS
    return q


def quantize_groups(x, group=GROUP, dim=-1, pow2=False):
    """(q e4m3 of x's shape, scales f32 with x's shape but ceil(K / group) along dim): x quantized in groups of
    `group` consecutive elements along dim (the activations' 1 x 128 tiles when dim is the GEMM's K)."""
    if not x.is_floating_point():
        raise TypeError(f"quantize_groups: x must be a floating-point tensor, got {x.dtype}")
    if group <= 0:
        raise ValueError(f"quantize_groups: group must be positive, got {group}")
    moved = x.detach().to(torch.float32).movedim(dim, -1)
    K = moved.shape[-1]
    num_groups = -(-K // group)
    padded = torch.nn.functional.pad(moved, (0, num_groups * group - K))  # zeros: change no amax
    grouped = padded.reshape(*moved.shape[:-1], num_groups, group)
    amax = grouped.abs().amax(dim=-1)
    scales = _scales_from_amax(amax, pow2)  # NaN where the group holds one
    scales = torch.where(torch.isnan(grouped).any(dim=-1), torch.full_like(scales, float("nan")), scales)
    factors = _factors_from_amax(amax, scales, pow2)
    q = _cast(grouped, scales.unsqueeze(-1), factors.unsqueeze(-1))
    q = q.reshape(*moved.shape[:-1], num_groups * group)[..., :K]
    return q.movedim(-1, dim).contiguous(), scales.movedim(-1, dim).contiguous()


def quantize_blocks(w, block=GROUP, pow2=False):
    """(q e4m3 of w's shape, scales f32 [..., ceil(N / block), ceil(K / block)]): w [..., N, K] quantized over
    block x block squares of its last two axes (the weights' 128 x 128 blocks; partial blocks at the edges)."""
    if not w.is_floating_point() or w.dim() < 2:
        raise TypeError(f"quantize_blocks: w must be a floating-point tensor of 2 or more dims, got {w.dtype} "
                        f"with {w.dim()}")
    if block <= 0:
        raise ValueError(f"quantize_blocks: block must be positive, got {block}")
    values = w.detach().to(torch.float32)
    N, K = values.shape[-2:]
    nb, kb = -(-N // block), -(-K // block)
    padded = torch.nn.functional.pad(values, (0, kb * block - K, 0, nb * block - N))
    blocks = padded.reshape(*values.shape[:-2], nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-3, -1))
    scales = _scales_from_amax(amax, pow2)
    scales = torch.where(torch.isnan(blocks).any(dim=-3).any(dim=-1), torch.full_like(scales, float("nan")), scales)
    factors = _factors_from_amax(amax, scales, pow2)
    q = _cast(blocks, scales.unsqueeze(-1).unsqueeze(-3), factors.unsqueeze(-1).unsqueeze(-3))
    q = q.reshape(*values.shape[:-2], nb * block, kb * block)
    return q[..., :N, :K].contiguous(), scales.contiguous()


def _expert_tiles(counts, rows):
    """counts as ints (checked against the R rows) and each expert's M tile count, ceil(count / 128)."""
    counts = [int(c) for c in counts]
    if sum(counts) != rows or any(c < 0 for c in counts):
        raise ValueError(f"quantize_expert_rows: counts must be >= 0 and sum to the {rows} rows, got {counts}")
    return counts, [-(-c // GROUP) for c in counts]


def quantize_expert_rows(rows, counts, pow2=False):
    """The weight gradients' operands, quantized along tokens: rows [R, C] sorted by expert (expert e's rows follow
    e - 1's, counts[e] of them, R = sum(counts)) in groups of 128 of an expert's rows counted from its first row (a
    group never spans two experts): the routing's M tiles (m_tile_offsets: tile m_tile_offsets[e] + g holds expert e's
    rows [128 g, 128 g + 128)). Returns, tile-padded as the K-grouped FP8 GEMM loads them by TMA (the kernel
    launch_quantize_expert_rows' layout):
      q_t e4m3 [C, 128 * num_tiles]: transposed, tokens contiguous; tile i at columns [128 i, 128 i + 128), its rows
          first, then zeros (the byte 0x00) to 128 (a GEMM reading whole 128-column groups sums nothing from the pad);
      scales f32 [num_tiles, C]: tile-major, scales[i, c] scales q_t[c, 128 i:128 i + 128].
    Expert e's row j lies at column 128 * m_tile_offsets[e] + j (its tiles are consecutive)."""
    counts, tiles = _expert_tiles(counts, rows.shape[0])
    num_cols, num_tiles = rows.shape[1], sum(tiles)
    q_t = torch.zeros(num_cols, GROUP * num_tiles, dtype=torch.uint8)  # the pads stay 0x00
    scales = torch.empty(num_tiles, num_cols)
    first, tile = 0, 0
    for count, expert_tiles in zip(counts, tiles):
        if count:
            q, s = quantize_groups(rows[first:first + count], dim=0, pow2=pow2)  # [count, C], [tiles_e, C]
            q_t[:, GROUP * tile:GROUP * tile + count] = q.view(torch.uint8).T
            scales[tile:tile + expert_tiles] = s
        first, tile = first + count, tile + expert_tiles
    return q_t.view(E4M3), scales


def dequantize_expert_rows(q_t, scales, counts):
    """float64 [R, C] values of quantize_expert_rows' output (q * its tile's scale), rows in the sorted order (the
    pads dropped)."""
    counts, tiles = _expert_tiles(counts, sum(int(c) for c in counts))
    parts, tile = [], 0
    for count, expert_tiles in zip(counts, tiles):
        if count:
            values = q_t[:, GROUP * tile:GROUP * tile + count].to(torch.float64).T  # [count, C]
            expanded = scales[tile:tile + expert_tiles].to(torch.float64).repeat_interleave(GROUP, dim=0)[:count]
            parts.append(values * expanded)
        tile += expert_tiles
    if not parts:
        return torch.empty(0, q_t.shape[0], dtype=torch.float64)
    return torch.cat(parts, dim=0)


def dequantize_groups(q, scales, group=GROUP, dim=-1, dtype=torch.float32):
    """quantize_groups' output as values of dtype (q * its group's scale; exact in float64, where q's 4 significant
    bits times the scale's 24 fit, rounded once in float32)."""
    expanded = scales.to(dtype).repeat_interleave(group, dim=dim).narrow(dim, 0, q.shape[dim])
    return q.to(dtype) * expanded


def dequantize_blocks(q, scales, block=GROUP, dtype=torch.float32):
    """quantize_blocks' output as values of dtype (q * its block's scale; exact in float64)."""
    N, K = q.shape[-2:]
    expanded = scales.to(dtype).repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.to(dtype) * expanded[..., :N, :K]


def blockwise_gemm(a_q, a_scales, b_q, b_scales, group=GROUP):
    """The recipe's GEMM in float64: a [M, K] in 1 x group tiles along K (scales [M, ceil(K / group)]), b [N, K] in
    group x group blocks (scales [ceil(N / group), ceil(K / group)]); out [M, N] = sum over K groups g of
    (a_q[:, g] . b_q[:, g]^T) * a_scale[:, g] * b_scale[n block, g] (every partial promoted per group)."""
    M, K = a_q.shape
    N = b_q.shape[0]
    if b_q.shape[1] != K:
        raise ValueError(f"blockwise_gemm: a is [{M}, {K}] but b is {list(b_q.shape)}: K differs")
    a = a_q.to(torch.float64)
    b = b_q.to(torch.float64)
    b_row_scales = b_scales.to(torch.float64).repeat_interleave(group, dim=0)[:N]  # [N, groups]
    out = torch.zeros(M, N, dtype=torch.float64)
    for g in range(-(-K // group)):
        cols = slice(g * group, min(K, (g + 1) * group))
        partial = a[:, cols] @ b[:, cols].T
        out += partial * a_scales[:, g].to(torch.float64).unsqueeze(1) * b_row_scales[:, g].unsqueeze(0)
    return out


def _along(values, dim, pow2):
    """values quantized in 1 x 128 groups along dim and dequantized, in float64."""
    q, scales = quantize_groups(values, dim=dim, pow2=pow2)
    return dequantize_groups(q, scales, dim=dim, dtype=torch.float64)


def _blocks64(w, pow2):
    """w [..., N, K] quantized in 128 x 128 blocks and dequantized, in float64."""
    return dequantize_blocks(*quantize_blocks(w, pow2=pow2), dtype=torch.float64)


def moe_reference(x, topk_ids, topk_weights, w13, w2, dy, pow2=False):
    """The whole layer (DESIGN.md section 1: w13 [E, 2I, H] as [gate; up], w2 [E, H, I], SwiGLU, ids -1 dropped) under
    the recipe, in float64 between the quantization points: (y, dx, d topk_weights, dw13, dw2). Each GEMM quantizes
    its operands along its own K (the activations in 1 x 128 groups, the weights in 128 x 128 blocks, whose
    transposes are the transposed blocks with the same scales, so the data gradients reuse them):

        up    h = x . w13[e]^T           x along H (per token, gathered), w13 blocks
        down  o = a . w2[e]^T            a = silu(g) u along I
        dH    p = dy . w2[e]             dy along H (per token, gathered), w2 blocks (transposed)
        dX    q = dh . w13[e]            dh = dSwiGLU(g, u, s p) along 2I, w13 blocks (transposed)
        dW13  dh^T . x                   dh and x along tokens: groups of 128 of the expert's rows from its first
        dW2   dy^T . (s a)               dy and s a along tokens, the same groups

    y = sum_j s_j o_j and dx = sum_j q_j over a token's slots; d topk_weights = <p, a> with a from h unquantized (as
    the dSwiGLU epilogue has it). Rows of an expert are its slots in slot order."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    topk = topk_ids.shape[1]
    if bool(((topk_ids < -1) | (topk_ids >= E)).any()):
        raise ValueError(f"moe_reference: topk_ids must lie in [-1, {E})")
    x64 = x.detach().to(torch.float64)
    dy64 = dy.detach().to(torch.float64)
    x_by_h = _along(x, -1, pow2)  # the forward's copy of x: [T, H]
    dy_by_h = _along(dy, -1, pow2)  # dH's copy of dy: [T, H]
    w13_deq, w2_deq = _blocks64(w13, pow2), _blocks64(w2, pow2)
    y = torch.zeros(T, H, dtype=torch.float64)
    dx = torch.zeros(T, H, dtype=torch.float64)
    dtopk = torch.zeros(T * topk, dtype=torch.float64)
    dw13 = torch.zeros(E, two_i, H, dtype=torch.float64)
    dw2 = torch.zeros(E, H, I, dtype=torch.float64)
    flat_ids = topk_ids.reshape(-1)
    weights = topk_weights.detach().reshape(-1).to(torch.float64)
    for e in range(E):
        slots = (flat_ids == e).nonzero().flatten()  # the expert's rows, in slot order
        if slots.numel() == 0:
            continue
        tokens = slots // topk
        s = weights[slots].unsqueeze(1)  # [n, 1]
        h = x_by_h[tokens] @ w13_deq[e].T  # [n, 2I]
        gate, up = h[:, :I], h[:, I:]
        sig = torch.sigmoid(gate)
        a = gate * sig * up  # [n, I]
        o = _along(a, -1, pow2) @ w2_deq[e].T  # [n, H]
        y.index_add_(0, tokens, s * o)
        p = dy_by_h[tokens] @ w2_deq[e]  # [n, I]
        dtopk[slots] = (p * a).sum(dim=1)
        d_act = s * p
        dh = torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * gate * sig], dim=1)  # [n, 2I]
        dx.index_add_(0, tokens, _along(dh, -1, pow2) @ w13_deq[e])
        dw13[e] = _along(dh, 0, pow2).T @ _along(x64[tokens], 0, pow2)  # quantize_expert_rows' groups, expert e's
        dw2[e] = _along(dy64[tokens], 0, pow2).T @ _along(s * a, 0, pow2)
    return y, dx, dtopk.reshape(T, topk), dw13, dw2
