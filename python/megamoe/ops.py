"""The PyTorch face: `megamoe::moe_forward` / `megamoe::moe_backward` custom ops with fake kernels and
autograd, over the C API. CPU tensors run the C++ reference, CUDA tensors the CUDA path, on the current
stream, with every buffer allocated through torch (so CUDA graphs and the caching allocator just work).

The experts' layout and activation (layouts.py) and their optional w3, b13, b2 are plain arguments of the ops
(gate_up, w13_transposed, w2_transposed, activation, limit, alpha); the weight gradients come back in the parameters'
own layout. The backward computes only the gradients asked for (its need_* arguments; autograd asks for those of
ctx.needs_input_grad: frozen experts skip dW, inputs without grad skip dX) and returns an empty [0] tensor for the
others and for absent parameters. With main_grads (main_grads.py) the weight gradients are added into the caller's
f32 buffers by `megamoe::moe_backward_accumulate`, which declares them mutated; moe_forward carries the buffers to
its backward as trailing arguments it does not read.
"""

import inspect
import warnings
from typing import NamedTuple, Optional

import torch

from . import _lib
from . import main_grads as _main_grads
from .dtensor import refuse_dtensor_activations, refuse_dtensors, replicated_local
from .layouts import op_options, options_of

_warned = set()

GRAD_NAMES = ("dx", "dtopk_weights", "dw13", "dw2", "dw3", "db13", "db2")  # moe_backward's outputs, in order


class MoEGrads(NamedTuple):
    """moe_backward's gradients; None where not asked for or where the parameter is absent."""

    dx: Optional[torch.Tensor]  # [T, H]
    dtopk_weights: Optional[torch.Tensor]  # [T, topk]
    dw13: Optional[torch.Tensor]  # shaped as w13
    dw2: Optional[torch.Tensor]  # shaped as w2
    dw3: Optional[torch.Tensor]  # shaped as w3
    db13: Optional[torch.Tensor]  # [E, 2I]
    db2: Optional[torch.Tensor]  # [E, H]


def _contiguous(name, tensor):
    """The kernels read row-major memory: copy a strided input once, and say so once per argument."""
    if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"megamoe: {name} is not contiguous; copying it (pass a contiguous tensor to avoid this)")
        return tensor.contiguous()
    return tensor


def _all_contiguous(**tensors):
    return [_contiguous(name, t) for name, t in tensors.items()]


def _intermediate(w2, w2_transposed):
    return w2.shape[1] if w2_transposed else w2.shape[2]  # I of w2 [E, H, I] or [E, I, H]


def _saved_h_shape(topk_ids, w2, w2_transposed):
    return (topk_ids.shape[0] * topk_ids.shape[1], 2 * _intermediate(w2, w2_transposed))  # [T*topk, 2I]


def _grad_buffers(x, params, needs, wgrad_f32):
    """Per (name, parameter) of `params`, in order: (output, buffer or None). The output is an uninitialised
    gradient shaped as its parameter where the parameter exists and needs[name], else an empty [0] placeholder; the
    buffer is what the C API writes (None: not wanted). Weight and bias gradients (names from dw13 on) in f32 when
    wgrad_f32."""
    out = []
    for index, (name, param) in enumerate(params):
        if param is None or not needs[name]:
            out.append((x.new_empty((0,)), None))
            continue
        dtype = torch.float32 if wgrad_f32 and index >= 2 else None
        grad = torch.empty_like(param, dtype=dtype, memory_format=torch.contiguous_format)
        out.append((grad, grad))
    return out


def _needs(names, grads):
    """need_<name> keyword arguments of a backward op: all True for grads=None, else True for the names in grads."""
    if grads is None:
        return {f"need_{name}": True for name in names}
    unknown = [name for name in grads if name not in names]
    if unknown:
        raise ValueError(f"megamoe: grads: unknown gradient {unknown[0]!r} (one of {', '.join(names)})")
    return {f"need_{name}": name in grads for name in names}


def bound_arguments(fn, args, kwargs):
    """fn's arguments by name with the defaults filled in: a fake kernel receives an op's arguments as its caller
    passed them, positionally or by keyword."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
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
    """y [T, H], and h = [g, u] [T*topk, 2I] by sorted row when keep_h (for one moe_backward), else an empty tensor.
    main_grad_*: not read here; the autograd backward adds the weight gradients into them (megamoe.moe's main_grads)."""
    x, topk_ids, topk_weights, w13, w2, w3, b13, b2 = _all_contiguous(
        x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, w3=w3, b13=b13, b2=b2)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, H]
    h = x.new_empty(_saved_h_shape(topk_ids, w2, w2_transposed) if keep_h else (0,))  # [T*topk, 2I] or [0]
    options = options_of(gate_up, w13_transposed, w2_transposed, activation, limit, alpha)
    _lib.forward_into(x, topk_ids, topk_weights, w13, w2, y, h if keep_h else None, options, w3=w3, b13=b13, b2=b2)
    return y, h


moe_forward = torch.library.custom_op("megamoe::moe_forward", mutates_args=())(_moe_forward)


@moe_forward.register_fake
def _(*args, **kwargs):
    a = bound_arguments(_moe_forward, args, kwargs)
    y = torch.empty_like(a["x"], memory_format=torch.contiguous_format)
    return y, a["x"].new_empty(_saved_h_shape(a["topk_ids"], a["w2"], a["w2_transposed"]) if a["keep_h"] else (0,))


def _saved_h_or_none(saved_h):
    return saved_h if saved_h is not None and saved_h.dim() == 2 else None  # the empty [0] means "recompute"


def _grad_and_saved_h(name, grad, saved_h):
    """A backward op's output gradient (argument `name`) and saved_h (None: recompute h), contiguous (a strided one
    copied once, with a warning)."""
    saved_h = _saved_h_or_none(saved_h)
    return _contiguous(name, grad), None if saved_h is None else _contiguous("saved_h", saved_h)


def _backward_buffers(x, topk_weights, w13, w2, w3, b13, b2, wgrad_f32, needs):
    params = zip(GRAD_NAMES, (x, topk_weights, w13, w2, w3, b13, b2))
    return _grad_buffers(x, params, {name: needs[f"need_{name}"] for name in GRAD_NAMES}, wgrad_f32)


def _moe_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
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
    need_dx: bool = True,
    need_dtopk_weights: bool = True,
    need_dw13: bool = True,
    need_dw2: bool = True,
    need_dw3: bool = True,
    need_db13: bool = True,
    need_db2: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ops.megamoe.moe_backward: (dx, d topk_weights, dw13, dw2, dw3, db13, db2) with saved_h always given
    (empty: recompute h); an empty [0] tensor for each gradient not needed or of an absent parameter."""
    dy, saved_h = _grad_and_saved_h("dy", dy, saved_h)
    x, topk_ids, topk_weights, w13, w2, w3, b13, b2 = _all_contiguous(
        x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, w3=w3, b13=b13, b2=b2)
    needs = dict(need_dx=need_dx, need_dtopk_weights=need_dtopk_weights, need_dw13=need_dw13, need_dw2=need_dw2,
                 need_dw3=need_dw3, need_db13=need_db13, need_db2=need_db2)
    outputs, buffers = zip(*_backward_buffers(x, topk_weights, w13, w2, w3, b13, b2, wgrad_f32, needs))
    dx, dtopk_weights, dw13, dw2, dw3, db13, db2 = buffers
    options = options_of(gate_up, w13_transposed, w2_transposed, activation, limit, alpha)
    _lib.backward_into(dy, x, topk_ids, topk_weights, w13, w2, dx, dtopk_weights, dw13, dw2, saved_h, options, w3=w3,
                       b13=b13, b2=b2, dw3=dw3, db13=db13, db2=db2)
    return tuple(outputs)


# saved_h is a required argument of the op (an empty tensor means "recompute"): some torch versions drop a trailing
# defaulted argument before bumping the version counters of the mutated ones, and then fail to find it.
_moe_backward_op = torch.library.custom_op("megamoe::moe_backward", mutates_args=("saved_h",))(_moe_backward)


@_moe_backward_op.register_fake
def _(*args, **kwargs):
    a = bound_arguments(_moe_backward, args, kwargs)
    needs = {f"need_{name}": a[f"need_{name}"] for name in GRAD_NAMES}
    buffers = _backward_buffers(a["x"], a["topk_weights"], a["w13"], a["w2"], a["w3"], a["b13"], a["b2"],
                                a["wgrad_f32"], needs)
    return tuple(out for out, _ in buffers)


def _moe_backward_accumulate(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
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
    need_dx: bool = True,
    need_dtopk_weights: bool = True,
    need_dw13: bool = True,
    need_dw2: bool = True,
    need_dw3: bool = True,
    need_db13: bool = True,
    need_db2: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.ops.megamoe.moe_backward_accumulate: moe_backward whose weight and bias gradients are added into the
    main_grad_* buffers (f32, shaped as w13, w2, w3, b13, b2; an empty [0] tensor: no buffer), which it declares
    mutated. Returns (dx, d topk_weights, dw13, dw2, dw3, db13, db2) with an empty [0] tensor in place of each gradient
    added into a buffer, not needed, or of an absent parameter; a needed one without a buffer comes back in f32."""
    dy, saved_h = _grad_and_saved_h("dy", dy, saved_h)
    x, topk_ids, topk_weights, w13, w2, w3, b13, b2 = _all_contiguous(
        x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, w3=w3, b13=b13, b2=b2)
    needs = dict(dx=need_dx, dtopk_weights=need_dtopk_weights, dw13=need_dw13, dw2=need_dw2, dw3=need_dw3,
                 db13=need_db13, db2=need_db2)
    main_grad_args = (main_grad_w13, main_grad_w2, main_grad_w3, main_grad_b13, main_grad_b2)
    outputs, buffers = zip(*(_grad_buffers(x, zip(GRAD_NAMES[:2], (x, topk_weights)), needs, False) +
                             _main_grads.accumulate_buffers(x, (w13, w2, w3, b13, b2), main_grad_args, needs)))
    dx, dtopk_weights, dw13, dw2, dw3, db13, db2 = buffers
    options = options_of(gate_up, w13_transposed, w2_transposed, activation, limit, alpha)
    _lib.backward_into(dy, x, topk_ids, topk_weights, w13, w2, dx, dtopk_weights, dw13, dw2, saved_h, options,
                       accumulate=True, w3=w3, b13=b13, b2=b2, dw3=dw3, db13=db13, db2=db2)
    return tuple(outputs)


_moe_backward_accumulate_op = torch.library.custom_op(
    "megamoe::moe_backward_accumulate", mutates_args=("saved_h", *_main_grads.OP_ARGS))(_moe_backward_accumulate)


@_moe_backward_accumulate_op.register_fake
def _(*args, **kwargs):
    a = bound_arguments(_moe_backward_accumulate, args, kwargs)
    needs = {name: a[f"need_{name}"] for name in GRAD_NAMES}
    first = _grad_buffers(a["x"], zip(GRAD_NAMES[:2], (a["x"], a["topk_weights"])), needs, False)
    weights = _main_grads.fake_accumulate_outputs(a["x"], [a[name] for name in _main_grads.PARAM_NAMES],
                                                  [a[name] for name in _main_grads.OP_ARGS], needs)
    return tuple(out for out, _ in first) + tuple(weights)


def _weight_grads_from_accumulate(outputs, params, buffers, as_f32):
    """The weight gradients (PARAM_NAMES order) of a moe_backward_accumulate-style op's outputs: the buffer where one
    was given, else the op's f32 output (in its parameter's dtype unless as_f32); None where not computed."""
    grads = []
    for out, param, buffer in zip(outputs, params, buffers):
        if buffer is not None:
            grads.append(buffer)
        elif param is None or out.dim() == 1 and out.numel() == 0:
            grads.append(None)
        else:
            grads.append(out if as_f32 else out.to(param.dtype))
    return grads


def moe_backward(dy, x, topk_ids, topk_weights, w13, w2, saved_h=None, wgrad_f32=False, *, w3=None, b13=None, b2=None,
                 layout=None, activation=None, grads=None, main_grads=None):
    """MoEGrads (dx, d topk_weights, dw13, dw2, dw3, db13, db2) of moe_forward's inputs given dy [T, H]; None for
    those not in `grads` (names of GRAD_NAMES; None: all) and for absent parameters. saved_h: moe_forward's h (keep-h
    mode; consumed: dh is written over it, so it serves one backward) or None (recompute h). wgrad_f32: the weight
    and bias gradients in f32 (main-grad style) instead of the parameters' dtype. layout / activation: as the
    forward's (layouts.py). Plain tensors only (a DTensor raises TypeError: pass its .to_local()).

    main_grads (Megatron's main_grad; main_grads.py): f32 buffers shaped as w13, w2 (, w3, b13, b2), as a tuple in that
    order or a dict by name; the backward adds each wanted weight gradient into its buffer in the kernels' epilogue
    (buffer = buffer + grad, deterministic), and MoEGrads holds that same buffer there. Wanted weight gradients without
    a buffer come back as with wgrad_f32."""
    refuse_dtensors("megamoe.moe_backward", "the backward takes plain tensors", dy=dy, x=x, topk_ids=topk_ids,
                    topk_weights=topk_weights, w13=w13, w2=w2, saved_h=saved_h, w3=w3, b13=b13, b2=b2)
    if saved_h is None:
        saved_h = dy.new_empty((0,)) if isinstance(dy, torch.Tensor) else None
    needs = _needs(GRAD_NAMES, grads)
    params = (w13, w2, w3, b13, b2)
    buffers = _main_grads.by_param("megamoe.moe_backward", main_grads, dict(zip(_main_grads.PARAM_NAMES, params)))
    present = (True, True, True, True, w3 is not None, b13 is not None, b2 is not None)
    if _main_grads.any_given(buffers.values()):
        outputs = _moe_backward_accumulate_op(dy, x, topk_ids, topk_weights, w13, w2, saved_h,
                                              *_main_grads.op_arguments(buffers.values(), dy), w3, b13, b2,
                                              **op_options(layout, activation), **needs)
        weight_grads = _weight_grads_from_accumulate(outputs[2:], params, buffers.values(), wgrad_f32)
        outputs = (*outputs[:2], *weight_grads)
    else:
        outputs = _moe_backward_op(dy, x, topk_ids, topk_weights, w13, w2, saved_h, wgrad_f32, w3, b13, b2,
                                   **op_options(layout, activation), **needs)
    return MoEGrads(*(out if have and needs[f"need_{name}"] else None
                      for name, out, have in zip(GRAD_NAMES, outputs, present)))


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w13, w2, _keep_h, w3, b13, b2, *rest = inputs
    options, main_grad_inputs = rest[:6], rest[6:]
    _y, h = output
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)  # h's gradient stays None: no [T*topk, 2I] of zeros per backward
    ctx.options = options_of(*options)
    ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2, h, w3, b13, b2)
    # Kept as they are, not saved: other backwards add into them in between (microbatches), which would fail the saved
    # tensors' version check.
    ctx.main_grads = tuple(main_grad_inputs)


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


# The forward inputs whose gradients the backward returns: their position among moe_forward's inputs.
_GRAD_INPUTS = {"dx": 0, "dtopk_weights": 2, "dw13": 3, "dw2": 4, "dw3": 6, "db13": 7, "db2": 8}


def _needs_input_grad(ctx, index):
    """ctx.needs_input_grad[index], False past its end: the dispatcher drops trailing arguments left at their
    defaults (absent w3, b13, b2), and needs_input_grad covers only the arguments passed."""
    return index < len(ctx.needs_input_grad) and ctx.needs_input_grad[index]


def _backward(ctx, dy, _dh):
    num_inputs = len(ctx.needs_input_grad)
    if dy is None:  # y unused by the loss: nothing flows back
        return (None,) * num_inputs
    x, topk_ids, topk_weights, w13, w2, h, w3, b13, b2 = _saved_tensors(ctx)
    saved_h = _saved_h_or_none(h)  # recompute mode's empty h is not passed: the op would count it as mutated
    if saved_h is None:
        saved_h = dy.new_empty((0,))
    needs = {f"need_{name}": _needs_input_grad(ctx, index) for name, index in _GRAD_INPUTS.items()}
    if _main_grads.any_given(ctx.main_grads):
        outputs = _moe_backward_accumulate_op(dy, x, topk_ids, topk_weights, w13, w2, saved_h,
                                              *_main_grads.op_arguments(ctx.main_grads, dy), w3, b13, b2,
                                              **ctx.options, **needs)
        weight_grads = _weight_grads_from_accumulate(outputs[2:], (w13, w2, w3, b13, b2), ctx.main_grads, False)
        outputs = (*outputs[:2], *(None if buffer is not None else grad  # accumulated: no autograd gradient
                                   for grad, buffer in zip(weight_grads, ctx.main_grads)))
    else:
        outputs = _moe_backward_op(dy, x, topk_ids, topk_weights, w13, w2, saved_h, False, w3, b13, b2,
                                   **ctx.options, **needs)
    grads = [None] * num_inputs
    for (name, index), out in zip(_GRAD_INPUTS.items(), outputs):
        if needs[f"need_{name}"]:
            grads[index] = out
    return tuple(grads)


moe_forward.register_autograd(_backward, setup_context=_setup_context)


def _replicated_weights(entry, x, topk_ids, topk_weights, w13, w2, w3, b13, b2):
    """(w13, w2, w3, b13, b2) as plain tensors: the local tensors of replicated DTensors (dtensor.py)."""
    refuse_dtensor_activations(entry, x=x, topk_ids=topk_ids, topk_weights=topk_weights)
    weights = dict(w13=w13, w2=w2, w3=w3, b13=b13, b2=b2)
    return [replicated_local(entry, name, tensor) for name, tensor in weights.items()]


def _check_args(**tensors):
    for name, tensor in tensors.items():
        if tensor is not None:
            _lib.check_arg(name, tensor)


def moe(x, topk_ids, topk_weights, w13, w2, recompute=False, *, w3=None, b13=None, b2=None, layout=None,
        activation=None, main_grads=None):
    """Routed-expert MLP (DESIGN.md section 1), differentiable in x, topk_weights and the expert parameters.

    x [T, H]; topk_ids [T, topk] int32/int64 in [0, E) or -1 (dropped); topk_weights [T, topk] f32 or
    x's dtype; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]. Returns y [T, H] in x's dtype:
    y_t = sum_j topk_weights[t, j] * w2[e] (silu(w13[e, :I] x_t) * (w13[e, I:] x_t)), e = topk_ids[t, j].

    Other layouts and activations (megamoe.Layout, megamoe.Activation; layouts.py): layout=megamoe.SEPARATE takes the
    up projection as w3, layout=megamoe.GPT_OSS gpt-oss's interleaved transposed weights, activation=
    megamoe.clamped_swiglu(7.0, 1.702) its activation; b13 [E, 2I] (arranged as w13's rows) and b2 [E, H] are
    optional biases: o = w2[e] act(w13[e] x_t + b13[e]) + b2[e]. CUDA runs every option, on the fused
    sm_90a kernels on a Hopper GPU (a w3 or bias too misaligned for them takes the portable CUDA kernels, and a
    one-time warning names it); megamoe.path_of tells which path a call takes and why.

    Memory mode when gradients are wanted: by default the forward keeps h = [g, u] ([T*topk, 2I], the fastest
    backward, which writes dh over it: one backward per forward); recompute=True keeps only the inputs and recomputes
    h in the backward (same gradients; also for graphs backpropagated more than once).

    DTensor weights (every placement Replicate, as FSDP2 presents replicated parameters in its forward) are read
    through .to_local() and get DTensor gradients; sharded ones raise ValueError (megamoe.ep.moe takes expert-sharded
    weights), DTensor activations TypeError (dtensor.py).

    main_grads (Megatron-style gradient accumulation fusion; main_grads.py): f32 buffers for the weights, e.g.
    (w13.main_grad, w2.main_grad), as a tuple in the order (w13, w2, w3, b13, b2) (None entries: no buffer) or a dict
    by name. Each buffer is a contiguous float32 tensor shaped as its parameter (a DTensor weight's local tensor), on
    its device, not requiring grad. What the user gets: every backward through this call adds the weight's gradient
    into its buffer (buffer = buffer + grad, in f32, in the kernels' epilogue: no extra pass; bitwise the same for the
    same inputs and initial buffer; experts with no tokens leave their part untouched), only for weights that require
    grad; autograd's gradient of such a weight is None (its .grad is not created or changed, and hooks on its
    gradient accumulation do not run for this call); weights without a buffer, x and topk_weights get their usual
    gradients. Two backwards (two calls, or one graph backpropagated twice with recompute=True) add twice. The buffers
    are kept by reference, not saved for backward: in eager mode other backwards may add into them in between (several
    microbatches in flight). Under torch.compile the op declares the buffers mutated (megamoe::moe_backward_accumulate)
    and the compiled backward adds into them in place; the compiled graph saves them for its backward, so there each
    compiled forward's backward must run before another backward adds into the same buffers (forward, backward per
    microbatch). Zeroing the buffers between steps is the caller's (Megatron's zero_grad_buffer).
    """
    w13, w2, w3, b13, b2 = _replicated_weights("megamoe.moe", x, topk_ids, topk_weights, w13, w2, w3, b13, b2)
    _check_args(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, w3=w3, b13=b13, b2=b2)
    buffers = _main_grads.by_param("megamoe.moe", main_grads, dict(w13=w13, w2=w2, w3=w3, b13=b13, b2=b2))
    differentiable = [t for t in (x, topk_weights, w13, w2, w3, b13, b2) if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
    y, _h = moe_forward(x, topk_ids, topk_weights, w13, w2, needs_grad and not recompute, w3, b13, b2,
                        **op_options(layout, activation), **_main_grad_kwargs(buffers))
    return y


def _main_grad_kwargs(buffers):
    """The forward ops' main_grad_* keyword arguments for the given buffers (none when there are none, so the op
    calls without main_grads stay as they were)."""
    return {arg: buffer for arg, buffer in zip(_main_grads.OP_ARGS, buffers.values()) if buffer is not None}


def path_of(x, topk_ids, topk_weights, w13, w2, *, w3=None, b13=None, b2=None, layout=None, activation=None,
            backward=False):
    """Which implementation megamoe.moe's forward (backward=True: its backward) runs on these arguments: "reference"
    (CPU tensors), "cuda" (the portable CUDA kernels), "sm90" (the fused Hopper kernels) or "sm90+cuda-weight-grads"
    (backward: sm_90a GEMMs, portable weight gradients), as a str with `.reason`: what keeps a call the fused sm_90a
    kernels would otherwise run on the portable ones (e.g. "w3 not 16-byte aligned: ..."), else None. Reads no data (allocates one [T, H] output for the forward's query)."""
    w13, w2, w3, b13, b2 = _replicated_weights("megamoe.path_of", x, topk_ids, topk_weights, w13, w2, w3, b13, b2)
    _check_args(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, w3=w3, b13=b13, b2=b2)
    x, topk_ids, topk_weights, w13, w2, w3, b13, b2 = _all_contiguous(
        x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, w3=w3, b13=b13, b2=b2)
    tensors = dict(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, w3=w3, b13=b13, b2=b2)
    if backward:
        tensors["dy"] = x  # the query reads no data: dy needs only x's shape, dtype and device
    else:
        tensors["y"] = torch.empty_like(x, memory_format=torch.contiguous_format)
    return _lib.path("backward" if backward else "forward", tensors, op_options(layout, activation))
