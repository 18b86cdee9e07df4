"""The CPU reference of the blockwise FP8 recipe (issue #20; DeepSeek-V3, arXiv 2412.19437 section 3.3): what the
FP8 kernels' quantized operands and scales must equal bitwise, and the GEMM they compute.

Quantization of a tensor along one axis (the GEMM's K) in groups of `group` elements (1 x 128 tiles of activations),
or over square blocks of the last two axes (128 x 128 blocks of weights):

    amax  = max |v| over the group, in f32 (bf16 / f16 inputs are widened exactly)
    scale = amax / 448 (f32 division, round to nearest even); pow2=True: the smallest power of two >= that quotient
            (then v / scale and q * scale are exact operations, and a re-quantization along the other axis is cheap)
    q     = e4m3(clamp(v / scale, -448, 448)), round to nearest even (torch.float8_e4m3fn); v = q * scale back

Defined edge cases (never a silent wrong number):
  - a group of zeros: scale 1, q 0 (dequantizes to the zeros);
  - a group holding a NaN or an infinity: scale NaN, every q NaN (the whole group reads back NaN). torch's own e4m3
    cast would turn an infinity into 448, a finite number nobody asked for;
  - a scale below 2^-149 (the smallest positive f32: amax under ~6e-43) is raised to it, pow2 or not.
A partial last group (K not a multiple of `group`) is a group of its own.

This module is the specification; it is not tuned (f32 torch on the CPU). Dequantized products go through float64
in `blockwise_gemm`, the recipe's GEMM: out = sum over K groups of (a_q . b_q) * a_scale * b_scale.
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
    scale = safe / E4M3_MAX  # f32, round to nearest even
    if pow2:
        mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # already a power of two: keep it
        scale = torch.ldexp(torch.ones_like(scale), exponent)
    scale = torch.clamp(scale, min=_MIN_SCALE)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(finite, scale, torch.full_like(scale, float("nan")))


def _cast(values, scale):
    """e4m3 of values / scale (f32 tensors broadcast together), clamped to +-448; NaN scale gives NaN."""
    ratio = torch.clamp(values / scale, -E4M3_MAX, E4M3_MAX)  # clamp keeps NaN
    return ratio.to(E4M3)


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
    scales = _scales_from_amax(grouped.abs().amax(dim=-1), pow2)  # NaN where the group holds one
    scales = torch.where(torch.isnan(grouped).any(dim=-1), torch.full_like(scales, float("nan")), scales)
    q = _cast(grouped, scales.unsqueeze(-1)).reshape(*moved.shape[:-1], num_groups * group)[..., :K]
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
    scales = _scales_from_amax(blocks.abs().amax(dim=(-3, -1)), pow2)
    scales = torch.where(torch.isnan(blocks).any(dim=-3).any(dim=-1), torch.full_like(scales, float("nan")), scales)
    q = _cast(blocks, scales.unsqueeze(-1).unsqueeze(-3)).reshape(*values.shape[:-2], nb * block, kb * block)
    return q[..., :N, :K].contiguous(), scales.contiguous()


def dequantize_groups(q, scales, group=GROUP, dim=-1):
    """f32 values of quantize_groups' output (q * its group's scale)."""
    expanded = scales.to(torch.float32).repeat_interleave(group, dim=dim).narrow(dim, 0, q.shape[dim])
    return q.to(torch.float32) * expanded


def dequantize_blocks(q, scales, block=GROUP):
    """f32 values of quantize_blocks' output (q * its block's scale)."""
    N, K = q.shape[-2:]
    expanded = scales.to(torch.float32).repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.to(torch.float32) * expanded[..., :N, :K]


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
