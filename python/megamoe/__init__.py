"""megamoe: a trainable fused Mixture-of-Experts layer for NVIDIA Hopper GPUs.

    y = megamoe.moe(x, topk_ids, topk_weights, w13, w2)   # autograd, torch.compile and CUDA graphs
    out = megamoe.grouped_moe(x_sorted, tokens_per_expert, w13, w2, scores)   # rows already sorted by expert
    block = megamoe.MoEBlock(hidden, intermediate, num_experts, topk)   # router + experts, nn.Module
    y = megamoe.ep.moe(x, topk_ids, topk_weights, w13_local, w2_local, group)   # experts sharded over ranks
    import megamoe.hf                                     # registers experts_implementation="megamoe" in transformers

See README.md for the API and docs/DESIGN.md for the math and the kernels.
"""

from . import ep
from .grouped import grouped_backward, grouped_forward, grouped_moe
from .modules import MoEBlock, MoEBlockOutput, MoEExperts, load_balancing_loss
from .ops import moe, moe_backward, moe_forward

__version__ = "0.1.0"

__all__ = [
    "moe",
    "moe_forward",
    "moe_backward",
    "grouped_moe",
    "grouped_forward",
    "grouped_backward",
    "MoEExperts",
    "MoEBlock",
    "MoEBlockOutput",
    "load_balancing_loss",
    "__version__",
]
