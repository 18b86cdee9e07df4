"""The three custom ops of one C API entry point, generated from one description of their arguments.

Each entry point (the whole layer: ops.py; grouped rows: grouped.py) is three torch.library custom ops with fake
kernels, the forward's autograd backed by the two backward ops:

    megamoe::<name>_forward              (*inputs, keep_h, *EXPERTS, *OPTIONS, *FP8, *main_grad_* = None) -> (out, h)
    megamoe::<name>_backward             (grad, *inputs, saved_h!, wgrad_f32, *EXPERTS, *OPTIONS, *FP8, *need_*)
    megamoe::<name>_backward_accumulate  (grad, *inputs, saved_h!, *main_grad_*!, *EXPERTS, *OPTIONS, *FP8, *need_*)

An EntryPoint names what differs (its own inputs, e.g. x, topk_ids, topk_weights, w13, w2; the names of its output and
of the output's gradient; its gradients, the fields of a NamedTuple); the groups below are shared by both entry points.
From the argument lists come each op's signature (torch infers the schema from it), the C API call (_lib.call: the
tensors go by the params structs' field names, which are the arguments' names), the fake kernel and the autograd glue.
Adding an argument is one entry in one list: an entry point's own input in its EntryPoint (ops.py, grouped.py), an
expert tensor in EXPERTS, an option in layouts.op_options() (from Layout / Activation / the precision), a flag like
WGRAD_F32 here; a new C API field also needs its ctypes field in _lib.py (the ABI guard checks the structs against the
library).

Precision "fp8" (an option, like the layout's): the six FP8 weights (fp8.Fp8Experts) ride as the optional tensors FP8
(fp8_w13, fp8_w13_t, fp8_w13_scales, fp8_w2, fp8_w2_t, fp8_w2_scales; None in "bf16", and fp8_w13_t / fp8_w2_t
None for one-copy FP8 weights), inputs of every op like the experts; the forward's autograd saves them with the other
inputs, so its backward reads the ones the forward read.

The backwards compute only the gradients asked for (their need_* arguments; autograd asks for those of
ctx.needs_input_grad) and return an empty [0] tensor for the others and for absent inputs (a custom op cannot return
None). saved_h is required and declared mutated (the backward writes dh over it; an empty tensor means "recompute
h"): some torch versions drop a trailing defaulted argument before bumping the version counters of the mutated ones,
and then fail to find it. The accumulating backward adds the weight gradients into its main_grad_* buffers (f32;
an empty [0] tensor: no buffer), which it declares mutated; the forward carries them to it without reading them.
"""

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from . import _lib
from . import fp8 as _fp8
from . import main_grads as _main_grads
from .dtensor import refuse_dtensors
from .layouts import op_options


class Arg(NamedTuple):
    """One argument of a custom op: its name, its type annotation (from which torch infers the schema) and its
    default (REQUIRED: none)."""

    name: str
    annotation: object
    default: object = inspect.Parameter.empty


REQUIRED = inspect.Parameter.empty
MAX_SLOTS = 2**31 - 1  # the rows of h (T * topk, or R): sorted-row indices are int32 on the device
TENSOR = torch.Tensor
OPTIONAL_TENSOR = Optional[torch.Tensor]

# The expert parameters beyond w13 / w2 (after the entry point's inputs in every op).
EXPERTS = tuple(Arg(name, OPTIONAL_TENSOR, None) for name in ("w3", "b13", "b2"))
# The FP8 weights of precision "fp8" (fp8.Fp8Experts; the params structs' fp8.<field>), after the options.
FP8 = tuple(Arg(name, OPTIONAL_TENSOR, None) for name in _lib.FP8_ARGS)
# The experts' layout, activation and precision (layouts.op_options(); their defaults are Layout()'s, Activation()'s
# and "bf16").
OPTIONS = tuple(Arg(name, type(value), value) for name, value in op_options().items())
KEEP_H = Arg("keep_h", bool, False)
SAVED_H = Arg("saved_h", TENSOR)
WGRAD_F32 = Arg("wgrad_f32", bool, False)
EXPERT_NAMES = tuple(arg.name for arg in EXPERTS)
FP8_NAMES = _lib.FP8_ARGS
OPTION_NAMES = tuple(arg.name for arg in OPTIONS)


def tensor_args(*names):
    """Args of required tensors."""
    return tuple(Arg(name, TENSOR) for name in names)


def gradients(typename, module, rows, row_weights, doc):
    """The NamedTuple of an entry point's gradients, in its backward ops' output order: d<rows>, d<row_weights>, then
    the expert parameters' (dw13, dw2, dw3, db13, db2: shaped as w13, w2, w3, b13 [E, 2I], b2 [E, H]); each a tensor,
    or None where not asked for or where its input is absent."""
    fields = [(f"d{name}", Optional[torch.Tensor]) for name in (rows, row_weights, *_main_grads.PARAM_NAMES)]
    grads = NamedTuple(typename, fields)
    grads.__module__, grads.__doc__ = module, doc
    return grads


_warned = set()  # the arguments already warned about as not contiguous


def contiguous(name, tensor):
    """The kernels read row-major memory: copy a strided input once, and say so once per argument."""
    if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"megamoe: {name} is not contiguous; copying it (pass a contiguous tensor to avoid this)")
        return tensor.contiguous()
    return tensor


def check_args(tensors, required=()):
    """What must hold of each given tensor, and of each `required` one (None there is a TypeError naming it), before
    the library can be asked about it (_lib.check_arg)."""
    for name, tensor in tensors.items():
        if tensor is not None or name in required:
            _lib.check_arg(name, tensor)


def _intermediate(w2, w2_transposed):
    return w2.shape[1] if w2_transposed else w2.shape[2]  # I of w2 [E, H, I] or [E, I, H]


def _saved_h_or_none(saved_h):
    return saved_h if saved_h is not None and saved_h.dim() == 2 else None  # the empty [0] means "recompute"


def _needs(names, grads):
    """need_<name> keyword arguments of a backward op: all True for grads=None, else True for the names in grads."""
    if grads is None:
        return {f"need_{name}": True for name in names}
    unknown = [name for name in grads if name not in names]
    if unknown:
        raise ValueError(f"megamoe: grads: unknown gradient {unknown[0]!r} (one of {', '.join(names)})")
    return {f"need_{name}": name in grads for name in names}


def _needs_input_grad(ctx, index):
    """ctx.needs_input_grad[index], False past its end: the dispatcher drops trailing arguments left at their
    defaults (absent w3, b13, b2), and needs_input_grad covers only the arguments passed."""
    return index < len(ctx.needs_input_grad) and ctx.needs_input_grad[index]


def _grad_buffers(like, params, needs, wgrad_f32):
    """Per (name, parameter) of `params`, in order: (op output, buffer the C API writes or None: not wanted). The
    output is an uninitialised gradient shaped as its parameter where the parameter exists and needs[name], else an
    empty [0] placeholder. Weight and bias gradients (the third on) in f32 when wgrad_f32."""
    out = []
    for index, (name, param) in enumerate(params):
        if param is None or not needs[name]:
            out.append((like.new_empty((0,)), None))
            continue
        dtype = torch.float32 if wgrad_f32 and index >= 2 else None
        grad = torch.empty_like(param, dtype=dtype, memory_format=torch.contiguous_format)
        out.append((grad, grad))
    return out


def _weight_grads_from_accumulate(outputs, params, buffers, as_f32):
    """The weight gradients (PARAM_NAMES order) of an accumulating backward's outputs: the buffer where one was given,
    else the op's f32 output (in its parameter's dtype unless as_f32); None where not computed."""
    grads = []
    for out, param, buffer in zip(outputs, params, buffers):
        if buffer is not None:
            grads.append(buffer)
        elif param is None or out.dim() == 1 and out.numel() == 0:
            grads.append(None)
        else:
            grads.append(out if as_f32 else out.to(param.dtype))
    return grads


def _saved_tensors(ctx, entry):
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


def _given(tensors, names):
    """{name: tensor} of the names whose tensor is given: an absent optional argument is left out of an op call (as
    before the argument existed), not passed as None."""
    return {name: tensors[name] for name in names if tensors.get(name) is not None}


class ArgList:
    """An op's arguments: the function torch.library infers the op's schema from, and their binding by name."""

    def __init__(self, args):
        self.args = tuple(args)
        self.names = [arg.name for arg in self.args]
        self.defaults = {arg.name: arg.default for arg in self.args if arg.default is not REQUIRED}

    def bind(self, values, keywords=()):
        """{name: value} of every argument, defaults filled in (the dispatcher passes the arguments positionally and
        may leave trailing defaulted ones out)."""
        bound = dict(self.defaults)
        bound.update(zip(self.names, values))
        bound.update(keywords)
        return bound

    def function(self, name, returns, body):
        """A function of these arguments returning `returns`, calling body(arguments by name)."""

        def fn(*values, **keywords):
            return body(self.bind(values, keywords))

        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        fn.__signature__ = inspect.Signature(
            [inspect.Parameter(arg.name, kind, default=arg.default, annotation=arg.annotation) for arg in self.args],
            return_annotation=returns)
        fn.__name__ = fn.__qualname__ = name
        return fn


@dataclass(frozen=True)
class EntryPoint:
    """What an entry point's ops take beyond the shared arguments, and what their C API calls name."""

    name: str  # the ops are megamoe::<name>_forward, <name>_backward, <name>_backward_accumulate
    user_entry: str  # the Python entry point its errors name, e.g. "megamoe.moe"
    c_prefix: str  # of its C API entry points' _lib.call kinds: <c_prefix>forward, <c_prefix>backward
    inputs: tuple  # Args of the forward's leading inputs, in op order (their names are the params structs' fields)
    output: str  # the forward's output (y, out) and the backward's incoming gradient (dy, dout), as the C API names
    grad_output: str
    grads: type  # the backward's gradients, a gradients() NamedTuple: "d" + an input's name (dx for x), rows' first
    num_slots: Callable  # the rows of h, from the forward's arguments by name: [num_slots, 2I]; None for a wrong rank
    too_many_slots: Callable  # the message refusing more than MAX_SLOTS of them, naming the argument


class OpFamily:
    """The forward, backward and accumulating backward custom ops of an EntryPoint, registered on construction, and
    the generic halves of its Python entry points (forward with autograd, manual backward, path query)."""

    def __init__(self, entry: EntryPoint):
        self.entry = entry
        self.grad_names = entry.grads._fields
        self.grad_inputs = tuple(name[1:] for name in self.grad_names)  # dx -> x, dscores -> scores, dw13 -> w13
        self.input_names = tuple(arg.name for arg in entry.inputs)
        self.required_inputs = tuple(arg.name for arg in entry.inputs if arg.default is REQUIRED)
        self.rows = self.grad_inputs[0]  # x / x_sorted: its dtype and device are every row tensor's
        self.tensor_names = self.input_names + EXPERT_NAMES + FP8_NAMES  # the inputs of every op, in op order
        grad_arg = Arg(entry.grad_output, TENSOR)
        inputs_required = tuple(arg._replace(default=REQUIRED) for arg in entry.inputs)  # saved_h follows them
        main_grads_required = tuple(Arg(name, TENSOR) for name in _main_grads.OP_ARGS)
        needs = tuple(Arg(f"need_{name}", bool, True) for name in self.grad_names)
        self.forward_args = ArgList((*entry.inputs, KEEP_H, *EXPERTS, *OPTIONS, *FP8,
                                     *(Arg(name, OPTIONAL_TENSOR, None) for name in _main_grads.OP_ARGS)))
        backward_args = ArgList((grad_arg, *inputs_required, SAVED_H, WGRAD_F32, *EXPERTS, *OPTIONS, *FP8, *needs))
        accumulate_args = ArgList((grad_arg, *inputs_required, SAVED_H, *main_grads_required, *EXPERTS, *OPTIONS,
                                   *FP8, *needs))
        self.grad_input_index = {grad: self.forward_args.names.index(name)
                                 for grad, name in zip(self.grad_names, self.grad_inputs)}
        grads_type = tuple[(torch.Tensor,) * len(self.grad_names)]

        self.forward_op = torch.library.custom_op(f"megamoe::{entry.name}_forward", mutates_args=())(
            self.forward_args.function(f"{entry.name}_forward", tuple[torch.Tensor, torch.Tensor], self._forward))
        self.forward_op.register_fake(self.forward_args.function("fake", None, self._fake_forward))
        self.forward_op.register_autograd(self._autograd_backward, setup_context=self._setup_context)
        self.backward_op = self._backward_op("backward", backward_args, grads_type, False, ("saved_h",))
        self.backward_accumulate_op = self._backward_op("backward_accumulate", accumulate_args, grads_type, True,
                                                        ("saved_h", *_main_grads.OP_ARGS))

    def _backward_op(self, suffix, args, returns, accumulate, mutates):
        def real(a):
            return self._backward(a, accumulate)

        def fake(a):
            return tuple(out for out, _ in self._grad_buffers(a, a, accumulate))

        name = f"{self.entry.name}_{suffix}"
        op = torch.library.custom_op(f"megamoe::{name}", mutates_args=mutates)(args.function(name, returns, real))
        op.register_fake(args.function("fake", returns, fake))
        return op

    # ---- the op bodies (a: the op's arguments by name)

    def _contiguous_tensors(self, a, names):
        return {name: contiguous(name, a[name]) for name in names}

    def _h_shape(self, a):
        slots = self.entry.num_slots(a)
        if not a["keep_h"] or slots is None or a["w2"].dim() != 3:  # a wrong rank: the library names it
            return (0,)
        return (slots, 2 * _intermediate(a["w2"], a["w2_transposed"]))  # [slots, 2I]

    def _forward(self, a):
        """out [rows, H], and h = [g, u] [slots, 2I] by sorted row when keep_h (for one backward), else [0]."""
        tensors = self._contiguous_tensors(a, self.tensor_names)
        rows = tensors[self.rows]
        out = torch.empty_like(rows, memory_format=torch.contiguous_format)  # [T, H] / [R, H]
        h = rows.new_empty(self._h_shape(a))
        _lib.call(self.entry.c_prefix + "forward",
                  {**tensors, self.entry.output: out, "saved_h": h if a["keep_h"] else None},
                  {name: a[name] for name in OPTION_NAMES})
        return out, h

    def _fake_forward(self, a):
        rows = a[self.rows]
        return torch.empty_like(rows, memory_format=torch.contiguous_format), rows.new_empty(self._h_shape(a))

    def _grad_buffers(self, a, tensors, accumulate):
        """Per gradient (grad_names order): (op output, buffer the C API writes or None)."""
        needs = {name: a[f"need_{name}"] for name in self.grad_names}
        like = tensors[self.rows]
        params = [(grad, tensors[name]) for grad, name in zip(self.grad_names, self.grad_inputs)]
        if not accumulate:
            return _grad_buffers(like, params, needs, a["wgrad_f32"])
        weights = [tensors[name] for name in _main_grads.PARAM_NAMES]
        return (_grad_buffers(like, params[:2], needs, False) +
                _main_grads.accumulate_buffers(like, weights, [a[name] for name in _main_grads.OP_ARGS], needs))

    def _backward(self, a, accumulate):
        grad = contiguous(self.entry.grad_output, a[self.entry.grad_output])
        saved_h = _saved_h_or_none(a["saved_h"])
        tensors = self._contiguous_tensors(a, self.tensor_names)
        outputs, buffers = zip(*self._grad_buffers(a, tensors, accumulate))
        _lib.call(self.entry.c_prefix + "backward",
                  {self.entry.grad_output: grad, **tensors, "saved_h": contiguous("saved_h", saved_h),
                   **dict(zip(self.grad_names, buffers))},
                  {name: a[name] for name in OPTION_NAMES}, accumulate_weight_grads=int(accumulate))
        return tuple(outputs)

    # ---- calling the ops

    def call_backward(self, grad, tensors, saved_h, buffers, wgrad_f32, options, needs):
        """The backward op's gradients (grad_names order) for `tensors` (tensor_names -> tensor or None); with any
        main_grads buffer (PARAM_NAMES order) the accumulating op's, each weight gradient the buffer where one was
        given, else in its parameter's dtype (f32 when wgrad_f32)."""
        head = [tensors[name] for name in self.input_names]
        experts = [tensors[name] for name in EXPERT_NAMES]
        fp8 = _given(tensors, FP8_NAMES)
        if not _main_grads.any_given(buffers):
            return self.backward_op(grad, *head, saved_h, wgrad_f32, *experts, **options, **fp8, **needs)
        outputs = self.backward_accumulate_op(grad, *head, saved_h, *_main_grads.op_arguments(buffers, grad),
                                              *experts, **options, **fp8, **needs)
        params = [tensors[name] for name in _main_grads.PARAM_NAMES]
        return (*outputs[:2], *_weight_grads_from_accumulate(outputs[2:], params, buffers, wgrad_f32))

    def _setup_context(self, ctx, inputs, output):
        a = self.forward_args.bind(inputs)
        _out, h = output
        ctx.mark_non_differentiable(h)
        ctx.set_materialize_grads(False)  # h's gradient stays None: no [slots, 2I] of zeros per backward
        ctx.options = {name: a[name] for name in OPTION_NAMES}
        ctx.save_for_backward(h, *(a[name] for name in self.tensor_names))
        # Kept as they are, not saved: other backwards add into them in between (microbatches), which would fail the
        # saved tensors' version check.
        ctx.main_grads = tuple(a[name] for name in _main_grads.OP_ARGS)

    def _autograd_backward(self, ctx, grad, _dh):
        num_inputs = len(ctx.needs_input_grad)
        if grad is None:  # the output unused by the loss: nothing flows back
            return (None,) * num_inputs
        grad = grad.contiguous()  # autograd's own gradient (y.sum()'s is expanded): copied without a warning
        h, *saved = _saved_tensors(ctx, self.entry.user_entry)
        saved_h = _saved_h_or_none(h)  # recompute mode's empty h is not passed: the op would count it as mutated
        if saved_h is None:
            saved_h = grad.new_empty((0,))
        needs = {f"need_{name}": _needs_input_grad(ctx, index) for name, index in self.grad_input_index.items()}
        outputs = self.call_backward(grad, dict(zip(self.tensor_names, saved)), saved_h, ctx.main_grads, False,
                                     ctx.options, needs)
        grads = [None] * num_inputs
        for (name, index), out, buffer in zip(self.grad_input_index.items(), outputs, (None, None, *ctx.main_grads)):
            if needs[f"need_{name}"] and buffer is None:  # added into a main_grads buffer: no autograd gradient
                grads[index] = out
        return tuple(grads)

    # ---- the generic halves of the Python entry points (plain tensors: DTensors already read by the caller)

    def forward_call(self, inputs, experts, recompute, layout, activation, main_grads, precision="bf16",
                     fp8_experts=None):
        """The arguments (positional, keyword) of the forward op on `inputs` (the entry point's, by name) and
        `experts` (w3, b13, b2), every argument checked first (TypeError / ValueError / NotImplementedError naming
        it; the library checks the rest when the op runs): h kept unless recompute or no gradient is wanted;
        main_grads ride along to the autograd backward. precision "fp8": the FP8 weights fp8_experts, else the
        cache's (fp8.experts_for), saved for the backward with the other inputs. The entry points call it inside
        their argument_errors guard and pass the result to forward()."""
        tensors = {**inputs, **experts}
        self.check_tensors(tensors)
        if not isinstance(recompute, bool):
            raise TypeError(f"megamoe: recompute must be True or False, got {type(recompute).__name__}")
        options = op_options(layout, activation, precision)
        fp8 = _fp8.op_arguments(self.entry.user_entry, options, inputs["w13"], inputs["w2"], fp8_experts,
                                w3=experts.get("w3"))
        buffers = _main_grads.by_param(self.entry.user_entry, main_grads,
                                       {name: tensors[name] for name in _main_grads.PARAM_NAMES})
        differentiable = [tensors[name] for name in self.grad_inputs if tensors[name] is not None]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
        return ((*inputs.values(), needs_grad and not recompute, *experts.values()),
                {**options, **fp8, **{arg: buffer for arg, buffer in zip(_main_grads.OP_ARGS, buffers.values())
                                      if buffer is not None}})  # no main_grad_* / fp8_* arguments without tensors

    def forward(self, call):
        """The forward op's output on forward_call's arguments."""
        args, keywords = call
        out, _h = self.forward_op(*args, **keywords)
        return out

    def check_tensors(self, tensors):
        """The tensors of a call (the entry point's inputs and experts by name) as far as the library cannot check
        them: each given one describable (_lib.check_arg), every required input given, and the rows of h (T * topk,
        or R) below 2^31 (checked before any copy or allocation, which for so many rows could run out of memory)."""
        check_args(tensors, self.required_inputs)
        slots = self.entry.num_slots(tensors)
        if slots is not None and slots > MAX_SLOTS:
            raise NotImplementedError("megamoe: " + self.entry.too_many_slots(tensors))

    def backward(self, entry, grad, inputs, saved_h, wgrad_f32, experts, layout, activation, grads, main_grads,
                 precision="bf16", fp8_experts=None):
        """The entry point's manual backward: an `entry.grads` tuple of the gradients, None for those not in `grads`
        (None: all) and for absent inputs; `saved_h` the forward's h or None (recompute); main_grads as the forward's;
        precision "fp8" reads fp8_experts, else the cache's. Plain tensors only (a DTensor raises TypeError naming
        the argument)."""
        refuse_dtensors(entry, "the backward takes plain tensors", **{self.entry.grad_output: grad}, **inputs,
                        saved_h=saved_h, **experts)
        _lib.check_arg(self.entry.grad_output, grad)
        self.check_tensors({**inputs, **experts})
        options = op_options(layout, activation, precision)
        if saved_h is None:
            saved_h = grad.new_empty((0,)) if isinstance(grad, torch.Tensor) else None
        needs = _needs(self.grad_names, grads)
        tensors = {**inputs, **experts, **dict.fromkeys(FP8_NAMES),
                   **_fp8.op_arguments(entry, options, inputs["w13"], inputs["w2"], fp8_experts,
                                       w3=experts.get("w3"))}
        buffers = _main_grads.by_param(entry, main_grads, {name: tensors[name] for name in _main_grads.PARAM_NAMES})
        outputs = self.call_backward(grad, tensors, saved_h, tuple(buffers.values()), wgrad_f32, options, needs)
        return self.entry.grads(*(out if tensors[name] is not None and needs[f"need_{grad_name}"] else None
                                  for grad_name, name, out in zip(self.grad_names, self.grad_inputs, outputs)))

    def path(self, entry, inputs, experts, layout, activation, backward, precision="bf16", fp8_experts=None):
        """The implementation (a _lib.Path) the forward (backward=True: the backward) runs on these arguments. Reads
        no data (allocates one output for the forward's query, and precision "fp8" without fp8_experts uninitialised
        FP8 weights: fp8.empty_experts)."""
        self.check_tensors({**inputs, **experts})
        options = op_options(layout, activation, precision)
        fp8 = _fp8.op_arguments(entry, options, inputs["w13"], inputs["w2"], fp8_experts, quantize=False,
                                w3=experts.get("w3"))
        tensors = self._contiguous_tensors({**inputs, **experts, **dict.fromkeys(FP8_NAMES), **fp8},
                                           self.tensor_names)
        rows = tensors[self.rows]
        if backward:
            tensors[self.entry.grad_output] = rows  # the query reads no data: only the shape, dtype and device
        else:
            tensors[self.entry.output] = torch.empty_like(rows, memory_format=torch.contiguous_format)
        return _lib.path(self.entry.c_prefix + ("backward" if backward else "forward"), tensors, options)
