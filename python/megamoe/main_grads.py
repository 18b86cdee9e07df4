"""Weight gradients accumulated into the caller's f32 buffers (Megatron's `param.main_grad`, FSDP2's fp32 reduce): the
`main_grads` argument of megamoe.moe / grouped_moe (autograd) and of megamoe.moe_backward / grouped_backward (manual),
read here into one buffer (or None) per expert parameter, checked, and turned into the C API's
accumulate_weight_grads: the kernels add their gradient into each buffer in their epilogue (out = out + grad, f32,
deterministic), with no extra pass. The ops that do it (megamoe::moe_backward_accumulate,
megamoe::grouped_backward_accumulate) declare the buffers in mutates_args, so torch.compile sees the mutation.

    main_grads = (w13_buf, w2_buf)                       in PARAM_NAMES order: w13, w2, w3, b13, b2 (None: not here)
    main_grads = {"w13": w13_buf, "b2": b2_buf}          or by parameter name

Each buffer: a contiguous f32 tensor shaped as its parameter (as the parameter's local tensor, for a DTensor weight),
on its device, not requiring grad. The C API accumulates every weight gradient of a call or none, so a wanted gradient
without a buffer is accumulated into zeros (one fill) and returned as usual.
"""

import torch

from .dtensor import is_dtensor

PARAM_NAMES = ("w13", "w2", "w3", "b13", "b2")  # the order of a main_grads tuple, and of the ops' main_grad_* arguments
OP_ARGS = tuple(f"main_grad_{name}" for name in PARAM_NAMES)


def by_param(entry, main_grads, params):
    """{name: buffer or None} for the names of PARAM_NAMES from `main_grads` (None, a tuple / list in PARAM_NAMES
    order, or a dict by name), each checked against its parameter in `params` (name -> tensor or None: absent).
    TypeError / ValueError naming `main_grads` and the parameter otherwise."""
    if main_grads is None:
        return dict.fromkeys(PARAM_NAMES)
    if isinstance(main_grads, dict):
        unknown = [name for name in main_grads if name not in PARAM_NAMES]
        if unknown:
            raise ValueError(f"{entry}: main_grads: unknown parameter {unknown[0]!r} (one of {', '.join(PARAM_NAMES)})")
        buffers = {name: main_grads.get(name) for name in PARAM_NAMES}
    elif isinstance(main_grads, (tuple, list)):
        if len(main_grads) > len(PARAM_NAMES):
            raise ValueError(f"{entry}: main_grads: {len(main_grads)} buffers, at most {len(PARAM_NAMES)} (for "
                             f"{', '.join(PARAM_NAMES)})")
        buffers = dict(zip(PARAM_NAMES, list(main_grads) + [None] * (len(PARAM_NAMES) - len(main_grads))))
    else:
        raise TypeError(f"{entry}: main_grads must be a tuple, a list or a dict of tensors, got "
                        f"{type(main_grads).__name__}")
    for name, buffer in buffers.items():
        if buffer is not None:
            _check(entry, name, buffer, params[name])
    return buffers


def _check(entry, name, buffer, param):
    where = f"{entry}: main_grads[{name!r}]"
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(buffer).__name__}")
    if is_dtensor(buffer):
        raise TypeError(f"{where} is a DTensor; pass the local buffer of this rank's {name} (a plain tensor)")
    if param is None:
        raise ValueError(f"{where}: given, but {name} is absent (no {name}, no gradient of it)")
    if buffer.dtype != torch.float32:
        raise ValueError(f"{where}: the weight gradients are accumulated into float32 buffers, got {buffer.dtype}")
    if buffer.shape != param.shape:
        raise ValueError(f"{where}: shape {tuple(buffer.shape)} differs from {name}'s {tuple(param.shape)}")
    if buffer.device != param.device:
        raise ValueError(f"{where} is on {buffer.device}, {name} on {param.device}")
    if not buffer.is_contiguous():
        raise ValueError(f"{where} must be contiguous (it is written in place, so it cannot be copied)")
    if buffer.requires_grad:
        raise ValueError(f"{where} requires grad; a gradient buffer must not (detach it)")


def any_given(buffers):
    return any(buffer is not None for buffer in buffers)


def op_arguments(buffers, like):
    """The ops' main_grad_* arguments, in PARAM_NAMES order: each buffer, or a fresh empty [0] tensor for none (an
    op argument declared mutated cannot be None on every torch version; fresh, so no saved tensor's version moves)."""
    return [buffer if buffer is not None else like.new_empty((0,)) for buffer in buffers]


def accumulate_buffers(x, params, main_grad_args, needs):
    """Per weight gradient (PARAM_NAMES order; `params` the parameters, None: absent; needs[name] for dw13, dw2, dw3,
    db13, db2): (op output, buffer the C API adds into or None). A given buffer (numel > 0) is added into and the op
    returns an empty [0] in its place (an op output cannot alias an input); a wanted gradient without one is a zero
    f32 tensor, added into and returned; the rest are not computed."""
    out = []
    for name, param, main_grad in zip(PARAM_NAMES, params, main_grad_args):
        if param is None or not needs[f"d{name}"]:
            out.append((x.new_empty((0,)), None))
        elif main_grad.numel() > 0:
            out.append((x.new_empty((0,)), main_grad))
        else:
            grad = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.contiguous_format)
            out.append((grad, grad))
    return out

