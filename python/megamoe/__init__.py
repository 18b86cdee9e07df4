"""megamoe: a trainable fused Mixture-of-Experts layer for NVIDIA Hopper GPUs.

    y = megamoe.moe(x, topk_ids, topk_weights, w13, w2)   # autograd, torch.compile and CUDA graphs
    out = megamoe.grouped_moe(x_sorted, tokens_per_expert, w13, w2, scores)   # rows already sorted by expert
    y = megamoe.moe(x, topk_ids, topk_weights, gate_up_proj, down_proj, b13=b13, b2=b2,
                    layout=megamoe.GPT_OSS, activation=megamoe.GPT_OSS_ACTIVATION)   # other layouts (layouts.py)
    megamoe.path_of(x, topk_ids, topk_weights, w13, w2)   # "reference", "cuda", "sm90": which path runs
    y = megamoe.moe(x, topk_ids, topk_weights, w13, w2, precision="fp8")   # blockwise FP8 GEMMs (fp8.py)
    block = megamoe.MoEBlock(hidden, intermediate, num_experts, topk)   # router + experts, nn.Module
    y = megamoe.ep.moe(x, topk_ids, topk_weights, w13_local, w2_local, group)   # experts sharded over ranks
    import megamoe.hf                                     # registers experts_implementation="megamoe" in transformers
    megamoe.adapters.torchtitan / prime_rl / megatron     # the frameworks' experts interfaces (adapters/)

See docs/python.md for the API and docs/DESIGN.md for the math and the kernels.
"""

from . import _lib, adapters, ep, fp8
from .grouped import GroupedGrads, grouped_backward, grouped_forward, grouped_moe, grouped_path_of
from .layouts import (CONCATENATED, GPT_OSS, GPT_OSS_ACTIVATION, HF_TRANSPOSED, INTERLEAVED, SEPARATE, SWIGLU,
                      Activation, Layout, arrange_weights, clamped_swiglu)
from .modules import MoEBlock, MoEBlockOutput, MoEExperts, load_balancing_loss
from .ops import MoEGrads, moe, moe_backward, moe_forward, path_of


def __getattr__(name):
    if name == "__version__":  # the library's own version (megamoe_version()), read when first asked for
        return _lib.version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "adapters",
    "ep",
    "fp8",
    "moe",
    "moe_forward",
    "moe_backward",
    "grouped_moe",
    "grouped_forward",
    "grouped_backward",
    "path_of",
    "grouped_path_of",
    "MoEGrads",
    "GroupedGrads",
    "Layout",
    "Activation",
    "clamped_swiglu",
    "arrange_weights",
    "CONCATENATED",
    "INTERLEAVED",
    "SEPARATE",
    "HF_TRANSPOSED",
    "GPT_OSS",
    "SWIGLU",
    "GPT_OSS_ACTIVATION",
    "MoEExperts",
    "MoEBlock",
    "MoEBlockOutput",
    "load_balancing_loss",
    "__version__",
]
