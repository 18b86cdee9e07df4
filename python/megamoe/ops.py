"""The PyTorch face: `megamoe::moe_forward` / `megamoe::moe_backward` custom ops with fake kernels and
autograd, over the C API. CPU tensors run the C++ reference, CUDA tensors the CUDA path, on the current
stream, with every buffer allocated through torch (so CUDA graphs and the caching allocator just work).
"""

import warnings
from typing import Optional

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


def _saved_h_shape(x, topk_ids, w2):
    return (topk_ids.shape[0] * topk_ids.shape[1], 2 * w2.shape[2])  # [T*topk, 2I]


@torch.library.custom_op("megamoe::moe_forward", mutates_args=())
def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    keep_h: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y [T, H], and h = [g, u] [T*topk, 2I] by sorted row when keep_h (for one moe_backward), else an empty tensor."""
    x, topk_ids, topk_weights, w13, w2 = _inputs(x, topk_ids, topk_weights, w13, w2)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, H]
    h = x.new_empty(_saved_h_shape(x, topk_ids, w2) if keep_h else (0,))  # [T*topk, 2I] or [0]
    _lib.forward_into(x, topk_ids, topk_weights, w13, w2, y, h if keep_h else None)
    return y, h


@moe_forward.register_fake
def _(x, topk_ids, topk_weights, w13, w2, keep_h=False):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, x.new_empty(_saved_h_shape(x, topk_ids, w2) if keep_h else (0,))


def _weight_grads_like(w13, w2, wgrad_f32):
    """Uninitialised dw13 [E, 2I, H] and dw2 [E, H, I], in f32 when wgrad_f32, else in the weights' dtype."""
    wgrad_dtype = torch.float32 if wgrad_f32 else None
    return (torch.empty_like(w13, dtype=wgrad_dtype, memory_format=torch.contiguous_format),
            torch.empty_like(w2, dtype=wgrad_dtype, memory_format=torch.contiguous_format))


def _saved_h_or_none(saved_h):
    return saved_h if saved_h is not None and saved_h.dim() == 2 else None  # the empty [0] means "recompute"


# saved_h is a required argument of the op (an empty tensor means "recompute"): some torch versions drop a trailing
# defaulted argument before bumping the version counters of the mutated ones, and then fail to find it.
@torch.library.custom_op("megamoe::moe_backward", mutates_args=("saved_h",))
def _moe_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    saved_h: torch.Tensor,
    wgrad_f32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ops.megamoe.moe_backward: moe_backward below with saved_h always given (empty: recompute h)."""
    dy = _contiguous("dy", dy)
    saved_h = _saved_h_or_none(saved_h)
    if saved_h is not None:
        saved_h = _contiguous("saved_h", saved_h)
    x, topk_ids, topk_weights, w13, w2 = _inputs(x, topk_ids, topk_weights, w13, w2)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, H]
    dtopk_weights = torch.empty_like(topk_weights, memory_format=torch.contiguous_format)  # [T, topk]
    dw13, dw2 = _weight_grads_like(w13, w2, wgrad_f32)
    _lib.backward_into(dy, x, topk_ids, topk_weights, w13, w2, dx, dtopk_weights, dw13, dw2, saved_h)
    return dx, dtopk_weights, dw13, dw2


@_moe_backward_op.register_fake
def _(dy, x, topk_ids, topk_weights, w13, w2, saved_h, wgrad_f32=False):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(topk_weights, memory_format=torch.contiguous_format),
        *_weight_grads_like(w13, w2, wgrad_f32),
    )


def moe_backward(dy, x, topk_ids, topk_weights, w13, w2, saved_h=None, wgrad_f32=False):
    """(dx, d topk_weights, dw13, dw2) of moe_forward's inputs given dy [T, H]. saved_h: moe_forward's h (keep-h
    mode; consumed: dh is written over it, so it serves one backward) or None (recompute h). wgrad_f32: dw13 and dw2
    in f32 (main-grad style) instead of the parameters' dtype."""
    if saved_h is None:
        saved_h = dy.new_empty((0,)) if isinstance(dy, torch.Tensor) else None
    return _moe_backward_op(dy, x, topk_ids, topk_weights, w13, w2, saved_h, wgrad_f32)


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w13, w2, _keep_h = inputs
    _y, h = output
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)  # h's gradient stays None: no [T*topk, 2I] of zeros per backward
    ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2, h)


def _saved_tensors(ctx, entry="megamoe.moe"):
    try:
        return ctx.saved_tensors
    except RuntimeError as ex:  # the saved h's version moved: an earlier backward of this graph consumed it
        if "inplace operation" not in str(ex):
            raise
        raise RuntimeError(
            f"megamoe: a second backward through the same {entry} call (retain_graph=True) needs the saved h, "
            f"which the first backward consumed (keep-h mode writes dh over it); use {entry}(..., "
            "recompute=True) for graphs that are backpropagated more than once"
        ) from ex


def _backward(ctx, dy, _dh):
    if dy is None:  # y unused by the loss: nothing flows back
        return None, None, None, None, None, None
    x, topk_ids, topk_weights, w13, w2, h = _saved_tensors(ctx)
    saved_h = _saved_h_or_none(h)  # recompute mode's empty h is not passed: the op would count it as mutated
    dx, dtopk_weights, dw13, dw2 = moe_backward(dy, x, topk_ids, topk_weights, w13, w2, saved_h)
    return dx, None, dtopk_weights, dw13, dw2, None


moe_forward.register_autograd(_backward, setup_context=_setup_context)


def moe(x, topk_ids, topk_weights, w13, w2, recompute=False):
    """Routed-expert MLP (DESIGN.md section 1), differentiable in x, topk_weights, w13 and w2.

    x [T, H]; topk_ids [T, topk] int32/int64 in [0, E) or -1 (dropped); topk_weights [T, topk] f32 or
    x's dtype; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]. Returns y [T, H] in x's dtype:
    y_t = sum_j topk_weights[t, j] * w2[e] (silu(w13[e, :I] x_t) * (w13[e, I:] x_t)), e = topk_ids[t, j].

    Memory mode when gradients are wanted: by default the forward keeps h = [g, u] ([T*topk, 2I], the fastest
    backward, which writes dh over it: one backward per forward); recompute=True keeps only the inputs and recomputes
    h in the backward (same gradients; also for graphs backpropagated more than once).
    """
    for name, tensor in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13), ("w2", w2)):
        _lib.check_arg(name, tensor)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w13, w2))
    y, _h = moe_forward(x, topk_ids, topk_weights, w13, w2, needs_grad and not recompute)
    return y
