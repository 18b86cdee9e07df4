"""megamoe behind torchtitan's routed experts, switched on in torchtitan's own configuration (torchtitan 0.3).

torchtitan 0.3 builds a model from a tree of configs, and a model-config converter rewrites that tree before the
model is built (torchtitan.protocols.model.ModelConfigConverter; its float8 grouped-experts converter is one). This
module is such a converter, and the matching command-line override:

    from megamoe.adapters.torchtitan_converter import MegamoeConverter
    model_spec = model_registry("30B-A3B", converters=[MegamoeConverter.Config()])        # bf16
    model_spec = model_registry("30B-A3B", converters=[MegamoeConverter.Config(precision="fp8")])

    python -m torchtitan.train --module qwen3 --config qwen3_30b_a3b \\
        --override.imports megamoe.adapters.torchtitan_converter.megamoe_experts          # or ...megamoe_experts_fp8

What it swaps: every RoutedExperts.Config of the tree becomes a MegamoeRoutedExperts.Config, its inner_experts a
MegamoeGroupedExperts.Config (torchtitan's GroupedExperts: Qwen3 MoE, Qwen3.5 MoE, DeepSeek-V3, Kimi) or a
MegamoeGptOssGroupedExperts.Config (gpt-oss: interleaved gate / up, biases, clamped SwiGLU; bf16 only). The modules
subclass torchtitan's own, so the parameters are torchtitan's (w1_EFD / w2_EDF / w3_EFD, or gpt-oss's mlp1_* /
mlp2_*), created, initialised, sharded, checkpointed and converted to Hugging Face exactly as before; only the
forward changes:

- no expert parallelism (torchtitan's local token dispatcher, or its all-to-all dispatcher without an EP mesh):
  dispatch, experts and the score-weighted combine are one megamoe.moe call on the router's top-k ids and scores
  (no sort, no gather copy, no host sync);
- otherwise (an EP mesh, or a dispatcher of its own such as DeepEP / HybridEP / TorchAO's padding one): torchtitan's
  dispatcher sorts and exchanges the tokens and combines them; megamoe.grouped_moe computes the local experts.

As torchtitan's experts do, the computation runs in bf16 (x and the weights cast with .bfloat16(); DTensor weights
read through .to_local()) and returns x's dtype. Refused, with the reason, when converting: a tree without routed
experts, experts of another kind (torchtitan's float8 / MXFP8 / fused-SwiGLU experts, or any unknown subclass), a
precision other than "bf16" / "fp8", "fp8" on gpt-oss's interleaved layout or with dimensions that are not multiples
of 128. gpt-oss experts sharded by tensor parallelism get 1/TP of their down bias on each rank in the forward (the
partial outputs are summed) and its whole gradient, as torchtitan's do.
"""

import logging
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch.distributed.tensor import DTensor

try:
    from torchtitan.config.override import override
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
    from torchtitan.protocols.model import ModelConfigConverter
except ImportError as error:
    raise ImportError("megamoe.adapters.torchtitan_converter is for torchtitan 0.3 (model-config converters); "
                      "torchtitan 0.2 converts built models by name: use megamoe.adapters.torchtitan_module_converter "
                      f"({error})") from error

from ..grouped import grouped_moe
from ..layouts import INTERLEAVED, SEPARATE, clamped_swiglu
from ..ops import moe
from . import _checks

logger = logging.getLogger(__name__)

PRECISIONS = ("bf16", "fp8")
FP8_BLOCK = 128  # the FP8 GEMMs' weight blocks: H and I must be multiples of it
GPT_OSS_ALPHA = 1.702  # torchtitan's gpt-oss SwiGLU slope (its swiglu()'s default; only the limit is configured)


def _local(param):
    """The rank's part of a parameter (torchtitan's experts compute on local tensors), as a plain tensor."""
    return param.to_local() if isinstance(param, DTensor) else param


def _tensor_parallel_degree(param):
    """The size of the "tp" dimension of a DTensor parameter's mesh (1: none, or a plain tensor), as torchtitan's
    gpt-oss experts read it."""
    names = (param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()
    return param.device_mesh.size(names.index("tp")) if "tp" in names else 1


class _DividedInForward(torch.autograd.Function):
    """bias / degree in the forward, the gradient passed back unchanged: under expert TP every rank's partial output
    carries 1/degree of gpt-oss's down bias (they are summed), while each rank's bias gradient is the whole one."""

    @staticmethod
    def forward(ctx, bias, degree):
        return bias / degree

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _dispatches_locally(dispatcher):
    """Whether a dispatcher only reorders this rank's tokens for all experts (no EP exchange, no padding)."""
    if type(dispatcher) is LocalTokenDispatcher:
        return True
    return type(dispatcher) is AllToAllTokenDispatcher and dispatcher.ep_mesh is None


class _MegamoeExperts:
    """The forward of torchtitan's experts on megamoe, shared by both experts kinds: `_megamoe_weights()` gives
    (w13, w2, layout options) in bf16, local to this rank."""

    precision: str
    recompute: bool

    def __init__(self, config):
        """torchtitan's experts built from `config` (the subclass's Config: torchtitan's fields and precision,
        recompute)."""
        super().__init__(config)
        self.precision = config.precision
        self.recompute = config.recompute

    def _call_options(self):
        w13, w2, options = self._megamoe_weights()
        return w13, w2, {**options, "recompute": self.recompute, "precision": self.precision}

    def forward(self, x_RD, num_tokens_per_expert_E):
        """torchtitan's inner-experts call: rows grouped by expert -> their outputs (padding rows past the counts'
        sum: 0)."""
        w13, w2, options = self._call_options()
        with _checks.framework_names(type(self).__name__, {"x_sorted": "x_RD",
                                                           "tokens_per_expert": "num_tokens_per_expert_E"}):
            out = grouped_moe(x_RD.bfloat16(), num_tokens_per_expert_E, w13, w2, **options)
        return self._output(out, x_RD)

    def routed(self, x_TD, topk_scores_TK, topk_expert_ids_TK):
        """Dispatch, experts and combine in one call: y_t = sum_k score[t, k] o_{id[t, k]}(x_t), in x's dtype."""
        w13, w2, options = self._call_options()
        x = x_TD.bfloat16()
        with _checks.framework_names(type(self).__name__, {"topk_ids": "topk_expert_ids",
                                                           "topk_weights": "topk_scores"}):
            y = moe(x, topk_expert_ids_TK, _checks.scores_dtype(topk_scores_TK, x), w13, w2, **options)
        return y.type_as(x_TD)


class MegamoeGroupedExperts(_MegamoeExperts, GroupedExperts):
    """torchtitan's GroupedExperts (w1_EFD [E, F, D] gate, w2_EDF [E, D, F], w3_EFD [E, F, D] up) computed by
    megamoe in place (layout "separate"); returns x's dtype, as torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        precision: Literal["bf16", "fp8"] = "bf16"
        """megamoe's precision: "bf16", or "fp8" (blockwise FP8 GEMMs, DeepSeek-V3's recipe; Hopper)."""

        recompute: bool = False
        """Keep only the inputs for the backward (megamoe's recompute mode) instead of h = [g, u]."""

    def _megamoe_weights(self):
        w1, w2, w3 = (_local(p).bfloat16() for p in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        return w1, w2, {"w3": w3, "layout": SEPARATE}

    def _output(self, out, x):
        return out.type_as(x)


class MegamoeGptOssGroupedExperts(_MegamoeExperts, GptOssGroupedExperts):
    """torchtitan's gpt-oss experts (mlp1_weight_EGD [E, 2F, D] with gate / up rows interleaved, mlp1_bias_EG,
    mlp2_weight_EDF [E, D, F], mlp2_bias_ED; clamped SwiGLU) computed by megamoe in place (layout "interleaved",
    the biases, megamoe.clamped_swiglu(swiglu_limit, 1.702)); returns bf16, as torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(GptOssGroupedExperts.Config):
        precision: Literal["bf16"] = "bf16"
        """Only "bf16": megamoe's FP8 GEMMs do not take the interleaved gate / up layout."""

        recompute: bool = False
        """Keep only the inputs for the backward (megamoe's recompute mode) instead of h = [g, u]."""

    def _megamoe_weights(self):
        w13, b13, w2, b2 = (_local(p).bfloat16() for p in (self.mlp1_weight_EGD, self.mlp1_bias_EG,
                                                            self.mlp2_weight_EDF, self.mlp2_bias_ED))
        tp = _tensor_parallel_degree(self.mlp1_weight_EGD)
        if tp > 1:  # each TP rank's partial output gets 1/tp of the down bias, its gradient whole (as torchtitan)
            b2 = _DividedInForward.apply(b2, tp)
        return w13, w2, {"b13": b13, "b2": b2, "layout": INTERLEAVED,
                         "activation": clamped_swiglu(self.swiglu_limit, GPT_OSS_ALPHA)}

    def _output(self, out, x):
        return out


class MegamoeRoutedExperts(RoutedExperts):
    """torchtitan's RoutedExperts (token_dispatcher + inner_experts) whose inner experts are megamoe's: without
    expert parallelism one megamoe.moe call replaces the dispatch, the experts and the combine; otherwise
    torchtitan's dispatcher runs around megamoe's grouped experts."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        if not _dispatches_locally(self.token_dispatcher):
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        D, K = x_BLD.shape[-1], topk_expert_ids_BLK.shape[-1]
        y_TD = self.inner_experts.routed(x_BLD.reshape(-1, D), topk_scores_BLK.reshape(-1, K),
                                         topk_expert_ids_BLK.reshape(-1, K))
        return y_TD.view(x_BLD.shape[0], -1, D)


_EXPERTS_OF = {  # torchtitan's experts config -> megamoe's (already converted ones convert again: new options)
    GroupedExperts.Config: MegamoeGroupedExperts.Config,
    MegamoeGroupedExperts.Config: MegamoeGroupedExperts.Config,
    GptOssGroupedExperts.Config: MegamoeGptOssGroupedExperts.Config,
    MegamoeGptOssGroupedExperts.Config: MegamoeGptOssGroupedExperts.Config,
}
_ROUTED = (RoutedExperts.Config, MegamoeRoutedExperts.Config)


def _copy_as(config, config_class, **changes):
    """A config_class with every field of `config` (torchtitan's, sharding and initialisation included) and
    `changes`."""
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return config_class(**{**values, **changes})


def check_precision(precision):
    """ValueError unless precision is one of megamoe's ("bf16", "fp8")."""
    if precision not in PRECISIONS:
        raise ValueError(f"megamoe torchtitan converter: precision must be one of {PRECISIONS}, got {precision!r}")


def megamoe_routed_experts_config(routed, *, precision="bf16", recompute=False, fqn=None):
    """The MegamoeRoutedExperts.Config of a torchtitan RoutedExperts.Config (the same fields, the inner experts
    megamoe's); ValueError naming `fqn` and the reason where megamoe cannot stand in for these experts."""
    where = f"{fqn} " if fqn else ""
    check_precision(precision)
    if type(routed) not in _ROUTED:
        raise ValueError(f"megamoe torchtitan converter: {where}is a {type(routed).__qualname__}, not torchtitan's "
                         "RoutedExperts.Config: its forward is its own, so megamoe does not replace it")
    experts = routed.inner_experts
    target = _EXPERTS_OF.get(type(experts))
    if target is None:
        raise ValueError(
            f"megamoe torchtitan converter: {where}inner_experts is a {type(experts).__qualname__}; megamoe stands in "
            "for torchtitan's GroupedExperts (SwiGLU w1 / w2 / w3) and gpt-oss's GptOssGroupedExperts only. Other "
            "experts (torchtitan's float8 / MXFP8 converters, the fused_grouped_experts override, custom ones) "
            "compute their own way: apply megamoe instead of them (precision='fp8' for megamoe's FP8)")
    if precision == "fp8":
        if target is MegamoeGptOssGroupedExperts.Config:
            raise ValueError(f"megamoe torchtitan converter: {where}gpt-oss experts: precision 'fp8' does not take "
                             "their interleaved gate / up layout (megamoe's FP8 GEMMs read gate and up concatenated); "
                             "use precision 'bf16'")
        for name in ("dim", "hidden_dim"):
            if getattr(experts, name) % FP8_BLOCK:
                raise ValueError(f"megamoe torchtitan converter: {where}precision 'fp8' needs {name} a multiple of "
                                 f"{FP8_BLOCK} (the FP8 weight blocks), got {getattr(experts, name)}")
    inner = _copy_as(experts, target, precision=precision, recompute=recompute)
    return _copy_as(routed, MegamoeRoutedExperts.Config, inner_experts=inner)


def convert_model_config(model_config, *, precision="bf16", recompute=False):
    """Every RoutedExperts.Config of a torchtitan model config tree replaced by megamoe's (in place where it is not
    the root); returns the tree. ValueError where the tree has none, or megamoe cannot take one (the reason)."""
    converted = []
    for fqn, routed, parent, attr in model_config.traverse(RoutedExperts.Config):
        replacement = megamoe_routed_experts_config(routed, precision=precision, recompute=recompute, fqn=fqn)
        if parent is None:
            model_config = replacement
        elif isinstance(parent, list):
            parent[attr] = replacement
        else:
            setattr(parent, attr, replacement)
        converted.append(fqn)
    if not converted:
        raise ValueError(f"megamoe torchtitan converter: {type(model_config).__qualname__} has no routed experts "
                         "(torchtitan's RoutedExperts.Config): nothing for megamoe to stand in for")
    logger.info("megamoe: %d routed-experts layers on megamoe (precision %s%s)", len(converted), precision,
                ", recompute" if recompute else "")
    return model_config


class MegamoeConverter(ModelConfigConverter):
    """torchtitan model-config converter: megamoe behind every routed-experts layer (see the module docstring).
    One entry of a config's converters list: MegamoeConverter.Config(precision="bf16" | "fp8", recompute=False)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        precision: Literal["bf16", "fp8"] = "bf16"
        """megamoe's precision: "bf16", or "fp8" (blockwise FP8 GEMMs, DeepSeek-V3's recipe; Hopper)."""

        recompute: bool = False
        """Keep only the inputs for the backward (megamoe's recompute mode) instead of h = [g, u]."""

    def __init__(self, config: Config):
        check_precision(config.precision)
        self.config = config

    def convert(self, model_config):
        return convert_model_config(model_config, precision=self.config.precision, recompute=self.config.recompute)


@override(target=RoutedExperts.Config, description="megamoe behind the routed experts")
def megamoe_experts(config, precision="bf16", recompute=False):
    """--override.imports megamoe.adapters.torchtitan_converter.megamoe_experts (kwargs: precision, recompute)."""
    return megamoe_routed_experts_config(config, precision=precision, recompute=recompute)


@override(target=RoutedExperts.Config, description="megamoe behind the routed experts, blockwise FP8 GEMMs")
def megamoe_experts_fp8(config, recompute=False):
    """--override.imports megamoe.adapters.torchtitan_converter.megamoe_experts_fp8 (kwargs: recompute)."""
    return megamoe_routed_experts_config(config, precision="fp8", recompute=recompute)
