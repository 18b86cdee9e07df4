"""prime-rl-style expert compute on megamoe: the experts of rows already grouped by expert, read in place.

prime-rl's trainer (prime_rl/trainer/models/layers/moe.py, expert_compute.py) dispatches tokens itself and hands an
expert backend the grouped rows: `compute(experts, x [R, H], num_tokens_per_expert [E]) -> [R, H]` (its ExpertCompute
protocol: `validate(experts)`, `__call__(experts, x, num_tokens_per_expert)`, `token_group_alignment`). Rows past
the counts' sum are padding (output 0). The experts module's storage, as prime-rl keeps it, picks megamoe's layout:

    w1, w3 [E, I, H], w2 [E, H, I]                      GroupedExperts (torchtitan's storage)    -> SEPARATE
    gate_proj, up_proj [E, I, H], down_proj [E, H, I]   separate gate / up                       -> SEPARATE
    gate_up_proj [E, 2I, H], down_proj [E, H, I]        fused, gate rows first (chunk(2))        -> CONCATENATED
    gate_up_proj [E, H, 2I], down_proj [E, I, H]        GptOssGroupedExperts: interleaved, with  -> GPT_OSS, clamped
      + gate_up_proj_bias [E, 2I], down_proj_bias [E, H]  biases (limit 7.0, alpha 1.702)           SwiGLU

Every weight is read where it is (no per-step copy) and gets its gradient shaped as itself. Optional biases
gate_proj_bias / up_proj_bias [E, I] and down_proj_bias [E, H] are supported; the two [E, I] biases are concatenated
into megamoe's b13 [E, 2I] on each call (a copy of E * 2I elements, differentiable; the weights are not copied).
An `activation` attribute other than prime-rl's Silu (e.g. Relu2, a clamped SwiGLU of another form) and experts
without a gate (gate_proj None) are refused by validate with a ValueError naming them.

    compute = MegamoeExpertCompute()                 # or megamoe.adapters.prime_rl.expert_compute(experts, x, counts)
    compute.validate(experts)
    out = compute(experts, x_sorted, num_tokens_per_expert)   # [R, H] in x's dtype

Computes in the weights' dtype. Expert-parallel DTensor weights (Shard(0)) are read through their local experts
(megamoe.grouped_moe). Every storage runs on CPU and CUDA; on CUDA, the sm_90a kernels on a Hopper GPU (the separate
w1 / w3 layout too, read in place; megamoe.grouped_path_of(...).reason names what would keep a call off them).
"""

from typing import NamedTuple, Optional

import torch

from ..grouped import grouped_moe
from ..layouts import CONCATENATED, GPT_OSS, SEPARATE, Activation, Layout, clamped_swiglu
from . import _checks

GPT_OSS_LIMIT, GPT_OSS_ALPHA = 7.0, 1.702  # prime-rl's gpt-oss activation constants


class ExpertsArguments(NamedTuple):
    """What megamoe.grouped_moe takes for a prime-rl experts module (its own tensors)."""

    w13: torch.Tensor  # [E, 2I, H], [E, H, 2I] (GPT_OSS) or the gate [E, I, H] (SEPARATE)
    w2: torch.Tensor  # [E, H, I] or [E, I, H] (GPT_OSS)
    w3: Optional[torch.Tensor]  # the up projection [E, I, H] (SEPARATE) or None
    b13: Optional[torch.Tensor]  # [E, 2I] or None
    b2: Optional[torch.Tensor]  # [E, H] or None
    layout: Layout
    activation: Optional[Activation]


def _get(experts, name):
    return getattr(experts, name, None)


def _activation_name(experts):
    act = _get(experts, "activation")
    return None if act is None else getattr(act, "__name__", type(act).__name__)


def unsupported_reason(experts):
    """Why megamoe cannot compute this prime-rl experts module, or None if it can."""
    if _get(experts, "w1") is not None:
        w3 = _get(experts, "w3")
        if w3 is None or w3.numel() == 0:  # NonGatedGroupedExperts keeps an empty w3
            return "experts without a gated up projection (w3 empty: a non-gated MLP)"
        return None
    if _get(experts, "down_proj") is None:
        return "experts without w1 / w2 / w3 or down_proj (not a prime-rl experts module)"
    if _get(experts, "gate_up_proj") is None and (_get(experts, "gate_proj") is None or _get(experts, "up_proj") is None):
        return "experts without a gate projection (gate_proj is None)"
    name = _activation_name(experts)
    if name not in (None, "Silu"):
        return f"activation {name} (megamoe computes silu(gate) * up, or gpt-oss's clamped SwiGLU)"
    return None


def experts_arguments(experts):
    """ExpertsArguments of a prime-rl experts module (its own Parameters, none copied but the split gate / up
    biases); ValueError naming the reason for modules megamoe cannot compute."""
    reason = unsupported_reason(experts)
    if reason is not None:
        raise ValueError(f"megamoe.adapters.prime_rl: {type(experts).__name__} has {reason}")
    if _get(experts, "w1") is not None:
        return ExpertsArguments(experts.w1, experts.w2, experts.w3, None, None, SEPARATE, None)
    down, down_bias = experts.down_proj, _get(experts, "down_proj_bias")
    if _get(experts, "gate_up_proj_bias") is not None:  # GptOssGroupedExperts: gpt-oss's storage
        return ExpertsArguments(experts.gate_up_proj, down, None, experts.gate_up_proj_bias, down_bias, GPT_OSS,
                                clamped_swiglu(GPT_OSS_LIMIT, GPT_OSS_ALPHA))
    if _get(experts, "gate_up_proj") is not None:
        return ExpertsArguments(experts.gate_up_proj, down, None, None, down_bias, CONCATENATED, None)
    gate_bias, up_bias = _get(experts, "gate_proj_bias"), _get(experts, "up_proj_bias")
    if (gate_bias is None) != (up_bias is None):
        present = "gate_proj_bias" if up_bias is None else "up_proj_bias"
        raise ValueError(f"megamoe.adapters.prime_rl: {type(experts).__name__} has {present} but not the other; "
                         "megamoe takes both gate and up biases or neither")
    b13 = None if gate_bias is None else torch.cat([gate_bias, up_bias], dim=1)  # [E, 2I]: a copy, differentiable
    return ExpertsArguments(experts.gate_proj, down, experts.up_proj, b13, down_bias, SEPARATE, None)


def expert_compute(experts, x, num_tokens_per_expert, recompute=False):
    """prime-rl's expert compute on megamoe: x [R, H] grouped by expert, num_tokens_per_expert [E] on x's device
    (int32 / int64; rows past its sum: padding, output 0) -> [R, H] in x's dtype (see the module docstring)."""
    entry = "megamoe.adapters.prime_rl.expert_compute"
    args = experts_arguments(experts)
    _checks.tensor(entry, "x", x, 2)
    _checks.counts(entry, "num_tokens_per_expert", num_tokens_per_expert, args.w2.shape[0])
    with _checks.framework_names(entry, {"x_sorted": "x", "tokens_per_expert": "num_tokens_per_expert"}):
        out = grouped_moe(x.to(args.w13.dtype), num_tokens_per_expert, args.w13, args.w2, recompute=recompute,
                          w3=args.w3, b13=args.b13, b2=args.b2, layout=args.layout,
                          activation=args.activation)  # [R, H]
    return out.to(x.dtype)


class MegamoeExpertCompute:
    """prime-rl's ExpertCompute protocol on megamoe. token_group_alignment 1: megamoe needs no per-expert padding
    (padding rows past the counts' sum are allowed and come out 0)."""

    token_group_alignment = 1

    def __init__(self, recompute=False):
        self.recompute = recompute

    def validate(self, experts):
        """ValueError naming what megamoe cannot compute in `experts` (see unsupported_reason)."""
        experts_arguments(experts)

    def __call__(self, experts, x, num_tokens_per_expert):
        return expert_compute(experts, x, num_tokens_per_expert, recompute=self.recompute)
