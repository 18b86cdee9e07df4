"""Megatron-core-style grouped MLP experts on megamoe: permuted rows, tokens per expert and permuted probs.

Megatron's MoE layer permutes each token's routed copies into rows grouped by local expert and calls its experts
module as `experts(permuted_local_hidden_states [R, H], tokens_per_expert [E], permuted_probs [R]) -> (output [R, H],
None)` (megatron/core/transformer/moe/experts.py); the probs scale each row's activation before fc2, and fc2's bias
too, so out_r = p_r (W2[e] act(W1[e] x_r + b1[e]) + b2[e]): megamoe.grouped_moe with scores = probs. Gated experts
(gated_linear_unit, swiglu): fc1's output is [gate, up] halves (torch.chunk(2)).

Two weight storages, read in place (no per-step copy; TE's per-expert lists where their memory allows, below):

    grouped_mlp        legacy GroupedMLP (removed from Megatron in #3410; megatron/core/transformer/moe/experts.py
                       before it): weight1 [H, E*2I], weight2 [E*I, H], which its grouped GEMM reads as the views
                       weight1.view(E, H, 2I) and weight2.view(E, I, H): megamoe.HF_TRANSPOSED on those views.
    te_grouped_mlp     TEGroupedMLP with moe_single_grouped_weight (TE GroupedLinear's one `weight` [E, out, in]):
                       fc1 [E, 2I, H], fc2 [E, H, I]: megamoe's default layout; biases [E, 2I], [E, H]
                       (moe_single_grouped_bias); or TE's default, one Parameter per expert (weight0 ... weight{E-1},
                       fc1 [2I, H] and fc2 [H, I] each; bias0 ...), passed as lists.

Per-expert lists. megamoe's C API reads one row-major [E, ...] tensor per weight, so a list is read in place (no
copy) where its E tensors are one contiguous block in expert order: same shape, dtype and device, contiguous each,
views of one storage with data_ptr(e) = data_ptr(0) + e * numel (elements). It is then one autograd Function whose
forward is an as_strided alias of that block and whose backward hands each weight_e its slice of the gradient
(grad.unbind(0), views); an optimizer's in-place update of any weight_e is seen by the next call, and one between a
forward and its backward raises. Every other layout is stacked (copied) on each call, with one warning per argument
naming pack_expert_parameters: equally spaced with gaps (step > numel), descending addresses (Megatron DDP lays a
bucket's parameters out in reverse registration order; in expert order that block would need a negative stride,
which as_strided cannot take), separate storages, non-contiguous tensors. Mixed shapes, dtypes or devices in a list,
or lists of different lengths, raise ValueError naming the argument. Under torch.compile lists are always stacked
(their addresses are not read while tracing). pack_expert_parameters(module_or_params) copies each list into one
new [E, ...] buffer once and re-points each parameter's .data (and main_grad) at its view, so later calls read it in
place; frameworks that re-home parameters (Megatron DDP's contiguous param / grad buffers) must be wrapped first and
packed after, or their lists fall back to the copy (see its docstring for what that means for DDP's buffers).

Gradient accumulation fusion (Megatron's gradient_accumulation_fusion, DDP's fp32 `param.main_grad`):
`gradient_accumulation_fusion=True` adds each weight's (and bias's) gradient into its `main_grad` in megamoe's
weight-gradient epilogue (megamoe's main_grads: `main_grad += grad`, f32, no extra pass) and autograd returns no
gradient for it. Where a parameter has Megatron DDP's `grad_added_to_main_grad` attribute, the backward sets it to
True and hands autograd a placeholder gradient (zeros where `zero_out_wgrad`, else uninitialised), as Megatron's own
fused-wgrad linear layers do, so DDP's per-parameter backward hooks still run (they skip the add for it). A per-expert
list fuses where its main_grads are one contiguous f32 block in expert order (the rule above; the weights themselves
may be copied): megamoe adds into that block, and every weight_e with `grad_added_to_main_grad` is marked and gets its
placeholder. Main_grads in any other layout raise ValueError naming `<argument>[0 ... E-1]`'s main_grads (pack them,
or pass gradient_accumulation_fusion=False: Megatron DDP's hooks then add each weight's .grad into its main_grad).

tokens_per_expert may be on the host (Megatron's all-to-all dispatcher keeps it there): it is copied to x's device
(non-blocking); on the device megamoe reads it there (no host sync). Not computed: moe_apply_probs_on_input, GLU
interleaving (moe_mlp_glu_interleave_size), activations other than SwiGLU and gpt-oss's clamped SwiGLU (Megatron's
quick_gelu with activation_func_clamp_value 7 and glu_linear_offset 1: activation=megamoe.clamped_swiglu(7.0, 1.702)).
"""

import re
import warnings

import torch

from ..grouped import grouped_moe
from ..layouts import CONCATENATED, HF_TRANSPOSED
from . import _checks


_ROW_NAMES = {"x_sorted": "permuted_local_hidden_states", "scores": "permuted_probs"}


class _AddedToMainGrad(torch.autograd.Function):
    """Identity on a parameter's view for megamoe; its backward marks the parameter's gradient as added into its
    main_grad (Megatron DDP's `grad_added_to_main_grad`) and returns a placeholder gradient, so the parameter's
    gradient accumulation and DDP's hook on it run as for Megatron's fused-wgrad layers."""

    @staticmethod
    def forward(ctx, param, shape):
        ctx.param = param  # a leaf Parameter, kept by reference (not a saved activation)
        ctx.set_materialize_grads(False)
        return param.view(shape)

    @staticmethod
    def backward(ctx, _grad):
        param = ctx.param
        param.grad_added_to_main_grad = True
        make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
        return make(param.shape, dtype=param.dtype, device=param.device), None


def _fused_view(entry, name, param, shape, fusion):
    """(the tensor megamoe reads: param viewed as `shape`, its main_grad buffer viewed alike or None)."""
    if param is None:
        return None, None
    _checks.tensor(entry, name, param)
    if param.numel() != torch.Size(shape).numel():
        raise ValueError(f"{entry}: {name} has shape {tuple(param.shape)}, not the {tuple(shape)} its experts need")
    if not (fusion and param.requires_grad):
        return param.view(shape), None
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        raise ValueError(f"{entry}: gradient_accumulation_fusion needs {name}.main_grad (an f32 buffer shaped as "
                         f"{name}), which is not set")
    if main_grad.shape != param.shape:
        raise ValueError(f"{entry}: {name}.main_grad has shape {tuple(main_grad.shape)}, {name} {tuple(param.shape)}")
    if hasattr(param, "grad_added_to_main_grad"):
        return _AddedToMainGrad.apply(param, shape), main_grad.view(shape)
    return param.view(shape), main_grad.view(shape)


def _rows(entry, x, tokens_per_expert, permuted_probs, num_experts):
    """x [R, H], tokens_per_expert on x's device, permuted_probs [R] in f32 or x's dtype; checked by their names."""
    _checks.tensor(entry, "permuted_local_hidden_states", x, 2)
    _checks.counts(entry, "tokens_per_expert", tokens_per_expert, num_experts)
    _checks.rows(entry, "permuted_probs", permuted_probs, x.shape[0], "permuted_local_hidden_states")
    if tokens_per_expert.device != x.device:
        tokens_per_expert = tokens_per_expert.to(x.device, non_blocking=True)
    return tokens_per_expert, _checks.scores_dtype(permuted_probs, x)


def _run(entry, names, x, tokens_per_expert, probs, weights, buffers, layout, activation, recompute, precision="bf16"):
    """megamoe.grouped_moe on the weights {name: tensor or None} with main_grads {name: buffer or None}; returns
    Megatron's (output [R, H] in x's dtype, None). names: megamoe's weight names -> the caller's, for the errors."""
    main_grads = {name: buffer for name, buffer in buffers.items() if buffer is not None} or None
    w13, w2 = weights["w13"], weights["w2"]
    with _checks.framework_names(entry, {**_ROW_NAMES, **names}):
        out = grouped_moe(x.to(w13.dtype), tokens_per_expert, w13, w2, probs, recompute=recompute,
                          b13=weights.get("b13"), b2=weights.get("b2"), layout=layout, activation=activation,
                          main_grads=main_grads, precision=precision)  # [R, H]
    return out.to(x.dtype), None


def grouped_mlp(permuted_local_hidden_states, tokens_per_expert, permuted_probs, weight1, weight2, num_local_experts,
                *, gradient_accumulation_fusion=False, activation=None, recompute=False, precision="bf16"):
    """Megatron's legacy GroupedMLP forward on megamoe, its weights read in place.

    permuted_local_hidden_states [R, H] (rows grouped by local expert; rows past sum(tokens_per_expert): padding,
    output 0); tokens_per_expert [E] int32 / int64; permuted_probs [R]; weight1 [H, E*2I] (viewed [E, H, 2I], gate
    columns then up columns per expert); weight2 [E*I, H] (viewed [E, I, H]); num_local_experts E.
    Returns (output [R, H] in x's dtype, None) as Megatron's experts do. gradient_accumulation_fusion, activation
    (megamoe.Activation; None: SwiGLU) and recompute (megamoe's memory mode): see the module docstring. precision:
    megamoe.grouped_moe's ("bf16" or "fp8": blockwise FP8 GEMMs on sm_90 CUDA, SwiGLU; the FP8 copies quantized from
    the transposed weights once per optimizer step by megamoe.fp8's cache).
    """
    entry = "megamoe.adapters.megatron.grouped_mlp"
    _checks.tensor(entry, "weight1", weight1, 2)
    _checks.tensor(entry, "weight2", weight2, 2)
    E, H = num_local_experts, weight1.shape[0]
    if E < 1 or weight1.shape[1] % (2 * E) or weight2.shape[0] % E or weight2.shape[1] != H:
        raise ValueError(f"{entry}: weight1 {tuple(weight1.shape)} / weight2 {tuple(weight2.shape)} are not "
                         f"[H, E*2I] / [E*I, H] for num_local_experts={num_local_experts}")
    I = weight2.shape[0] // E
    w13, buf13 = _fused_view(entry, "weight1", weight1, (E, H, 2 * I), gradient_accumulation_fusion)
    w2, buf2 = _fused_view(entry, "weight2", weight2, (E, I, H), gradient_accumulation_fusion)
    counts, probs = _rows(entry, permuted_local_hidden_states, tokens_per_expert, permuted_probs, E)
    return _run(entry, {"w13": "weight1", "w2": "weight2"}, permuted_local_hidden_states, counts, probs,
                dict(w13=w13, w2=w2), dict(w13=buf13, w2=buf2), HF_TRANSPOSED, activation, recompute, precision)


_warned = set()  # the list arguments whose fallback copy has been warned about (once each)


def _per_expert(entry, name, tensors, per_expert_dims):
    """A list / tuple of per-expert tensors, checked: non-empty, each a tensor of `per_expert_dims` dimensions, all of
    the first one's shape, dtype and device (ValueError naming `name[index]` otherwise)."""
    if not tensors:
        raise ValueError(f"{entry}: {name} is an empty list (one tensor per expert expected)")
    for index, tensor in enumerate(tensors):
        _checks.tensor(entry, f"{name}[{index}]", tensor, per_expert_dims)
        first = tensors[0]
        for what, got, want in (("shape", tuple(tensor.shape), tuple(first.shape)),
                                ("dtype", tensor.dtype, first.dtype), ("device", tensor.device, first.device)):
            if got != want:
                raise ValueError(f"{entry}: {name}[{index}] has {what} {got}, {name}[0] {want} (the experts of a list "
                                 "must agree)")
    return list(tensors)


def _spacing(tensors):
    """How E tensors of one shape and dtype lie in memory: ("ascending" or "descending", step) when they are
    contiguous views of one storage at equally spaced offsets (step elements apart, step >= numel: no overlap), in
    expert order or in reverse; else (None, why)."""
    first = tensors[0]
    if not all(t.is_contiguous() for t in tensors):
        return None, "not contiguous each"
    base = first.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != base for t in tensors):
        return None, "not views of one storage"
    offsets = [t.storage_offset() for t in tensors]  # elements of the tensors' (common) dtype
    step = offsets[1] - offsets[0] if len(tensors) > 1 else first.numel()
    if any(offset - offsets[0] != e * step for e, offset in enumerate(offsets)):
        return None, "not equally spaced in one storage"
    if step >= first.numel():
        return "ascending", step
    if -step >= first.numel():
        return "descending", -step
    return None, "overlapping in one storage"


def _in_place(tensors):
    """(True, None) where `tensors` (E per-expert tensors) are one contiguous [E, ...] block in expert order: the
    only stacked layout megamoe's kernels read without a copy; else (False, why not)."""
    order, step_or_why = _spacing(tensors)
    step, numel = step_or_why, tensors[0].numel()
    if order == "ascending" and step == numel:
        return True, None
    if order == "ascending":
        return False, (f"equally spaced with gaps ({step} elements apart, {numel} each; megamoe's kernels read one "
                       "contiguous [E, ...] block)")
    if order == "descending":
        return False, ("laid out in descending address order (as Megatron DDP's buffers lay out parameters, in "
                       "reverse registration order; a view of them in expert order would need a negative stride)")
    return False, step_or_why


def _block(tensors):
    """The [E, ...] alias of E per-expert tensors that _in_place accepted (no copy)."""
    first = tensors[0]
    return first.as_strided((len(tensors), *first.shape), (first.numel(), *first.stride()), first.storage_offset())


class _ExpertList(torch.autograd.Function):
    """E per-expert parameters as the one [E, ...] tensor megamoe reads: an alias of their common storage where they
    are one contiguous block in expert order (in_place; no copy), else torch.stack (a copy). The backward hands
    each parameter its slice of the gradient (grad.unbind(0): views, no copy); with fused (their gradient added into
    their main_grads by megamoe, so none comes back) it marks those with Megatron DDP's grad_added_to_main_grad and
    returns them a placeholder gradient, as _AddedToMainGrad does for one tensor, and None to the others."""

    @staticmethod
    def forward(ctx, in_place, fused, *params):
        ctx.params = params if fused else None  # leaf Parameters, kept by reference (not saved activations)
        ctx.set_materialize_grads(False)
        if not in_place:
            ctx.aliased = None
            return torch.stack(params)
        # The alias shares params[0]'s version counter only: the others' are checked here in the backward.
        ctx.aliased = [(param, param._version) for param in params[1:]]
        return _block(params)

    @staticmethod
    def backward(ctx, grad):
        for index, (param, version) in enumerate(ctx.aliased or (), start=1):
            if param._version != version:
                raise RuntimeError(f"megamoe.adapters.megatron: expert {index}'s weight of a per-expert list read in "
                                   f"place was modified by an inplace operation between the forward and the backward "
                                   f"(version {param._version}, {version} at the forward)")
        if ctx.params is not None:
            grads = []
            for param in ctx.params:
                if not hasattr(param, "grad_added_to_main_grad"):
                    grads.append(None)
                    continue
                param.grad_added_to_main_grad = True
                make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
                grads.append(make(param.shape, dtype=param.dtype, device=param.device))
        elif grad is None:
            grads = [None] * len(ctx.needs_input_grad[2:])
        else:
            grads = grad.unbind(0)
        return (None, None, *grads)


def _expert_list(entry, name, tensors, fusion):
    """(the [E, ...] tensor megamoe reads for the per-expert list `tensors`, its main_grad buffer or None)."""
    compiling = torch.compiler.is_compiling()
    in_place, why = (False, None) if compiling else _in_place(tensors)
    if not in_place and not compiling and name not in _warned:
        _warned.add(name)
        warnings.warn(f"{entry}: {name} is a list of per-expert tensors {why}: stacking (copying) them on every call; "
                      "megamoe.adapters.megatron.pack_expert_parameters puts them in one buffer read in place "
                      "(warned once per argument)", stacklevel=3)
    wanted = [t.requires_grad for t in tensors]
    if not (fusion and any(wanted)):
        return _ExpertList.apply(in_place, False, *tensors), None
    if not all(wanted):
        raise ValueError(f"{entry}: gradient_accumulation_fusion: {name} mixes experts that require grad and experts "
                         "that do not")
    if compiling:
        raise ValueError(f"{entry}: gradient_accumulation_fusion with {name} as a per-expert list runs eagerly only "
                         "(its main_grads' layout is read from their addresses)")
    buffers = []
    for index, tensor in enumerate(tensors):
        main_grad = getattr(tensor, "main_grad", None)
        if main_grad is None:
            raise ValueError(f"{entry}: gradient_accumulation_fusion needs {name}[{index}].main_grad (an f32 buffer "
                             f"shaped as {name}[{index}]), which is not set")
        if main_grad.shape != tensor.shape or main_grad.dtype != torch.float32 or main_grad.device != tensor.device:
            raise ValueError(f"{entry}: {name}[{index}].main_grad is {main_grad.dtype} {tuple(main_grad.shape)} on "
                             f"{main_grad.device}, not float32 {tuple(tensor.shape)} on {tensor.device}")
        buffers.append(main_grad)
    grads_in_place, why = _in_place(buffers)
    if not grads_in_place:
        raise ValueError(f"{entry}: gradient_accumulation_fusion needs the main_grads of {name}[0 ... "
                         f"{len(tensors) - 1}] as one contiguous f32 block in expert order (megamoe adds into it in "
                         f"place); they are {why}. Call megamoe.adapters.megatron.pack_expert_parameters, or pass "
                         "gradient_accumulation_fusion=False (Megatron DDP's hooks then add each .grad into its "
                         "main_grad)")
    return _ExpertList.apply(in_place, True, *tensors), _block(buffers)


def te_grouped_mlp(permuted_local_hidden_states, tokens_per_expert, permuted_probs, fc1_weight, fc2_weight,
                   fc1_bias=None, fc2_bias=None, *, gradient_accumulation_fusion=False, activation=None,
                   recompute=False, precision="bf16"):
    """Megatron's TEGroupedMLP forward on megamoe.

    fc1_weight [E, 2I, H] (gate rows, then up rows) and fc2_weight [E, H, I]: TE GroupedLinear's single grouped
    weights, read in place; or lists of E per-expert weights [2I, H] / [H, I] (TE's weight0 ... weight{E-1}), read
    in place when they are one contiguous block in expert order, else stacked on each call (a copy, warned once per
    argument; module docstring). fc1_bias [E, 2I] / fc2_bias [E, H] (or per-expert lists) optional. Rows, probs,
    returns and options as grouped_mlp; gradient_accumulation_fusion for a list needs its main_grads in one block.
    precision: megamoe.grouped_moe's ("bf16" or "fp8": blockwise FP8 GEMMs on sm_90 CUDA, without biases; the FP8
    weights from megamoe.fp8's cache, keyed on the weights, so per-expert lists stacked on each call are quantized
    on each call).
    """
    entry = "megamoe.adapters.megatron.te_grouped_mlp"
    params = dict(w13=(fc1_weight, "fc1_weight", 2), w2=(fc2_weight, "fc2_weight", 2),
                  b13=(fc1_bias, "fc1_bias", 1), b2=(fc2_bias, "fc2_bias", 1))
    weights, buffers, experts = {}, {}, None
    for key, (value, name, dims) in params.items():
        if value is None:
            weights[key] = buffers[key] = None
            continue
        if isinstance(value, (list, tuple)):
            tensors = _per_expert(entry, name, value, dims)
            weights[key], buffers[key] = _expert_list(entry, name, tensors, gradient_accumulation_fusion)
        else:
            _checks.tensor(entry, name, value, dims + 1)
            weights[key], buffers[key] = _fused_view(entry, name, value, tuple(value.shape),
                                                     gradient_accumulation_fusion)
        if experts is None:
            experts = (weights[key].shape[0], name)
        elif weights[key].shape[0] != experts[0]:
            raise ValueError(f"{entry}: {name} has {weights[key].shape[0]} experts, {experts[1]} {experts[0]}")
    counts, probs = _rows(entry, permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                          weights["w13"].shape[0])
    return _run(entry, {key: name for key, (_, name, _) in params.items()}, permuted_local_hidden_states, counts,
                probs, weights, buffers, CONCATENATED, activation, recompute, precision)


def _expert_groups(module):
    """(name, list) of each per-expert parameter list of a module and its submodules: each module's own parameters
    named <prefix>0 ... <prefix>{E-1} (TE GroupedLinear's weight0 ..., bias0 ...), E >= 2, in expert order; name is
    the qualified <prefix>{e} (e.g. "fc1.weight{e}")."""
    groups = []
    for path, submodule in module.named_modules():
        by_prefix = {}
        for name, param in submodule.named_parameters(recurse=False):
            match = re.fullmatch(r"(.*?)(\d+)", name)
            if match:
                by_prefix.setdefault(match.group(1), {})[int(match.group(2))] = param
        for prefix, numbered in by_prefix.items():
            if len(numbered) >= 2 and sorted(numbered) == list(range(len(numbered))):
                qualified = f"{path}.{prefix}" if path else prefix
                groups.append((qualified + "{e}", [numbered[e] for e in range(len(numbered))]))
    return groups


def _pack(tensors, set_one):
    """Copy E tensors into one new [E, ...] block (unless they are one already); set_one(e, slice) re-points each."""
    if _in_place(tensors)[0]:
        return _block(tensors)
    with torch.no_grad():
        block = torch.stack([t.detach() for t in tensors])  # one new contiguous buffer, the values copied in once
    for e in range(len(tensors)):
        set_one(e, block[e])
    return block


def pack_expert_parameters(module_or_params, *, main_grad=True):
    """Put per-expert parameters into one [E, ...] buffer per list, once, so te_grouped_mlp reads them in place.

    module_or_params: an nn.Module (every module's own parameters named <prefix>0 ... <prefix>{E-1}, TE
    GroupedLinear's weight0 ... / bias0 ..., are one list each), a list of E parameters, or a list of such lists.
    Each list of the same shape, dtype and device that is not already one contiguous block in expert order is copied
    into a new buffer and each parameter's .data re-pointed at its view of it (the parameters stay the same objects,
    so optimizers and hooks keep them; values unchanged); with main_grad (and every parameter of the list having a
    `main_grad`) the main_grads likewise. Returns the [E, ...] weight buffers, one per list.

    Frameworks that re-home parameters when they wrap the model (Megatron DDP's contiguous param / grad buffers)
    undo a pack done before them: call it after them, or the lists fall back to the per-call copy (which warns).
    Lists those buffers already hold as one block in expert order are left where they are (nothing is copied); a
    descending one (Megatron DDP's reverse registration order) or one with gaps is moved. Moving takes the
    parameters (and main_grads) out of the framework's buffers, which it may read directly (Megatron DDP reduces its
    grad buffer, its distributed optimizer all-gathers into its param buffer): move only where the framework
    follows param.data / param.main_grad; main_grad=False at least leaves every main_grad in DDP's grad buffer (then
    use gradient_accumulation_fusion=False for those lists: DDP's hooks add each .grad into its main_grad).
    """
    entry = "megamoe.adapters.megatron.pack_expert_parameters"
    if isinstance(module_or_params, torch.nn.Module):
        groups = _expert_groups(module_or_params)
    elif isinstance(module_or_params, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in module_or_params):
        groups = [(f"module_or_params[{index}]", list(group)) for index, group in enumerate(module_or_params)]
    elif isinstance(module_or_params, (list, tuple)):
        groups = [("module_or_params", list(module_or_params))]
    else:
        raise TypeError(f"{entry}: module_or_params must be an nn.Module or a list of parameters, got "
                        f"{type(module_or_params).__name__}")
    checked = []  # every list checked before anything moves
    for name, group in groups:
        tensors = _per_expert(entry, name, group, None)
        grads = [getattr(t, "main_grad", None) for t in tensors]
        use_grads = main_grad and all(g is not None for g in grads)
        checked.append((tensors, _per_expert(entry, f"{name} main_grads", grads, None) if use_grads else None))
    blocks = []
    for tensors, grads in checked:
        blocks.append(_pack(tensors, lambda e, view, tensors=tensors: setattr(tensors[e], "data", view)))
        if grads is not None:
            _pack(grads, lambda e, view, tensors=tensors: setattr(tensors[e], "main_grad", view))
    return blocks
