"""Megatron-core-style grouped MLP experts on megamoe: permuted rows, tokens per expert and permuted probs.

Megatron's MoE layer permutes each token's routed copies into rows grouped by local expert and calls its experts
module as `experts(permuted_local_hidden_states [R, H], tokens_per_expert [E], permuted_probs [R]) -> (output [R, H],
None)` (megatron/core/transformer/moe/experts.py); the probs scale each row's activation before fc2, and fc2's bias
too, so out_r = p_r (W2[e] act(W1[e] x_r + b1[e]) + b2[e]): megamoe.grouped_moe with scores = probs. Gated experts
(gated_linear_unit, swiglu): fc1's output is [gate, up] halves (torch.chunk(2)).

Two weight storages, both read in place (no per-step copy):

    grouped_mlp        legacy GroupedMLP (removed from Megatron in #3410; megatron/core/transformer/moe/experts.py
                       before it): weight1 [H, E*2I], weight2 [E*I, H], which its grouped GEMM reads as the views
                       weight1.view(E, H, 2I) and weight2.view(E, I, H): megamoe.HF_TRANSPOSED on those views.
    te_grouped_mlp     TEGroupedMLP with moe_single_grouped_weight (TE GroupedLinear's one `weight` [E, out, in]):
                       fc1 [E, 2I, H], fc2 [E, H, I]: megamoe's default layout; biases [E, 2I], [E, H]
                       (moe_single_grouped_bias). TE's default, one Parameter per expert (weight0 ... weight{E-1},
                       fc1 [2I, H] and fc2 [H, I] each), is accepted as a list and stacked on every call: a copy of
                       the experts' weights per forward (and their gradients flow back through the stack to each
                       weight), because megamoe's C API reads one [E, ...] tensor per weight (TODO(#12): a pointer
                       array per expert).

Gradient accumulation fusion (Megatron's gradient_accumulation_fusion, DDP's fp32 `param.main_grad`):
`gradient_accumulation_fusion=True` adds each weight's (and bias's) gradient into its `main_grad` in megamoe's
weight-gradient epilogue (megamoe's main_grads: `main_grad += grad`, f32, no extra pass) and autograd returns no
gradient for it. Where a parameter has Megatron DDP's `grad_added_to_main_grad` attribute, the backward sets it to
True and hands autograd a placeholder gradient (zeros where `zero_out_wgrad`, else uninitialised), as Megatron's own
fused-wgrad linear layers do, so DDP's per-parameter backward hooks still run (they skip the add for it). Needs the
single-tensor storages (a per-expert list has E separate main_grad buffers: its gradients come back through autograd).

tokens_per_expert may be on the host (Megatron's all-to-all dispatcher keeps it there): it is copied to x's device
(non-blocking); on the device megamoe reads it there (no host sync). Not computed: moe_apply_probs_on_input, GLU
interleaving (moe_mlp_glu_interleave_size), activations other than SwiGLU and gpt-oss's clamped SwiGLU (Megatron's
quick_gelu with activation_func_clamp_value 7 and glu_linear_offset 1: activation=megamoe.clamped_swiglu(7.0, 1.702)).
"""

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


def _run(entry, names, x, tokens_per_expert, probs, weights, buffers, layout, activation, recompute):
    """megamoe.grouped_moe on the weights {name: tensor or None} with main_grads {name: buffer or None}; returns
    Megatron's (output [R, H] in x's dtype, None). names: megamoe's weight names -> the caller's, for the errors."""
    main_grads = {name: buffer for name, buffer in buffers.items() if buffer is not None} or None
    w13, w2 = weights["w13"], weights["w2"]
    with _checks.framework_names(entry, {**_ROW_NAMES, **names}):
        out = grouped_moe(x.to(w13.dtype), tokens_per_expert, w13, w2, probs, recompute=recompute,
                          b13=weights.get("b13"), b2=weights.get("b2"), layout=layout, activation=activation,
                          main_grads=main_grads)  # [R, H]
    return out.to(x.dtype), None


def grouped_mlp(permuted_local_hidden_states, tokens_per_expert, permuted_probs, weight1, weight2, num_local_experts,
                *, gradient_accumulation_fusion=False, activation=None, recompute=False):
    """Megatron's legacy GroupedMLP forward on megamoe, its weights read in place.

    permuted_local_hidden_states [R, H] (rows grouped by local expert; rows past sum(tokens_per_expert): padding,
    output 0); tokens_per_expert [E] int32 / int64; permuted_probs [R]; weight1 [H, E*2I] (viewed [E, H, 2I], gate
    columns then up columns per expert); weight2 [E*I, H] (viewed [E, I, H]); num_local_experts E.
    Returns (output [R, H] in x's dtype, None) as Megatron's experts do. gradient_accumulation_fusion, activation
    (megamoe.Activation; None: SwiGLU) and recompute (megamoe's memory mode): see the module docstring.
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
                dict(w13=w13, w2=w2), dict(w13=buf13, w2=buf2), HF_TRANSPOSED, activation, recompute)


def _stacked(entry, name, value, per_expert_dims):
    """A single grouped tensor as it is, or a list / tuple of per-expert tensors stacked on dim 0 (a copy)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{entry}: {name} is an empty list (one tensor per expert expected)")
        for index, tensor in enumerate(value):
            _checks.tensor(entry, f"{name}[{index}]", tensor, per_expert_dims)
        return torch.stack(list(value)), False
    _checks.tensor(entry, name, value, per_expert_dims + 1)
    return value, True


def te_grouped_mlp(permuted_local_hidden_states, tokens_per_expert, permuted_probs, fc1_weight, fc2_weight,
                   fc1_bias=None, fc2_bias=None, *, gradient_accumulation_fusion=False, activation=None,
                   recompute=False):
    """Megatron's TEGroupedMLP forward on megamoe.

    fc1_weight [E, 2I, H] (gate rows, then up rows) and fc2_weight [E, H, I]: TE GroupedLinear's single grouped
    weights, read in place; or lists of E per-expert weights [2I, H] / [H, I] (TE's weight0 ... weight{E-1}),
    stacked on each call (copied). fc1_bias [E, 2I] / fc2_bias [E, H] (or per-expert lists) optional. Rows, probs,
    returns and options as grouped_mlp; gradient_accumulation_fusion needs the single grouped tensors.
    """
    entry = "megamoe.adapters.megatron.te_grouped_mlp"
    params = dict(w13=(fc1_weight, "fc1_weight", 2), w2=(fc2_weight, "fc2_weight", 2),
                  b13=(fc1_bias, "fc1_bias", 1), b2=(fc2_bias, "fc2_bias", 1))
    weights, buffers = {}, {}
    for key, (value, name, dims) in params.items():
        if value is None:
            weights[key] = buffers[key] = None
            continue
        tensor, in_place = _stacked(entry, name, value, dims)
        if gradient_accumulation_fusion and not in_place:
            raise ValueError(f"{entry}: gradient_accumulation_fusion needs {name} as one grouped tensor (TE's "
                             "moe_single_grouped_weight / _bias); a per-expert list has one main_grad per expert")
        weights[key], buffers[key] = _fused_view(entry, name, tensor, tuple(tensor.shape),
                                                 gradient_accumulation_fusion and in_place)
    counts, probs = _rows(entry, permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                          weights["w13"].shape[0])
    return _run(entry, {key: name for key, (_, name, _) in params.items()}, permuted_local_hidden_states, counts,
                probs, weights, buffers, CONCATENATED, activation, recompute)
