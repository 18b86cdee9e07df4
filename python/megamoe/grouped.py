"""Grouped rows: the routed experts applied to rows already sorted by expert (what an expert-parallel dispatcher
hands its experts), as the `megamoe::grouped_forward` / `megamoe::grouped_backward` custom ops with fake kernels and
autograd, over the C API's megamoe_grouped_* (the whole layer's kernels, routed by tokens_per_expert on the device:
no host synchronisation, so torch.compile(fullgraph=True) and CUDA graphs work).

    out_r = scores[r] * w2[e] (silu(w13[e, :I] x_r) * (w13[e, I:] x_r))   for the rows r of expert e
"""

from typing import Optional

import torch

from . import _lib
from .ops import _contiguous, _saved_h_or_none, _saved_tensors, _weight_grads_like


def _inputs(x_sorted, tokens_per_expert, w13, w2, scores):
    names = ("x_sorted", "tokens_per_expert", "w13", "w2", "scores")
    return [_contiguous(name, t) for name, t in zip(names, (x_sorted, tokens_per_expert, w13, w2, scores))]


def _saved_h_shape(x_sorted, w2):
    return (x_sorted.shape[0], 2 * w2.shape[2])  # [R, 2I]


def _dscores_like(x_sorted, scores):
    """d scores [R] in the dtype of scores, or an empty [0] placeholder when there are no scores."""
    if scores is None:
        return x_sorted.new_empty((0,), dtype=torch.float32)
    return torch.empty_like(scores, memory_format=torch.contiguous_format)


@torch.library.custom_op("megamoe::grouped_forward", mutates_args=())
def grouped_forward(
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scores: Optional[torch.Tensor] = None,
    keep_h: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [R, H] (padding rows past sum(tokens_per_expert): 0), and h = [g, u] [R, 2I] when keep_h (for
    grouped_backward), else an empty tensor."""
    x_sorted, tokens_per_expert, w13, w2, scores = _inputs(x_sorted, tokens_per_expert, w13, w2, scores)
    out = torch.empty_like(x_sorted, memory_format=torch.contiguous_format)  # [R, H]
    h = x_sorted.new_empty(_saved_h_shape(x_sorted, w2) if keep_h else (0,))  # [R, 2I] or [0]
    _lib.grouped_forward_into(x_sorted, tokens_per_expert, scores, w13, w2, out, h if keep_h else None)
    return out, h


@grouped_forward.register_fake
def _(x_sorted, tokens_per_expert, w13, w2, scores=None, keep_h=False):
    out = torch.empty_like(x_sorted, memory_format=torch.contiguous_format)
    return out, x_sorted.new_empty(_saved_h_shape(x_sorted, w2) if keep_h else (0,))


# saved_h is required and declared mutated, as for megamoe::moe_backward (ops.py).
@torch.library.custom_op("megamoe::grouped_backward", mutates_args=("saved_h",))
def _grouped_backward_op(
    dout: torch.Tensor,
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scores: Optional[torch.Tensor],
    saved_h: torch.Tensor,
    wgrad_f32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ops.megamoe.grouped_backward: grouped_backward below with saved_h always given (empty: recompute h)."""
    dout = _contiguous("dout", dout)
    saved_h = _saved_h_or_none(saved_h)
    if saved_h is not None:
        saved_h = _contiguous("saved_h", saved_h)
    x_sorted, tokens_per_expert, w13, w2, scores = _inputs(x_sorted, tokens_per_expert, w13, w2, scores)
    dx_sorted = torch.empty_like(x_sorted, memory_format=torch.contiguous_format)  # [R, H]
    dscores = _dscores_like(x_sorted, scores)  # [R] or [0]
    dw13, dw2 = _weight_grads_like(w13, w2, wgrad_f32)  # [E, 2I, H], [E, H, I]
    _lib.grouped_backward_into(dout, x_sorted, tokens_per_expert, scores, w13, w2, dx_sorted,
                               dscores if scores is not None else None, dw13, dw2, saved_h)
    return dx_sorted, dscores, dw13, dw2


@_grouped_backward_op.register_fake
def _(dout, x_sorted, tokens_per_expert, w13, w2, scores, saved_h, wgrad_f32=False):
    return (
        torch.empty_like(x_sorted, memory_format=torch.contiguous_format),
        _dscores_like(x_sorted, scores),
        *_weight_grads_like(w13, w2, wgrad_f32),
    )


def grouped_backward(dout, x_sorted, tokens_per_expert, w13, w2, scores=None, saved_h=None, wgrad_f32=False):
    """(d x_sorted, d scores, dw13, dw2); d scores = <dout_r, o_r> (o_r the unscaled row), an empty [0] tensor
    without scores. saved_h: grouped_forward's h (keep-h mode; consumed: dh is written over it) or None (recompute
    h). wgrad_f32: dw13 and dw2 in f32 instead of the parameters' dtype."""
    if saved_h is None:
        saved_h = dout.new_empty((0,)) if isinstance(dout, torch.Tensor) else None
    return _grouped_backward_op(dout, x_sorted, tokens_per_expert, w13, w2, scores, saved_h, wgrad_f32)


def _setup_context(ctx, inputs, output):
    x_sorted, tokens_per_expert, w13, w2, scores, _keep_h = inputs
    _out, h = output
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)  # h's gradient stays None: no [R, 2I] of zeros per backward
    ctx.has_scores = scores is not None
    ctx.save_for_backward(x_sorted, tokens_per_expert, w13, w2, scores, h)


def _backward(ctx, dout, _dh):
    if dout is None:  # out unused by the loss: nothing flows back
        return None, None, None, None, None, None
    x_sorted, tokens_per_expert, w13, w2, scores, h = _saved_tensors(ctx, "megamoe.grouped_moe")
    saved_h = _saved_h_or_none(h)  # recompute mode's empty h is not passed: the op would count it as mutated
    dx_sorted, dscores, dw13, dw2 = grouped_backward(dout, x_sorted, tokens_per_expert, w13, w2, scores, saved_h)
    return dx_sorted, None, dw13, dw2, dscores if ctx.has_scores else None, None


grouped_forward.register_autograd(_backward, setup_context=_setup_context)


def grouped_moe(x_sorted, tokens_per_expert, w13, w2, scores=None, recompute=False):
    """The routed experts on rows already sorted by expert, differentiable in x_sorted, scores, w13 and w2.

    x_sorted [R, H]: the rows of expert 0, then of expert 1, ...; tokens_per_expert [E] int32/int64 on the device
    of x_sorted (rows per expert; read on the device only: no host synchronisation); rows past its sum are padding
    and get exact zero outputs and gradients; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; scores [R]
    (f32 or x_sorted's dtype) or None. Returns out [R, H] in x_sorted's dtype:
    out_r = scores[r] * w2[e] (silu(w13[e, :I] x_r) * (w13[e, I:] x_r)).

    Counts that are negative or sum past R raise ValueError on the CPU; on CUDA (where they cannot be read without
    a sync) every output and gradient comes back NaN. Memory modes as megamoe.moe: by default the forward keeps
    h = [g, u] ([R, 2I]) when gradients are wanted; recompute=True recomputes it in the backward.
    """
    for name, tensor in (("x_sorted", x_sorted), ("tokens_per_expert", tokens_per_expert), ("w13", w13), ("w2", w2)):
        _lib.check_arg(name, tensor)
    if scores is not None:
        _lib.check_arg("scores", scores)
    differentiable = (x_sorted, w13, w2) + ((scores,) if scores is not None else ())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
    out, _h = grouped_forward(x_sorted, tokens_per_expert, w13, w2, scores, needs_grad and not recompute)
    return out
