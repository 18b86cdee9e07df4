"""megamoe: a trainable fused Mixture-of-Experts layer for NVIDIA Hopper GPUs.

    y = megamoe.moe(x, topk_ids, topk_weights, w13, w2)   # autograd, torch.compile and CUDA graphs

See README.md for the API and docs/DESIGN.md for the math and the kernels.
"""

from .ops import moe, moe_backward, moe_forward

__version__ = "0.1.0"

__all__ = ["moe", "moe_forward", "moe_backward", "__version__"]
