"""Hugging Face transformers (5.x) integration: megamoe as an experts implementation (megamoe.adapters.hf, also
importable as megamoe.hf: the same module).

transformers 5.x runs the experts modules of its MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek, ...)
through `transformers.integrations.moe.ExpertsInterface`, chosen per model by `experts_implementation`
("eager", "batched_mm", "grouped_mm", ...). Importing this module registers "megamoe" there:

    import megamoe.hf                      # registers "megamoe" (megamoe.hf.register() does the same)
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="megamoe")   # or from_config
    model.set_experts_implementation("megamoe")                                           # switch a live model
    model.set_experts_implementation("megamoe-fp8")   # the same in blockwise FP8 (Hopper; megamoe.moe precision="fp8")

The experts keep their own parameters, read where they are as transformers' flags say they are stored (no copy;
the gradients come back in that layout):
- `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I] (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3,
  ...): megamoe's default layout;
- `is_transposed=True` ([E, H, 2I] / [E, I, H], e.g. Aria): megamoe.HF_TRANSPOSED;
- `has_bias=True`: `gate_up_proj_bias` [E, 2I] (arranged as gate_up_proj) and `down_proj_bias` [E, H] as b13, b2;
- gpt-oss's `GptOssExperts` (interleaved, transposed, biased; its `_apply_gate` is the clamped SwiGLU
  min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1) with the module's `limit` / `alpha`,
  7.0 / 1.702): megamoe.GPT_OSS with megamoe.clamped_swiglu(limit, alpha); the same gate on concatenated experts
  (OpenAIPrivacyFilterExperts) likewise.
The gate / up arrangement is the gate's (transformers' default gate splits by chunk: concatenated); an
`is_concatenated` flag that disagrees with it is refused. Experts megamoe cannot compute (no gate, a custom gate or an
activation other than SiLU, a post-expert norm, that disagreement) raise NotImplementedError naming the reason. Every
layout, the biases and the clamped SwiGLU run on CPU and CUDA tensors alike (on CUDA every option on the fused sm_90a
kernels on a Hopper GPU); a NotImplementedError of
megamoe's is re-raised here naming the experts module, never turned into a silent per-step copy.

Expert parallelism (transformers' `DistributedConfig(ep_size=...)`, `transformers.distributed.expert_parallel`): the
"grouped_gemm" rule shards the experts' dim 0 and sets `num_experts` to the local count; the "ep_dispatch_experts" rule
brings the experts their tokens through an `EPImplementation`, which calls this experts forward on local ids:
- "all_to_all" (HF's, the training default): local ids only, top-1 rows with unit weights; megamoe computes them.
- "all_reduce" (HF's, inference on a batch the EP group shares): other ranks' slots arrive as the sentinel id
  `num_experts` (the local count) with weight 0; megamoe drops ids >= the local count (`_is_expert_parallel`).
- "megamoe" (registered here, `DistributedConfig(ep_size=P, ep_implementation="megamoe")`): `megamoe.ep.moe` does
  the dispatch and the combine itself on the global ids (one host sync, topk sums in a fixed order, the experts as
  grouped rows), with the experts' local `gate_up_proj` / `down_proj` shards; needs `tp_size == 1` and the default
  layout (megamoe.ep.moe takes no other layout yet: NotImplementedError naming it).

transformers stays an optional dependency: `import megamoe` never imports it; only this module does.
"""

from typing import NamedTuple, Optional

import torch
from torch import nn

from ..ep import moe as ep_moe
from ..layouts import SWIGLU, Activation, Layout, clamped_swiglu
from ..ops import moe

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
NAME_FP8 = "megamoe-fp8"  # the same with precision="fp8" (DESIGN §7): the FP8 weights cached per optimizer step

# transformers' experts gates that are gpt-oss's clamped SwiGLU on the module's `limit` and `alpha`, by the defining
# module and qualified name (not imported: a model's modeling file is loaded only when the model is used), with the
# gate / up arrangement each one splits gate_up_proj's output by
CLAMPED_SWIGLU_GATES = {
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts._apply_gate"): "interleaved",
    ("transformers.models.openai_privacy_filter.modeling_openai_privacy_filter",
     "OpenAIPrivacyFilterExperts._apply_gate"): "concatenated",
}


class ExpertsArguments(NamedTuple):
    """What megamoe.moe takes for a transformers experts module: its own tensors and how they are stored."""

    w13: torch.Tensor  # gate_up_proj: [E, 2I, H], or [E, H, 2I] transposed
    w2: torch.Tensor  # down_proj: [E, H, I], or [E, I, H] transposed
    b13: Optional[torch.Tensor]  # gate_up_proj_bias [E, 2I] or None
    b2: Optional[torch.Tensor]  # down_proj_bias [E, H] or None
    layout: Layout
    activation: Activation


def _gate(experts):
    """(activation kind, gate / up arrangement) of the experts' gate: transformers' default gate splits by chunk
    (concatenated) into silu(gate) * up; None for a gate megamoe does not know."""
    return _gate_of_class(type(experts))


@torch.compiler.assume_constant_result  # a property of the class: torch.compile (2.11) cannot trace __qualname__
def _gate_of_class(cls):
    gate = getattr(cls, "_apply_gate", _default_apply_gate)
    if _default_apply_gate is not None and gate is _default_apply_gate:
        return "swiglu", "concatenated"
    arrangement = CLAMPED_SWIGLU_GATES.get((getattr(gate, "__module__", None), getattr(gate, "__qualname__", None)))
    return None if arrangement is None else ("clamped_swiglu", arrangement)


def unsupported_reason(experts):
    """Why megamoe cannot compute this transformers experts module, or None if it can.

    megamoe computes y_t = sum_j s_tj (W2[e] act(W13[e] x_t + b13[e]) + b2[e]) with act silu(g) * u or gpt-oss's
    clamped SwiGLU: gated experts, nothing applied to an expert's output but its routing weight.
    """
    if not getattr(experts, "has_gate", True):
        return "experts without a gate projection (has_gate=False)"
    if getattr(experts, "has_post_expert_norm", False):
        return "a norm after each expert (has_post_expert_norm=True)"
    gate = _gate(experts)
    if gate is None:
        return f"a custom gate ({type(experts).__name__}._apply_gate)"
    kind, arrangement = gate
    flagged = "concatenated" if getattr(experts, "is_concatenated", True) else "interleaved"
    if flagged != arrangement:
        return (f"is_concatenated={flagged == 'concatenated'} while its gate splits gate and up as {arrangement} rows "
                "(the gate defines what eager computes)")
    if kind == "swiglu":
        act = getattr(experts, "act_fn", None)
        if not isinstance(act, (SiLUActivation, nn.SiLU)):
            return f"activation {type(act).__name__} (megamoe computes silu(gate) * up)"
    return None


def experts_arguments(experts):
    """ExpertsArguments of a transformers experts module megamoe can compute (unsupported_reason None): its own
    Parameters (none copied) and their layout."""
    kind, arrangement = _gate(experts)
    transposed = bool(getattr(experts, "is_transposed", False))
    layout = Layout(arrangement, transposed, transposed)
    activation = clamped_swiglu(limit=experts.limit, alpha=experts.alpha) if kind == "clamped_swiglu" else SWIGLU
    has_bias = getattr(experts, "has_bias", False)
    b13 = experts.gate_up_proj_bias if has_bias else None
    b2 = experts.down_proj_bias if has_bias else None
    return ExpertsArguments(experts.gate_up_proj, experts.down_proj, b13, b2, layout, activation)


def _is_default(args):
    return args.layout == Layout() and args.activation == SWIGLU and args.b13 is None and args.b2 is None


def _describe(args):
    """The non-default options of ExpertsArguments, for messages: 'layout interleaved, transposed; biases'."""
    parts = []
    if args.layout != Layout():
        parts.append(f"layout {args.layout.gate_up}" + (", transposed" if args.layout.w13_transposed else ""))
    if args.b13 is not None or args.b2 is not None:
        parts.append("biases")
    if args.activation != SWIGLU:
        parts.append(f"activation {args.activation.kind} (limit {args.activation.limit}, alpha {args.activation.alpha})")
    return "; ".join(parts)


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


def _run(experts, setting, x, ids, weights, args, precision="bf16"):
    """megamoe.moe on the experts' own tensors; a NotImplementedError of megamoe's CUDA path (an option it cannot run
    yet) re-raised naming the experts module and its storage."""
    try:
        return moe(x, ids, weights, args.w13, args.w2, b13=args.b13, b2=args.b2, layout=args.layout,
                   activation=args.activation, precision=precision)
    except NotImplementedError as error:
        raise NotImplementedError(
            f"megamoe: {setting}: {type(experts).__name__} stores its experts as {_describe(args) or 'the default'}, "
            f"which megamoe cannot run on {x.device.type} tensors yet ({error}); use 'grouped_mm' or 'eager' there"
        ) from error


def megamoe_experts_forward(self, hidden_states, top_k_index, top_k_weights, precision="bf16"):
    """The "megamoe" experts implementation: the signature of transformers' experts forward.

    self: a `@use_experts_implementation` experts module; hidden_states [T, H]; top_k_index [T, topk] int64;
    top_k_weights [T, topk] (after softmax / top-k / renormalisation). Returns [T, H] in hidden_states' dtype.
    """
    setting = f"experts_implementation='{NAME if precision == 'bf16' else NAME_FP8}'"
    _check_supported(self, setting)
    args = experts_arguments(self)
    x, weights = _inputs(hidden_states, top_k_weights, args.w13)
    ids = top_k_index  # [T, topk]
    if getattr(self, "_is_expert_parallel", False):
        ids = ids.masked_fill(ids >= args.w13.shape[0], -1)  # EP sentinels (tokens of other ranks' experts): dropped
    return _run(self, setting, x, ids, weights, args, precision).to(hidden_states.dtype)


def megamoe_fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "megamoe-fp8" experts implementation: "megamoe" with precision="fp8" (blockwise FP8 GEMMs on Hopper; the
    weights' FP8 copies made once per optimizer step by megamoe.fp8's cache). Experts or devices the FP8 kernels cannot
    run raise NotImplementedError naming why."""
    return megamoe_experts_forward(self, hidden_states, top_k_index, top_k_weights, precision="fp8")


if EPImplementation is not None:

    class MegamoeEP(EPImplementation):
        """ep_implementation="megamoe": `megamoe.ep.moe` over the EP mesh's group, on the batch this rank holds
        (global expert ids), with the experts' local shards. Every rank holds its own batch (tp_size == 1)."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            if tp_mesh.size() > 1:
                # TODO: slice the batch the TP group shares (as transformers' AllToAllEP does) and gather back.
                raise NotImplementedError("megamoe: ep_implementation='megamoe' needs tp_size == 1 (each rank its own "
                                          "batch); use ep_implementation='all_to_all' with experts_implementation="
                                          "'megamoe' for tp_size > 1")
            self.experts = experts
            self.group = ep_mesh.get_group()
            self.num_experts = experts.num_experts * ep_mesh.size()  # num_experts is already the local count

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            setting = "ep_implementation='megamoe'"
            _check_supported(self.experts, setting)
            args = experts_arguments(self.experts)  # the local shards: transformers runs this under them
            if not _is_default(args):
                # TODO: layouts, biases and activations in megamoe.ep.moe.
                raise NotImplementedError(f"megamoe: {setting} runs experts in megamoe's default layout only; "
                                          f"{type(self.experts).__name__} has {_describe(args)} (use "
                                          "ep_implementation='all_to_all' with experts_implementation='megamoe')")
            x, weights = _inputs(hidden_states, top_k_weights, args.w13)
            y = ep_moe(x, top_k_index, weights, args.w13, args.w2, group=self.group, num_experts=self.num_experts)
            return y.to(hidden_states.dtype)


def register():
    """Register "megamoe" in transformers' ExpertsInterface and, where transformers has it, its
    EPImplementationInterface (idempotent). Returns the name to pass as `experts_implementation` (and
    `ep_implementation`)."""
    ExpertsInterface.register(NAME, megamoe_experts_forward)
    ExpertsInterface.register(NAME_FP8, megamoe_fp8_experts_forward)
    if EPImplementationInterface is not None:
        EPImplementationInterface.register(NAME, MegamoeEP)
    return NAME


register()
