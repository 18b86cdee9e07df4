"""megamoe: a trainable fused Mixture-of-Experts layer for NVIDIA Hopper GPUs, for people training MoE models in
PyTorch. One call computes an MoE layer's routed experts (gather, gate/up GEMM, SwiGLU, down GEMM, weighted
combine) and their backward; GPUs run fused CUDA kernels, CPU tensors a C++ reference.

    y = megamoe.moe(x, topk_ids, topk_weights, w13, w2)   # x [T, H], topk_* [T, topk], w13 [E, 2I, H], w2 [E, H, I]
    out = megamoe.grouped_moe(x_sorted, tokens_per_expert, w13, w2, scores)   # rows already sorted by expert
    block = megamoe.MoEBlock(hidden, intermediate, num_experts, topk)   # router + experts: y, logits = block(x)
    experts = megamoe.MoEExperts(num_experts, hidden, intermediate)    # experts alone: experts(x, ids, weights)
    megamoe.path_of(x, topk_ids, topk_weights, w13, w2)   # which kernels a call runs: "reference", "cuda", "sm90"
    import megamoe.hf                                     # then from_pretrained(..., experts_implementation="megamoe")

Autograd, torch.compile(fullgraph=True) and CUDA graphs work; other weight layouts, gpt-oss's activation, biases,
blockwise FP8 (precision="fp8"), expert parallelism (megamoe.ep) and framework adapters (megamoe.adapters) are in
the documentation, which ships with the package: megamoe.docs_path() is its folder (python.md first).
"""

import pathlib

from . import _lib, adapters, ep, fp8
from .grouped import GroupedGrads, grouped_backward, grouped_forward, grouped_moe, grouped_path_of
from .layouts import (CONCATENATED, GPT_OSS, GPT_OSS_ACTIVATION, HF_TRANSPOSED, INTERLEAVED, SEPARATE, SWIGLU,
                      Activation, Layout, arrange_weights, clamped_swiglu)
from .modules import MoEBlock, MoEBlockOutput, MoEExperts, load_balancing_loss
from .ops import MoEGrads, moe, moe_backward, moe_forward, path_of


def docs_path():
    """The folder of megamoe's documentation (python.md: the Python API; DESIGN.md: the math and the kernels): the
    installed package's docs/, or docs/ of a source checkout."""
    here = pathlib.Path(__file__).resolve().parent
    installed = here / "docs"
    return installed if installed.is_dir() else here.parent.parent / "docs"


def __getattr__(name):
    if name == "__version__":  # the library's own version (megamoe_version()), read when first asked for
        return _lib.version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# What help(megamoe) documents: the functions and the small types. The modules (MoEExperts, MoEBlock: torch
# nn.Modules, a thousand lines each in help()) and the gradients' NamedTuples are importable all the same.
__all__ = [
    "adapters",
    "ep",
    "fp8",
    "docs_path",
    "moe",
    "moe_forward",
    "moe_backward",
    "grouped_moe",
    "grouped_forward",
    "grouped_backward",
    "path_of",
    "grouped_path_of",
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
    "load_balancing_loss",
    "__version__",
]
