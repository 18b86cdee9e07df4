"""Hugging Face transformers (5.x) integration: megamoe as an experts implementation.

transformers 5.x runs the experts modules of its MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek, ...)
through `transformers.integrations.moe.ExpertsInterface`, chosen per model by `experts_implementation`
("eager", "batched_mm", "grouped_mm", ...). Importing this module registers "megamoe" there:

    import megamoe.hf                      # registers "megamoe" (megamoe.hf.register() does the same)
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="megamoe")   # or from_config
    model.set_experts_implementation("megamoe")                                           # switch a live model

The experts keep their own parameters: `gate_up_proj` [E, 2I, H] (gate rows first) is megamoe's `w13` and
`down_proj` [E, H, I] its `w2`, passed to `megamoe.moe` as they are, so nothing is copied. Experts stored
transposed (`is_transposed=True`, e.g. Aria) are copied into that layout on every forward, with a one-time
warning. Experts megamoe cannot compute (biases, no gate, interleaved gate/up, a custom gate or activation
other than SiLU, a post-expert norm) raise NotImplementedError naming the reason.

transformers stays an optional dependency: `import megamoe` never imports it; only this module does.
"""

import warnings

import torch
from torch import nn

from .ops import moe

try:
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import ExpertsInterface
except ImportError as error:
    raise ImportError(
        "megamoe.hf needs Hugging Face transformers 5.x (its ExpertsInterface): "
        "pip install 'transformers>=5,<6' (or pip install 'megamoe[hf]')"
    ) from error

try:  # private in transformers: the gate every plain SwiGLU experts module uses
    from transformers.integrations.moe import _default_apply_gate
except ImportError:
    _default_apply_gate = None

NAME = "megamoe"

_warned_transposed = set()


def unsupported_reason(experts):
    """Why megamoe cannot compute this transformers experts module, or None if it can.

    megamoe computes y_t = sum_j s_tj W2[e] (silu(W13[e, :I] x_t) * W13[e, I:] x_t): gated SiLU experts,
    gate rows before up rows, no biases, nothing applied to an expert's output but its routing weight.
    """
    if not getattr(experts, "has_gate", True):
        return "experts without a gate projection (has_gate=False)"
    if getattr(experts, "has_bias", False):
        return "expert biases (has_bias=True)"
    if not getattr(experts, "is_concatenated", True):
        return "interleaved gate/up rows (is_concatenated=False)"
    if getattr(experts, "has_post_expert_norm", False):
        return "a norm after each expert (has_post_expert_norm=True)"
    gate = getattr(type(experts), "_apply_gate", _default_apply_gate)
    if _default_apply_gate is not None and gate is not _default_apply_gate:
        return f"a custom gate ({type(experts).__name__}._apply_gate)"
    act = getattr(experts, "act_fn", None)
    if not isinstance(act, (SiLUActivation, nn.SiLU)):
        return f"activation {type(act).__name__} (megamoe computes silu(gate) * up)"
    return None


def _weights(experts):
    """(w13 [E, 2I, H], w2 [E, H, I]) of a transformers experts module: its own Parameters when they are stored
    that way (no copy), else contiguous copies of the transposed storage (autograd flows back through them)."""
    w13, w2 = experts.gate_up_proj, experts.down_proj
    if not getattr(experts, "is_transposed", False):
        return w13, w2
    name = type(experts).__name__
    if name not in _warned_transposed:
        _warned_transposed.add(name)
        warnings.warn(
            f"megamoe: {name} stores its experts transposed ([E, H, 2I] / [E, I, H]); megamoe copies them to "
            "[E, 2I, H] / [E, H, I] on every forward (store them untransposed to avoid the copies)"
        )
    return w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()


def megamoe_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "megamoe" experts implementation: the signature of transformers' experts forward.

    self: a `@use_experts_implementation` experts module; hidden_states [T, H]; top_k_index [T, topk] int64;
    top_k_weights [T, topk] (after softmax / top-k / renormalisation). Returns [T, H] in hidden_states' dtype.
    """
    reason = unsupported_reason(self)
    if reason is not None:
        raise NotImplementedError(
            f"megamoe: experts_implementation='megamoe' does not support {reason} in {type(self).__name__}; "
            "use 'grouped_mm' or 'eager' for this model"
        )
    w13, w2 = _weights(self)
    x = hidden_states.to(w13.dtype)  # [T, H]; under autocast the activations may be fp32 and the weights bf16
    ids = top_k_index  # [T, topk]
    if getattr(self, "_is_expert_parallel", False):
        ids = ids.masked_fill(ids >= w13.shape[0], -1)  # EP sentinels (tokens of other ranks' experts): dropped
    weights = top_k_weights  # [T, topk]
    if weights.dtype not in (torch.float32, x.dtype):
        weights = weights.float()
    return moe(x, ids, weights, w13, w2).to(hidden_states.dtype)


def register():
    """Register "megamoe" in transformers' ExpertsInterface (idempotent). Returns the name to pass as
    `experts_implementation`."""
    ExpertsInterface.register(NAME, megamoe_experts_forward)
    return NAME


register()
