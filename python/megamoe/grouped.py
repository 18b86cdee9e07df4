"""Grouped rows: the routed experts applied to rows already sorted by expert (what an expert-parallel dispatcher
hands its experts), as the `megamoe::grouped_forward` / `megamoe::grouped_backward` custom ops with fake kernels and
autograd, over the C API's megamoe_grouped_* (the whole layer's kernels, routed by tokens_per_expert on the device:
no host synchronisation, so torch.compile(fullgraph=True) and CUDA graphs work).

    out_r = scores[r] * w2[e] (silu(w13[e, :I] x_r) * (w13[e, I:] x_r))   for the rows r of expert e

Layouts, activations, biases, the gradients computed only where needed and the weight gradients accumulated into
main_grads buffers (megamoe::grouped_backward_accumulate) as in ops.py.
"""

from typing import NamedTuple, Optional

import torch

from . import _lib
from . import main_grads as _main_grads
from .dtensor import expert_shard_local, refuse_dtensor_activations, refuse_dtensors, same_sharding
from .layouts import op_options, options_of
from .ops import (_all_contiguous, _check_args, _grad_and_saved_h, _grad_buffers, _intermediate, _main_grad_kwargs,
                  _needs, _needs_input_grad, _saved_h_or_none, _saved_tensors, _weight_grads_from_accumulate,
                  bound_arguments)

GRAD_NAMES = ("dx_sorted", "dscores", "dw13", "dw2", "dw3", "db13", "db2")  # grouped_backward's outputs, in order


class GroupedGrads(NamedTuple):
    """grouped_backward's gradients; None where not asked for or where the input (scores, w3, b13, b2) is absent."""

    dx_sorted: Optional[torch.Tensor]  # [R, H]
    dscores: Optional[torch.Tensor]  # [R]
    dw13: Optional[torch.Tensor]  # shaped as w13
    dw2: Optional[torch.Tensor]  # shaped as w2
    dw3: Optional[torch.Tensor]  # shaped as w3
    db13: Optional[torch.Tensor]  # [E, 2I]
    db2: Optional[torch.Tensor]  # [E, H]


def _inputs(x_sorted, tokens_per_expert, w13, w2, scores, w3, b13, b2):
    return _all_contiguous(x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, w13=w13, w2=w2, scores=scores,
                           w3=w3, b13=b13, b2=b2)


def _saved_h_shape(x_sorted, w2, w2_transposed):
    return (x_sorted.shape[0], 2 * _intermediate(w2, w2_transposed))  # [R, 2I]


def _grouped_forward(
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scores: Optional[torch.Tensor] = None,
    keep_h: bool = False,
    w3: Optional[torch.Tensor] = None,
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    gate_up: str = "concatenated",
    w13_transposed: bool = False,
    w2_transposed: bool = False,
    activation: str = "swiglu",
    limit: float = 0.0,
    alpha: float = 0.0,
    main_grad_w13: Optional[torch.Tensor] = None,
    main_grad_w2: Optional[torch.Tensor] = None,
    main_grad_w3: Optional[torch.Tensor] = None,
    main_grad_b13: Optional[torch.Tensor] = None,
    main_grad_b2: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [R, H] (padding rows past sum(tokens_per_expert): 0), and h = [g, u] [R, 2I] when keep_h (for
    grouped_backward), else an empty tensor. main_grad_*: not read here (grouped_moe's main_grads, for the backward)."""
    x_sorted, tokens_per_expert, w13, w2, scores, w3, b13, b2 = _inputs(x_sorted, tokens_per_expert, w13, w2, scores,
                                                                         w3, b13, b2)
    out = torch.empty_like(x_sorted, memory_format=torch.contiguous_format)  # [R, H]
    h = x_sorted.new_empty(_saved_h_shape(x_sorted, w2, w2_transposed) if keep_h else (0,))  # [R, 2I] or [0]
    options = options_of(gate_up, w13_transposed, w2_transposed, activation, limit, alpha)
    _lib.grouped_forward_into(x_sorted, tokens_per_expert, scores, w13, w2, out, h if keep_h else None, options, w3=w3,
                              b13=b13, b2=b2)
    return out, h


grouped_forward = torch.library.custom_op("megamoe::grouped_forward", mutates_args=())(_grouped_forward)


@grouped_forward.register_fake
def _(*args, **kwargs):
    a = bound_arguments(_grouped_forward, args, kwargs)
    x_sorted = a["x_sorted"]
    out = torch.empty_like(x_sorted, memory_format=torch.contiguous_format)
    return out, x_sorted.new_empty(_saved_h_shape(x_sorted, a["w2"], a["w2_transposed"]) if a["keep_h"] else (0,))


def _backward_buffers(x_sorted, scores, w13, w2, w3, b13, b2, wgrad_f32, needs):
    params = zip(GRAD_NAMES, (x_sorted, scores, w13, w2, w3, b13, b2))
    return _grad_buffers(x_sorted, params, {name: needs[f"need_{name}"] for name in GRAD_NAMES}, wgrad_f32)


def _grouped_backward(
    dout: torch.Tensor,
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scores: Optional[torch.Tensor],
    saved_h: torch.Tensor,
    wgrad_f32: bool = False,
    w3: Optional[torch.Tensor] = None,
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    gate_up: str = "concatenated",
    w13_transposed: bool = False,
    w2_transposed: bool = False,
    activation: str = "swiglu",
    limit: float = 0.0,
    alpha: float = 0.0,
    need_dx_sorted: bool = True,
    need_dscores: bool = True,
    need_dw13: bool = True,
    need_dw2: bool = True,
    need_dw3: bool = True,
    need_db13: bool = True,
    need_db2: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ops.megamoe.grouped_backward: (d x_sorted, d scores, dw13, dw2, dw3, db13, db2) with saved_h always
    given (empty: recompute h); an empty [0] tensor for each gradient not needed or of an absent input."""
    dout, saved_h = _grad_and_saved_h("dout", dout, saved_h)
    x_sorted, tokens_per_expert, w13, w2, scores, w3, b13, b2 = _inputs(x_sorted, tokens_per_expert, w13, w2, scores,
                                                                         w3, b13, b2)
    needs = dict(need_dx_sorted=need_dx_sorted, need_dscores=need_dscores, need_dw13=need_dw13, need_dw2=need_dw2,
                 need_dw3=need_dw3, need_db13=need_db13, need_db2=need_db2)
    outputs, buffers = zip(*_backward_buffers(x_sorted, scores, w13, w2, w3, b13, b2, wgrad_f32, needs))
    dx_sorted, dscores, dw13, dw2, dw3, db13, db2 = buffers
    options = options_of(gate_up, w13_transposed, w2_transposed, activation, limit, alpha)
    _lib.grouped_backward_into(dout, x_sorted, tokens_per_expert, scores, w13, w2, dx_sorted, dscores, dw13, dw2,
                               saved_h, options, w3=w3, b13=b13, b2=b2, dw3=dw3, db13=db13, db2=db2)
    return tuple(outputs)


# saved_h is required and declared mutated, as for megamoe::moe_backward (ops.py).
_grouped_backward_op = torch.library.custom_op("megamoe::grouped_backward", mutates_args=("saved_h",))(
    _grouped_backward)


@_grouped_backward_op.register_fake
def _(*args, **kwargs):
    a = bound_arguments(_grouped_backward, args, kwargs)
    needs = {f"need_{name}": a[f"need_{name}"] for name in GRAD_NAMES}
    buffers = _backward_buffers(a["x_sorted"], a["scores"], a["w13"], a["w2"], a["w3"], a["b13"], a["b2"],
                                a["wgrad_f32"], needs)
    return tuple(out for out, _ in buffers)


def _grouped_backward_accumulate(
    dout: torch.Tensor,
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scores: Optional[torch.Tensor],
    saved_h: torch.Tensor,
    main_grad_w13: torch.Tensor,
    main_grad_w2: torch.Tensor,
    main_grad_w3: torch.Tensor,
    main_grad_b13: torch.Tensor,
    main_grad_b2: torch.Tensor,
    w3: Optional[torch.Tensor] = None,
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    gate_up: str = "concatenated",
    w13_transposed: bool = False,
    w2_transposed: bool = False,
    activation: str = "swiglu",
    limit: float = 0.0,
    alpha: float = 0.0,
    need_dx_sorted: bool = True,
    need_dscores: bool = True,
    need_dw13: bool = True,
    need_dw2: bool = True,
    need_dw3: bool = True,
    need_db13: bool = True,
    need_db2: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ops.megamoe.grouped_backward_accumulate: grouped_backward whose weight and bias gradients are added into
    the main_grad_* buffers, as megamoe::moe_backward_accumulate (ops.py)."""
    dout, saved_h = _grad_and_saved_h("dout", dout, saved_h)
    x_sorted, tokens_per_expert, w13, w2, scores, w3, b13, b2 = _inputs(x_sorted, tokens_per_expert, w13, w2, scores,
                                                                         w3, b13, b2)
    needs = dict(dx_sorted=need_dx_sorted, dscores=need_dscores, dw13=need_dw13, dw2=need_dw2, dw3=need_dw3,
                 db13=need_db13, db2=need_db2)
    main_grad_args = (main_grad_w13, main_grad_w2, main_grad_w3, main_grad_b13, main_grad_b2)
    outputs, buffers = zip(*(_grad_buffers(x_sorted, zip(GRAD_NAMES[:2], (x_sorted, scores)), needs, False) +
                             _main_grads.accumulate_buffers(x_sorted, (w13, w2, w3, b13, b2), main_grad_args, needs)))
    dx_sorted, dscores, dw13, dw2, dw3, db13, db2 = buffers
    options = options_of(gate_up, w13_transposed, w2_transposed, activation, limit, alpha)
    _lib.grouped_backward_into(dout, x_sorted, tokens_per_expert, scores, w13, w2, dx_sorted, dscores, dw13, dw2,
                               saved_h, options, accumulate=True, w3=w3, b13=b13, b2=b2, dw3=dw3, db13=db13, db2=db2)
    return tuple(outputs)


_grouped_backward_accumulate_op = torch.library.custom_op(
    "megamoe::grouped_backward_accumulate", mutates_args=("saved_h", *_main_grads.OP_ARGS))(
        _grouped_backward_accumulate)


@_grouped_backward_accumulate_op.register_fake
def _(*args, **kwargs):
    a = bound_arguments(_grouped_backward_accumulate, args, kwargs)
    needs = {name: a[f"need_{name}"] for name in GRAD_NAMES}
    first = _grad_buffers(a["x_sorted"], zip(GRAD_NAMES[:2], (a["x_sorted"], a["scores"])), needs, False)
    weights = _main_grads.fake_accumulate_outputs(a["x_sorted"], [a[name] for name in _main_grads.PARAM_NAMES],
                                                  [a[name] for name in _main_grads.OP_ARGS], needs)
    return tuple(out for out, _ in first) + tuple(weights)


def grouped_backward(dout, x_sorted, tokens_per_expert, w13, w2, scores=None, saved_h=None, wgrad_f32=False, *,
                     w3=None, b13=None, b2=None, layout=None, activation=None, grads=None, main_grads=None):
    """GroupedGrads (d x_sorted, d scores, dw13, dw2, dw3, db13, db2); d scores = <dout_r, o_r> (o_r the unscaled
    row); None for those not in `grads` (names of GRAD_NAMES; None: all) and for absent inputs. saved_h:
    grouped_forward's h (keep-h mode; consumed: dh is written over it) or None (recompute h). wgrad_f32: the weight
    and bias gradients in f32 instead of the parameters' dtype. Plain tensors only (a DTensor raises TypeError: pass
    its .to_local()). main_grads: f32 buffers the weight gradients are added into, as megamoe.moe_backward's."""
    refuse_dtensors("megamoe.grouped_backward", "the backward takes plain tensors", dout=dout, x_sorted=x_sorted,
                    tokens_per_expert=tokens_per_expert, w13=w13, w2=w2, scores=scores, saved_h=saved_h, w3=w3,
                    b13=b13, b2=b2)
    if saved_h is None:
        saved_h = dout.new_empty((0,)) if isinstance(dout, torch.Tensor) else None
    needs = _needs(GRAD_NAMES, grads)
    params = (w13, w2, w3, b13, b2)
    buffers = _main_grads.by_param("megamoe.grouped_backward", main_grads, dict(zip(_main_grads.PARAM_NAMES, params)))
    if _main_grads.any_given(buffers.values()):
        outputs = _grouped_backward_accumulate_op(dout, x_sorted, tokens_per_expert, w13, w2, scores, saved_h,
                                                  *_main_grads.op_arguments(buffers.values(), dout), w3, b13, b2,
                                                  **op_options(layout, activation), **needs)
        outputs = (*outputs[:2], *_weight_grads_from_accumulate(outputs[2:], params, buffers.values(), wgrad_f32))
    else:
        outputs = _grouped_backward_op(dout, x_sorted, tokens_per_expert, w13, w2, scores, saved_h, wgrad_f32, w3,
                                       b13, b2, **op_options(layout, activation), **needs)
    present = (True, scores is not None, True, True, w3 is not None, b13 is not None, b2 is not None)
    return GroupedGrads(*(out if have and needs[f"need_{name}"] else None
                          for name, out, have in zip(GRAD_NAMES, outputs, present)))


def _setup_context(ctx, inputs, output):
    x_sorted, tokens_per_expert, w13, w2, scores, _keep_h, w3, b13, b2, *rest = inputs
    options, main_grad_inputs = rest[:6], rest[6:]
    _out, h = output
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)  # h's gradient stays None: no [R, 2I] of zeros per backward
    ctx.options = options_of(*options)
    ctx.save_for_backward(x_sorted, tokens_per_expert, w13, w2, scores, h, w3, b13, b2)
    ctx.main_grads = tuple(main_grad_inputs)  # by reference, not saved: as in ops.py


# The forward inputs whose gradients the backward returns: their position among grouped_forward's inputs.
_GRAD_INPUTS = {"dx_sorted": 0, "dscores": 4, "dw13": 2, "dw2": 3, "dw3": 6, "db13": 7, "db2": 8}


def _backward(ctx, dout, _dh):
    num_inputs = len(ctx.needs_input_grad)
    if dout is None:  # out unused by the loss: nothing flows back
        return (None,) * num_inputs
    x_sorted, tokens_per_expert, w13, w2, scores, h, w3, b13, b2 = _saved_tensors(ctx, "megamoe.grouped_moe")
    saved_h = _saved_h_or_none(h)  # recompute mode's empty h is not passed: the op would count it as mutated
    if saved_h is None:
        saved_h = dout.new_empty((0,))
    needs = {f"need_{name}": _needs_input_grad(ctx, index) for name, index in _GRAD_INPUTS.items()}
    if _main_grads.any_given(ctx.main_grads):
        outputs = _grouped_backward_accumulate_op(dout, x_sorted, tokens_per_expert, w13, w2, scores, saved_h,
                                                  *_main_grads.op_arguments(ctx.main_grads, dout), w3, b13, b2,
                                                  **ctx.options, **needs)
        weight_grads = _weight_grads_from_accumulate(outputs[2:], (w13, w2, w3, b13, b2), ctx.main_grads, False)
        outputs = (*outputs[:2], *(None if buffer is not None else grad  # accumulated: no autograd gradient
                                   for grad, buffer in zip(weight_grads, ctx.main_grads)))
    else:
        outputs = _grouped_backward_op(dout, x_sorted, tokens_per_expert, w13, w2, scores, saved_h, False, w3, b13,
                                       b2, **ctx.options, **needs)
    grads = [None] * num_inputs
    for (name, index), out in zip(_GRAD_INPUTS.items(), outputs):
        if needs[f"need_{name}"]:
            grads[index] = out
    return tuple(grads)


grouped_forward.register_autograd(_backward, setup_context=_setup_context)


def _local_experts(entry, x_sorted, tokens_per_expert, scores, w13, w2, w3, b13, b2):
    """(w13, w2, w3, b13, b2) as plain tensors: the local experts of expert-sharded DTensors (dtensor.py)."""
    refuse_dtensor_activations(entry, x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, scores=scores)
    weights = dict(w13=w13, w2=w2, w3=w3, b13=b13, b2=b2)
    same_sharding(entry, **weights)
    return [expert_shard_local(entry, name, tensor) for name, tensor in weights.items()]


def grouped_moe(x_sorted, tokens_per_expert, w13, w2, scores=None, recompute=False, *, w3=None, b13=None, b2=None,
                layout=None, activation=None, main_grads=None):
    """The routed experts on rows already sorted by expert, differentiable in x_sorted, scores and the expert
    parameters.

    x_sorted [R, H]: the rows of expert 0, then of expert 1, ...; tokens_per_expert [E] int32/int64 on the device
    of x_sorted (rows per expert; read on the device only: no host synchronisation); rows past its sum are padding
    and get exact zero outputs and gradients; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; scores [R]
    (f32 or x_sorted's dtype) or None. Returns out [R, H] in x_sorted's dtype:
    out_r = scores[r] * w2[e] (silu(w13[e, :I] x_r) * (w13[e, I:] x_r)).
    w3, b13, b2, layout and activation as for megamoe.moe: out_r = scores[r] * (w2[e] act(w13[e] x_r + b13[e]) + b2[e]).

    Counts that are negative or sum past R raise ValueError on the CPU; on CUDA (where they cannot be read without
    a sync) every output and gradient comes back NaN. Memory modes as megamoe.moe: by default the forward keeps
    h = [g, u] ([R, 2I]) when gradients are wanted; recompute=True recomputes it in the backward.

    DTensor weights sharded over experts (Shard(0) or Replicate on each mesh dimension, e.g. expert-parallel
    parameters) are read through .to_local(): tokens_per_expert counts the local experts' rows, and the gradients
    come back as DTensors with the weights' placements (dtensor.py). DTensor activations raise TypeError.

    main_grads: f32 buffers (of the local experts) the weight gradients are added into during the backward, whose
    autograd gradients are then None: exactly as megamoe.moe's main_grads.
    """
    w13, w2, w3, b13, b2 = _local_experts("megamoe.grouped_moe", x_sorted, tokens_per_expert, scores, w13, w2, w3, b13,
                                          b2)
    _check_args(x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, w13=w13, w2=w2, scores=scores, w3=w3, b13=b13,
                b2=b2)
    buffers = _main_grads.by_param("megamoe.grouped_moe", main_grads, dict(w13=w13, w2=w2, w3=w3, b13=b13, b2=b2))
    differentiable = [t for t in (x_sorted, w13, w2, scores, w3, b13, b2) if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
    out, _h = grouped_forward(x_sorted, tokens_per_expert, w13, w2, scores, needs_grad and not recompute, w3, b13, b2,
                              **op_options(layout, activation), **_main_grad_kwargs(buffers))
    return out


def grouped_path_of(x_sorted, tokens_per_expert, w13, w2, scores=None, *, w3=None, b13=None, b2=None, layout=None,
                    activation=None, backward=False):
    """Which implementation megamoe.grouped_moe's forward (backward=True: its backward) runs on these arguments; the
    names and errors of megamoe.path_of."""
    w13, w2, w3, b13, b2 = _local_experts("megamoe.grouped_path_of", x_sorted, tokens_per_expert, scores, w13, w2, w3,
                                          b13, b2)
    _check_args(x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, w13=w13, w2=w2, scores=scores, w3=w3, b13=b13,
                b2=b2)
    x_sorted, tokens_per_expert, w13, w2, scores, w3, b13, b2 = _inputs(x_sorted, tokens_per_expert, w13, w2, scores,
                                                                         w3, b13, b2)
    tensors = dict(x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, scores=scores, w13=w13, w2=w2, w3=w3,
                   b13=b13, b2=b2)
    if backward:
        tensors["dout"] = x_sorted  # the query reads no data: dout needs only x_sorted's shape, dtype and device
    else:
        tensors["out"] = torch.empty_like(x_sorted, memory_format=torch.contiguous_format)
    return _lib.path("grouped_backward" if backward else "grouped_forward", tensors, op_options(layout, activation))
