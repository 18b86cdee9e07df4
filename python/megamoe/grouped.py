"""Grouped rows: the routed experts applied to rows already sorted by expert (what an expert-parallel dispatcher
hands its experts), as the `megamoe::grouped_forward`, `megamoe::grouped_backward` and
`megamoe::grouped_backward_accumulate` custom ops (generated from the argument description below by op_family.py, as
the whole layer's in ops.py) over the C API's megamoe_grouped_* (the whole layer's kernels, routed by
tokens_per_expert on the device: no host synchronisation, so torch.compile(fullgraph=True) and CUDA graphs work).

    out_r = scores[r] * w2[e] (silu(w13[e, :I] x_r) * (w13[e, I:] x_r))   for the rows r of expert e

Layouts, activations, biases, the precision (precision="fp8": blockwise FP8 GEMMs on fp8.py's FP8 weights), the
gradients computed only where needed and the weight gradients accumulated into main_grads buffers as for the whole
layer.
"""

import torch

from .argument_errors import ARGUMENT_ERRORS, raise_argument_error
from .dtensor import expert_shard_local, refuse_dtensor_activations, same_sharding
from .op_family import OPTIONAL_TENSOR, Arg, EntryPoint, OpFamily, gradients, tensor_args

GroupedGrads = gradients("GroupedGrads", __name__, "x_sorted", "scores", """grouped_backward's gradients: dx_sorted
[R, H], dscores [R], dw13, dw2, dw3 (shaped as w13, w2, w3), db13 [E, 2I], db2 [E, H]; None where not asked for or
where the input (scores, w3, b13, b2) is absent.""")
GRAD_NAMES = GroupedGrads._fields  # grouped_backward's outputs, in order


def _num_rows(a):
    """R of x_sorted [R, H], one slot per row (None for another rank)."""
    return a["x_sorted"].shape[0] if a["x_sorted"].dim() == 2 else None


OPS = OpFamily(EntryPoint(
    name="grouped", user_entry="megamoe.grouped_moe", c_prefix="grouped_", output="out", grad_output="dout",
    inputs=(*tensor_args("x_sorted", "tokens_per_expert", "w13", "w2"), Arg("scores", OPTIONAL_TENSOR, None)),
    grads=GroupedGrads, num_slots=_num_rows,
    too_many_slots=lambda a: f"x_sorted: R = {a['x_sorted'].shape[0]} rows exceed 2^31 - 1"))

# torch.ops.megamoe.grouped_forward(x_sorted, tokens_per_expert, w13, w2, scores=None, keep_h=False, w3, b13, b2,
# <options>, fp8_*, main_grad_*) -> (out [R, H], h [R, 2I] when keep_h, else [0])
grouped_forward = OPS.forward_op


def _local_experts(entry, x_sorted, tokens_per_expert, w13, w2, scores, experts):
    """The inputs and experts as plain tensors: the local experts of expert-sharded DTensors (dtensor.py)."""
    refuse_dtensor_activations(entry, x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, scores=scores)
    weights = dict(w13=w13, w2=w2, **experts)
    same_sharding(entry, **weights)
    weights = {name: expert_shard_local(entry, name, tensor) for name, tensor in weights.items()}
    inputs = dict(x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, w13=weights.pop("w13"),
                  w2=weights.pop("w2"), scores=scores)
    return inputs, weights


def grouped_moe(x_sorted, tokens_per_expert, w13, w2, scores=None, recompute=False, *, w3=None, b13=None, b2=None,
                layout=None, activation=None, main_grads=None, precision="bf16", fp8_experts=None):
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

    precision ("bf16" or "fp8") and fp8_experts (the FP8 weights of the local experts; None: the cache's,
    megamoe.fp8.experts_for of the local w13 and w2): as megamoe.moe's.
    """
    try:
        inputs, experts = _local_experts("megamoe.grouped_moe", x_sorted, tokens_per_expert, w13, w2, scores,
                                         dict(w3=w3, b13=b13, b2=b2))
        call = OPS.forward_call(inputs, experts, recompute, layout, activation, main_grads, precision, fp8_experts)
    except ARGUMENT_ERRORS as error:
        return raise_argument_error(error, x_sorted)  # eager: raised now; traced: by the graph (argument_errors.py)
    return OPS.forward(call)


def grouped_backward(dout, x_sorted, tokens_per_expert, w13, w2, scores=None, saved_h=None, wgrad_f32=False, *,
                     w3=None, b13=None, b2=None, layout=None, activation=None, grads=None, main_grads=None,
                     precision="bf16", fp8_experts=None):
    """GroupedGrads (d x_sorted, d scores, dw13, dw2, dw3, db13, db2); d scores = <dout_r, o_r> (o_r the unscaled
    row); None for those not in `grads` (names of GRAD_NAMES; None: all) and for absent inputs. saved_h:
    grouped_forward's h (keep-h mode; consumed: dh is written over it) or None (recompute h). wgrad_f32: the weight
    and bias gradients in f32 instead of the parameters' dtype. Plain tensors only (a DTensor raises TypeError: pass
    its .to_local()). main_grads: f32 buffers the weight gradients are added into, as megamoe.moe_backward's.
    precision / fp8_experts: as megamoe.moe_backward's."""
    inputs = dict(x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, w13=w13, w2=w2, scores=scores)
    return OPS.backward("megamoe.grouped_backward", dout, inputs, saved_h, wgrad_f32, dict(w3=w3, b13=b13, b2=b2),
                        layout, activation, grads, main_grads, precision, fp8_experts)


def grouped_path_of(x_sorted, tokens_per_expert, w13, w2, scores=None, *, w3=None, b13=None, b2=None, layout=None,
                    activation=None, backward=False, precision="bf16", fp8_experts=None):
    """Which implementation megamoe.grouped_moe's forward (backward=True: its backward) runs on these arguments; the
    names and errors of megamoe.path_of."""
    inputs, experts = _local_experts("megamoe.grouped_path_of", x_sorted, tokens_per_expert, w13, w2, scores,
                                     dict(w3=w3, b13=b13, b2=b2))
    return OPS.path("megamoe.grouped_path_of", inputs, experts, layout, activation, backward, precision, fp8_experts)
