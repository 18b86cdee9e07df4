"""The PyTorch face: `megamoe::moe_forward` / `megamoe::moe_backward` custom ops with fake kernels and
autograd, over the C API. CPU tensors run the C++ reference, CUDA tensors the CUDA path, on the current
stream, with every buffer allocated through torch (so CUDA graphs and the caching allocator just work).
"""

import warnings

import torch

from . import _lib

_warned = set()


def _contiguous(name, tensor):
    """The kernels read row-major memory: copy a strided input once, and say so once per argument."""
    if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"megamoe: {name} is not contiguous; copying it (pass a contiguous tensor to avoid this)")
        return tensor.contiguous()
    return tensor


def _inputs(x, topk_ids, topk_weights, w13, w2):
    names = ("x", "topk_ids", "topk_weights", "w13", "w2")
    return [_contiguous(name, t) for name, t in zip(names, (x, topk_ids, topk_weights, w13, w2))]


@torch.library.custom_op("megamoe::moe_forward", mutates_args=())
def moe_forward(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    x, topk_ids, topk_weights, w13, w2 = _inputs(x, topk_ids, topk_weights, w13, w2)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, H]
    _lib.forward_into(x, topk_ids, topk_weights, w13, w2, y)
    return y


@moe_forward.register_fake
def _(x, topk_ids, topk_weights, w13, w2):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("megamoe::moe_backward", mutates_args=())
def moe_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dy = _contiguous("dy", dy)
    x, topk_ids, topk_weights, w13, w2 = _inputs(x, topk_ids, topk_weights, w13, w2)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, H]
    dtopk_weights = torch.empty_like(topk_weights, memory_format=torch.contiguous_format)  # [T, topk]
    dw13 = torch.empty_like(w13, memory_format=torch.contiguous_format)  # [E, 2I, H]
    dw2 = torch.empty_like(w2, memory_format=torch.contiguous_format)  # [E, H, I]
    _lib.backward_into(dy, x, topk_ids, topk_weights, w13, w2, dx, dtopk_weights, dw13, dw2)
    return dx, dtopk_weights, dw13, dw2


@moe_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w13, w2):
    return tuple(
        torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, topk_weights, w13, w2)
    )


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, topk_ids, topk_weights, w13, w2 = ctx.saved_tensors
    dx, dtopk_weights, dw13, dw2 = moe_backward(dy, x, topk_ids, topk_weights, w13, w2)
    return dx, None, dtopk_weights, dw13, dw2


moe_forward.register_autograd(_backward, setup_context=_setup_context)


def moe(x, topk_ids, topk_weights, w13, w2):
    """Routed-expert MLP (DESIGN.md section 1), differentiable in x, topk_weights, w13 and w2.

    x [T, H]; topk_ids [T, topk] int32/int64 in [0, E) or -1 (dropped); topk_weights [T, topk] f32 or
    x's dtype; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]. Returns y [T, H] in x's dtype:
    y_t = sum_j topk_weights[t, j] * w2[e] (silu(w13[e, :I] x_t) * (w13[e, I:] x_t)), e = topk_ids[t, j].
    """
    for name, tensor in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13), ("w2", w2)):
        _lib.check_arg(name, tensor)
    return moe_forward(x, topk_ids, topk_weights, w13, w2)
