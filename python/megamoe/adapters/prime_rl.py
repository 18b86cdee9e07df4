"""prime-rl-style expert compute on megamoe: the experts of rows already grouped by expert, read in place.

prime-rl's trainer dispatches tokens itself and hands an expert backend the grouped rows: `compute(experts, x [R, H],
num_tokens_per_expert [E]) -> [R, H]` (its ExpertCompute protocol: `validate(experts)`, `__call__(experts, x,
num_tokens_per_expert)`, `token_group_alignment`). Rows past the counts' sum are padding (output 0). prime-rl is not
on PyPI; the storages below are read from its source (PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/models/):
layers/expert_compute.py at 49f64076f6341db3ed310fc7e588c9c06ce0562b (GroupedGemmExpertCompute: the attributes it
reads), fusions.py at 2a38c45f778ac02d7a6606931f7ab0f78f93f5ff (fuse_gate_up_projections: gate_up_proj =
cat(gate_proj, up_proj, dim=1), both then None, the biases left split), layers/activations.py at
b6a5b242cc330ce61663cbe53dd708e7e1eab5f5 (Silu, Relu2), and the older layers/moe.py (GroupedExperts w1 / w2 / w3,
GptOssGroupedExperts) at 049a80afebd85a76b61146d6116485c11147e362. The module's storage picks megamoe's layout:

    w1, w3 [E, I, H], w2 [E, H, I]                      GroupedExperts (torchtitan's storage)    -> SEPARATE
    gate_proj, up_proj [E, I, H], down_proj [E, H, I]   separate gate / up                       -> SEPARATE
    gate_up_proj [E, 2I, H], down_proj [E, H, I]        fused, gate rows first (chunk(2))        -> CONCATENATED
    gate_up_proj [E, H, 2I], down_proj [E, I, H]        GptOssGroupedExperts: interleaved, with  -> GPT_OSS, clamped
      + gate_up_proj_bias [E, 2I], down_proj_bias [E, H]  biases (limit 7.0, alpha 1.702)           SwiGLU

Every weight is read where it is (no per-step copy) and gets its gradient shaped as itself. The separate and the
fused gate / up storages take prime-rl's optional biases gate_proj_bias / up_proj_bias [E, I] and down_proj_bias
[E, H] (either one of the [E, I] pair alone too); the [E, I] pair is concatenated into megamoe's b13 [E, 2I] on each
call (a copy of E * 2I elements, differentiable; the weights are not copied). Refused with a ValueError naming the
attribute (by validate, and by every call): an `activation` other than prime-rl's Silu (e.g. Relu2), experts without
a gate (gate_proj None, or NonGatedGroupedExperts' empty w3), a gate_up_proj_bias outside gpt-oss's storage, two
storages at once (e.g. gate_up_proj beside gate_proj), biases beside w1 / w2 / w3, and any other parameter of the
module (or of a submodule) that the call would not read: no parameter is silently left out.

    compute = MegamoeExpertCompute()                 # or megamoe.adapters.prime_rl.expert_compute(experts, x, counts)
    compute.validate(experts)
    out = compute(experts, x_sorted, num_tokens_per_expert)   # [R, H] in x's dtype

Computes in the weights' dtype, or with precision="fp8" (expert_compute, MegamoeExpertCompute) in megamoe's blockwise
FP8 (megamoe.moe's precision; storages without biases and with SwiGLU, on sm_90 CUDA: the others raise megamoe's
NotImplementedError naming what the FP8 kernels do not run). Expert-parallel DTensor weights
(Shard(0)) are read through their local experts (megamoe.grouped_moe). Every storage runs on CPU and CUDA; on CUDA,
the sm_90a kernels on a Hopper GPU (the separate w1 / w3 layout too, read in place; megamoe.grouped_path_of(...).reason
names what would keep a call off them).
"""

from typing import NamedTuple, Optional

import torch

from .._lib import precision_code
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


_BIASES = ("gate_proj_bias", "up_proj_bias", "gate_up_proj_bias", "down_proj_bias")


class _Unsupported(ValueError):
    """A storage megamoe does not compute; `reason` completes "<module class> has ..."."""

    def __init__(self, experts, reason):
        super().__init__(f"megamoe.adapters.prime_rl: {type(experts).__name__} has {reason}")
        self.reason = reason


def _get(experts, name):
    return getattr(experts, name, None)


def _activation_name(experts):
    act = _get(experts, "activation")
    return None if act is None else getattr(act, "__name__", type(act).__name__)


def _refuse_extra(experts, storage, names):
    """Refuse (naming it) the first attribute of `names` set on a module whose `storage` does not read it."""
    extra = [name for name in names if _get(experts, name) is not None]
    if extra:
        raise _Unsupported(experts, f"{extra[0]} beside {storage}, which megamoe would not read (prime-rl's experts "
                                    "never hold both)")


def _gate_up_bias(experts):
    """b13 [E, 2I] (gate, then up) of the split gate_proj_bias / up_proj_bias [E, I], or None without either: a
    differentiable concatenation (E * 2I elements copied per call), zeros standing in for an absent one (prime-rl adds
    each one that is set)."""
    gate_bias, up_bias = _get(experts, "gate_proj_bias"), _get(experts, "up_proj_bias")
    if gate_bias is None and up_bias is None:
        return None
    gate_bias = torch.zeros_like(up_bias) if gate_bias is None else gate_bias
    up_bias = torch.zeros_like(gate_bias) if up_bias is None else up_bias
    return torch.cat([gate_bias, up_bias], dim=1)  # [E, 2I]


def _storage_arguments(experts):
    """ExpertsArguments of the storage the module holds; _Unsupported naming what megamoe would not compute."""
    gate_up, down = _get(experts, "gate_up_proj"), _get(experts, "down_proj")
    if _get(experts, "gate_up_proj_bias") is not None:  # GptOssGroupedExperts: gpt-oss's storage
        gpt_oss_shapes = gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3
        if not (gpt_oss_shapes and gate_up.shape[1] == down.shape[2]):  # H; [E, 2I, H] with [E, H, I]: 2I != I
            raise _Unsupported(experts, "gate_up_proj_bias without gpt-oss's gate_up_proj [E, H, 2I] and down_proj "
                                        "[E, I, H] (only gpt-oss's experts hold a fused gate / up bias)")
        _refuse_extra(experts, "gpt-oss's gate_up_proj_bias", ("w1", "w3", "gate_proj", "up_proj", "gate_proj_bias",
                                                                 "up_proj_bias", "activation"))
        return ExpertsArguments(gate_up, down, None, experts.gate_up_proj_bias, _get(experts, "down_proj_bias"),
                                GPT_OSS, clamped_swiglu(GPT_OSS_LIMIT, GPT_OSS_ALPHA))
    name = _activation_name(experts)
    if name not in (None, "Silu"):
        raise _Unsupported(experts, f"activation {name} (megamoe computes silu(gate) * up, or gpt-oss's clamped "
                                    "SwiGLU)")
    if _get(experts, "w1") is not None:  # GroupedExperts with torchtitan's storage (no biases)
        w3 = _get(experts, "w3")
        if w3 is None or w3.numel() == 0:  # NonGatedGroupedExperts keeps an empty w3
            raise _Unsupported(experts, "no gated up projection (w3 empty: a non-gated MLP)")
        _refuse_extra(experts, "w1 / w2 / w3", ("gate_proj", "up_proj", "gate_up_proj", "down_proj") + _BIASES)
        return ExpertsArguments(experts.w1, experts.w2, w3, None, None, SEPARATE, None)
    if down is None:
        raise _Unsupported(experts, "no w1 / w2 / w3 or down_proj (not a prime-rl experts module)")
    if gate_up is not None:  # gate and up fused by prime-rl's fuse_gate_up_projections: gate rows first
        _refuse_extra(experts, "the fused gate_up_proj", ("gate_proj", "up_proj"))
        return ExpertsArguments(gate_up, down, None, _gate_up_bias(experts), _get(experts, "down_proj_bias"),
                                CONCATENATED, None)
    if _get(experts, "up_proj") is None:
        raise _Unsupported(experts, "no up_proj or gate_up_proj (not a prime-rl experts module)")
    if _get(experts, "gate_proj") is None:
        raise _Unsupported(experts, "no gate projection (gate_proj is None: a non-gated MLP)")
    return ExpertsArguments(experts.gate_proj, down, experts.up_proj, _gate_up_bias(experts),
                            _get(experts, "down_proj_bias"), SEPARATE, None)


# The attributes each storage reads (those set): every parameter of the module must be one of them, or belong to a
# torch parametrization of one (parametrizations.<attribute>.*: read through the attribute, e.g. a LoRA delta).
_READS = {
    GPT_OSS: ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"),
    CONCATENATED: ("gate_up_proj", "down_proj", "gate_proj_bias", "up_proj_bias", "down_proj_bias"),
    SEPARATE: ("w1", "w2", "w3", "gate_proj", "up_proj", "down_proj", "gate_proj_bias", "up_proj_bias",
               "down_proj_bias"),
}


def _refuse_unread_parameters(experts, args):
    """Refuse a module with a parameter (its own or a submodule's) that the call would not read."""
    if not isinstance(experts, torch.nn.Module):
        return
    read = _READS[args.layout]
    for name, _ in experts.named_parameters():
        parts = name.split(".")
        if name in read or (len(parts) > 2 and parts[0] == "parametrizations" and parts[1] in read):
            continue
        raise _Unsupported(experts, f"parameter {name}, which megamoe would not read (it reads "
                                    f"{', '.join(n for n in read if _get(experts, n) is not None)})")


def unsupported_reason(experts):
    """Why megamoe cannot compute this prime-rl experts module, or None if it can."""
    try:
        experts_arguments(experts)
    except _Unsupported as refusal:
        return refusal.reason
    return None


def experts_arguments(experts):
    """ExpertsArguments of a prime-rl experts module (its own Parameters, none copied but the split gate / up
    biases); ValueError naming the attribute for storages megamoe does not compute, and for any parameter of the
    module the call would not read."""
    args = _storage_arguments(experts)
    _refuse_unread_parameters(experts, args)
    return args


def expert_compute(experts, x, num_tokens_per_expert, recompute=False, precision="bf16"):
    """prime-rl's expert compute on megamoe: x [R, H] grouped by expert, num_tokens_per_expert [E] on x's device
    (int32 / int64; rows past its sum: padding, output 0) -> [R, H] in x's dtype (see the module docstring).
    precision: megamoe.grouped_moe's ("bf16" or "fp8")."""
    entry = "megamoe.adapters.prime_rl.expert_compute"
    args = experts_arguments(experts)
    _checks.tensor(entry, "x", x, 2)
    _checks.counts(entry, "num_tokens_per_expert", num_tokens_per_expert, args.w2.shape[0])
    with _checks.framework_names(entry, {"x_sorted": "x", "tokens_per_expert": "num_tokens_per_expert"}):
        out = grouped_moe(x.to(args.w13.dtype), num_tokens_per_expert, args.w13, args.w2, recompute=recompute,
                          w3=args.w3, b13=args.b13, b2=args.b2, layout=args.layout,
                          activation=args.activation, precision=precision)  # [R, H]
    return out.to(x.dtype)


class MegamoeExpertCompute:
    """prime-rl's ExpertCompute protocol on megamoe. token_group_alignment 1: megamoe needs no per-expert padding
    (padding rows past the counts' sum are allowed and come out 0)."""

    token_group_alignment = 1

    def __init__(self, recompute=False, precision="bf16"):
        precision_code(precision)  # ValueError naming `precision` for an unknown one
        self.recompute = recompute
        self.precision = precision

    def validate(self, experts):
        """ValueError naming what megamoe cannot compute in `experts` (see unsupported_reason)."""
        experts_arguments(experts)

    def __call__(self, experts, x, num_tokens_per_expert):
        return expert_compute(experts, x, num_tokens_per_expert, recompute=self.recompute, precision=self.precision)
