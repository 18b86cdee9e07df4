"""megamoe behind torchtitan 0.2's MoE layers, as one of its model converters (torchtitan 0.2.x).

torchtitan 0.2 converts a built model in place with the converters named in its job config
(torchtitan.protocols.model_converter: `--model.converters NAME`, registered with register_model_converter); it
imports a module of the user's with `--experimental.custom_import`. Importing this module registers two:

    --experimental.custom_import megamoe.adapters.torchtitan_module_converter --model.converters megamoe
    ...                                                                        --model.converters megamoe.fp8

(torchtitan 0.3 rewrites model configs instead: megamoe.adapters.torchtitan_converter.)

What it swaps: every torchtitan 0.2 MoE (Qwen3 MoE, DeepSeek-V3, Llama 4) becomes a MegamoeMoE and its experts a
MegamoeGroupedExperts, by class (the modules keep their parameters w1 / w2 / w3, buffers, hooks and names: state
dicts and checkpoints are unchanged). Where the layer's experts are its own (no expert-parallel or FSDP hooks on them,
weights not sharded over experts or their hidden dimension) and the scores multiply the experts' outputs
(score_before_experts False: Qwen3, DeepSeek-V3), the routed experts are one megamoe.moe call on the router's top-k
ids and scores (no sort, no gather, no padding); otherwise torchtitan's reordering, expert-parallel exchange and
combine run around megamoe.grouped_moe. The computation runs in bf16 (x and the weights cast with .bfloat16(), as
torchtitan's grouped-mm experts do) and returns x's dtype. Refused, with the reason: a model without torchtitan's MoE
layers, other MoE kinds (gpt-oss's, DeepEP's), "megamoe.fp8" with dimensions that are not multiples of 128.
"""

import logging

import torch
from torch.distributed.tensor import DTensor

try:
    from torchtitan.models.moe.moe import GroupedExperts, MoE
    from torchtitan.protocols.model_converter import register_model_converter
except ImportError as error:
    raise ImportError("megamoe.adapters.torchtitan_module_converter is for torchtitan 0.2 (model converters by name, "
                      "torchtitan.models.moe); torchtitan 0.3 converts model configs: use "
                      f"megamoe.adapters.torchtitan_converter ({error})") from error

from ..grouped import grouped_moe
from ..layouts import SEPARATE
from ..ops import moe
from . import _checks

logger = logging.getLogger(__name__)

FP8_BLOCK = 128


def _local(param):
    return param.to_local() if isinstance(param, DTensor) else param


def _sharded(param):
    """A DTensor sharded on some mesh dimension (expert or tensor parallel: its local tensor is a part)."""
    return isinstance(param, DTensor) and any(not placement.is_replicate() for placement in param.placements)


class MegamoeGroupedExperts(GroupedExperts):
    """torchtitan 0.2's GroupedExperts (w1 [E, I, H] gate, w2 [E, H, I], w3 [E, I, H] up) computed by megamoe in place
    (layout "separate"). Made by class swap (MegamoeModelConverter); `precision` and `recompute` set on the module."""

    precision = "bf16"
    recompute = False

    def _weights(self):
        return tuple(_local(p).bfloat16() for p in (self.w1, self.w2, self.w3))

    def forward(self, x, num_tokens_per_expert):
        w1, w2, w3 = self._weights()
        with _checks.framework_names(type(self).__name__, {"x_sorted": "x",
                                                           "tokens_per_expert": "num_tokens_per_expert"}):
            out = grouped_moe(x.bfloat16(), num_tokens_per_expert, w1, w2, w3=w3, layout=SEPARATE,
                              recompute=self.recompute, precision=self.precision)
        return out.type_as(x)

    def routed(self, x, top_scores, selected_experts_indices):
        """The routed experts of tokens x [T, H] (dispatch, experts, score-weighted combine) in one call."""
        w1, w2, w3 = self._weights()
        x_in = x.bfloat16()
        with _checks.framework_names(type(self).__name__, {"topk_ids": "selected_experts_indices",
                                                           "topk_weights": "top_scores"}):
            y = moe(x_in, selected_experts_indices, _checks.scores_dtype(top_scores, x_in), w1, w2, w3=w3,
                    layout=SEPARATE, recompute=self.recompute, precision=self.precision)
        return y.type_as(x)


class MegamoeMoE(MoE):
    """torchtitan 0.2's MoE whose routed experts are megamoe's (see the module docstring for the two paths)."""

    def _whole_layer(self):
        experts = self.experts
        if self.score_before_experts or experts._forward_pre_hooks or experts._forward_hooks:
            return False
        return not any(_sharded(p) for p in (experts.w1, experts.w2, experts.w3))

    def forward(self, x):
        if not self._whole_layer():
            return super().forward(x)
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        out = self.experts.routed(x, top_scores, selected_experts_indices)
        if self.shared_experts is not None:
            out = self.shared_experts(x) + out
        return out.reshape(bs, slen, dim)


def convert_model(model, precision="bf16", recompute=False):
    """Swap every torchtitan 0.2 MoE of `model` (and its experts) to megamoe's, in place; returns their names.
    ValueError (naming the module and the reason) where megamoe cannot stand in, or no MoE is found."""
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"megamoe torchtitan converter: precision must be 'bf16' or 'fp8', got {precision!r}")
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]
    for name, module in layers:
        if type(module) not in (MoE, MegamoeMoE) or type(module.experts) not in (GroupedExperts,
                                                                                 MegamoeGroupedExperts):
            raise ValueError(f"megamoe torchtitan converter: {name} is a {type(module).__name__} with "
                             f"{type(module.experts).__name__} experts; megamoe stands in for torchtitan's MoE with "
                             "its GroupedExperts (SwiGLU w1 / w2 / w3) only")
        if precision == "fp8":
            E, I, H = module.experts.w1.shape
            if H % FP8_BLOCK or I % FP8_BLOCK:
                raise ValueError(f"megamoe torchtitan converter: {name}: precision 'fp8' needs the dim and hidden "
                                 f"dim multiples of {FP8_BLOCK}, got {H} and {I}")
    if not layers:
        raise ValueError(f"megamoe torchtitan converter: {type(model).__name__} has no torchtitan MoE layer: nothing "
                         "for megamoe to stand in for")
    for name, module in layers:
        module.__class__ = MegamoeMoE
        module.experts.__class__ = MegamoeGroupedExperts
        module.experts.precision, module.experts.recompute = precision, recompute
    logger.info("megamoe: %d MoE layers on megamoe (precision %s)", len(layers), precision)
    return [name for name, _ in layers]


class MegamoeModelConverter:
    """torchtitan 0.2 model converter "megamoe" (bf16): see the module docstring."""

    precision = "bf16"

    def __init__(self, job_config, parallel_dims):
        self.job_config = job_config

    def convert(self, model):
        convert_model(model, precision=self.precision)

    def post_optimizer_hook(self, model):
        pass


class MegamoeFp8ModelConverter(MegamoeModelConverter):
    """torchtitan 0.2 model converter "megamoe.fp8": megamoe's blockwise FP8 GEMMs (Hopper)."""

    precision = "fp8"


register_model_converter(MegamoeModelConverter, "megamoe")
register_model_converter(MegamoeFp8ModelConverter, "megamoe.fp8")
