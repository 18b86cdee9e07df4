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

Expert parallelism (transformers' `DistributedConfig(ep_size=...)`, `transformers.distributed.expert_parallel`): the
"grouped_gemm" rule shards the experts' dim 0 and sets `num_experts` to the local count; the "ep_dispatch_experts" rule
brings the experts their tokens through an `EPImplementation`, which calls this experts forward on local ids:
- "all_to_all" (HF's, the training default): local ids only, top-1 rows with unit weights; megamoe computes them.
- "all_reduce" (HF's, inference on a batch the EP group shares): other ranks' slots arrive as the sentinel id
  `num_experts` (the local count) with weight 0; megamoe drops ids >= the local count (`_is_expert_parallel`).
- "megamoe" (registered here, `DistributedConfig(ep_size=P, ep_implementation="megamoe")`): `megamoe.ep.moe` does
  the dispatch and the combine itself on the global ids (one host sync, topk sums in a fixed order, the experts as
  grouped rows), with the experts' local `gate_up_proj` / `down_proj` shards; needs `tp_size == 1`.

transformers stays an optional dependency: `import megamoe` never imports it; only this module does.
"""

import warnings

import torch
from torch import nn

from .ep import moe as ep_moe
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

try:  # transformers >= 5.21: the registry of expert-parallel token dispatchers
    from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface
except ImportError:
    EPImplementation = EPImplementationInterface = None

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


def _check_supported(experts, setting):
    reason = unsupported_reason(experts)
    if reason is not None:
        raise NotImplementedError(
            f"megamoe: {setting} does not support {reason} in {type(experts).__name__}; "
            "use 'grouped_mm' or 'eager' for this model"
        )


def _inputs(hidden_states, top_k_weights, w13):
    """x [T, H] in the weights' dtype (under autocast the activations may be fp32 and the weights bf16) and the
    routing weights [T, topk] in fp32 or that dtype."""
    x = hidden_states.to(w13.dtype)
    weights = top_k_weights if top_k_weights.dtype in (torch.float32, x.dtype) else top_k_weights.float()
    return x, weights


def megamoe_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "megamoe" experts implementation: the signature of transformers' experts forward.

    self: a `@use_experts_implementation` experts module; hidden_states [T, H]; top_k_index [T, topk] int64;
    top_k_weights [T, topk] (after softmax / top-k / renormalisation). Returns [T, H] in hidden_states' dtype.
    """
    _check_supported(self, "experts_implementation='megamoe'")
    w13, w2 = _weights(self)
    x, weights = _inputs(hidden_states, top_k_weights, w13)
    ids = top_k_index  # [T, topk]
    if getattr(self, "_is_expert_parallel", False):
        ids = ids.masked_fill(ids >= w13.shape[0], -1)  # EP sentinels (tokens of other ranks' experts): dropped
    return moe(x, ids, weights, w13, w2).to(hidden_states.dtype)


if EPImplementation is not None:

    class MegamoeEP(EPImplementation):
        """ep_implementation="megamoe": `megamoe.ep.moe` over the EP mesh's group, on the batch this rank holds
        (global expert ids), with the experts' local shards. Every rank holds its own batch (tp_size == 1)."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            if tp_mesh.size() > 1:
                # TODO(#13): slice the batch the TP group shares (as transformers' AllToAllEP does) and gather back.
                raise NotImplementedError("megamoe: ep_implementation='megamoe' needs tp_size == 1 (each rank its own "
                                          "batch); use ep_implementation='all_to_all' with experts_implementation="
                                          "'megamoe' for tp_size > 1")
            self.experts = experts
            self.group = ep_mesh.get_group()
            self.num_experts = experts.num_experts * ep_mesh.size()  # num_experts is already the local count

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            _check_supported(self.experts, "ep_implementation='megamoe'")
            w13, w2 = _weights(self.experts)  # the local shards: transformers runs this under its local parameters
            x, weights = _inputs(hidden_states, top_k_weights, w13)
            y = ep_moe(x, top_k_index, weights, w13, w2, group=self.group, num_experts=self.num_experts)
            return y.to(hidden_states.dtype)


def register():
    """Register "megamoe" in transformers' ExpertsInterface and, where transformers has it, its
    EPImplementationInterface (idempotent). Returns the name to pass as `experts_implementation` (and
    `ep_implementation`)."""
    ExpertsInterface.register(NAME, megamoe_experts_forward)
    if EPImplementationInterface is not None:
        EPImplementationInterface.register(NAME, MegamoeEP)
    return NAME


register()
