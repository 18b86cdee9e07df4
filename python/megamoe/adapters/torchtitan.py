"""torchtitan-style routed experts on megamoe: torchtitan's GroupedExperts storage, read in place.

torchtitan keeps a MoE layer's routed experts as three stacked weights, each expert a SwiGLU MLP
o = w2[e] (silu(w1[e] x) * (w3[e] x)):

    w1 [E, I, H]   gate projection        (torchtitan 0.3: w1_EFD, 0.2: w1)
    w2 [E, H, I]   down projection        (w2_EDF, w2)
    w3 [E, I, H]   up projection          (w3_EFD, w3)

which is megamoe's layout "separate" (megamoe.SEPARATE: w13 = w1, w3 = w3), so megamoe reads the parameters where
they are (no per-step copy) and autograd returns their gradients shaped as them. Two modules, as torchtitan's:

    experts = GroupedExperts(dim, hidden_dim, num_experts)          # parameters w1, w2, w3
    out = experts(x_sorted, num_tokens_per_expert)                  # x_sorted [R, H] grouped by expert -> [R, H]
    routed = RoutedExperts(dim, hidden_dim, num_experts)            # routed.inner_experts is a GroupedExperts
    y = routed(x, topk_scores, topk_expert_ids, num_tokens_per_expert)   # x [..., H] -> y [..., H]

The call conventions followed (and tested against the installed packages, tests/python/test_frameworks_torchtitan.py):
- torchtitan 0.3.0 (PyPI; torchtitan/models/common/moe.py): MoE.routed_experts is a RoutedExperts called with
  x [B, L, H], topk_scores / topk_expert_ids [B, L, K] and the counts [E], returning [B, L, H]; its inner_experts a
  GroupedExperts called with the dispatched rows [R, H] and the counts. Either drop-in fits: RoutedExperts as
  MoE.routed_experts, or GroupedExperts as routed_experts.inner_experts (torchtitan's dispatcher then sorts and
  combines).
- torchtitan main (pytorch/torchtitan b5bcd76c66d0acb1a08b176d9639425bc55e0b2a): the same with x [T, H] and
  [T, K] (RoutedExperts takes any leading shape [..., H] with [..., K] and returns x's).
- torchtitan 0.2.x (PyPI 0.2.2; torchtitan/models/moe/moe.py): no RoutedExperts; MoE.experts is a GroupedExperts
  (w1 / w2 / w3) called with the rows and the counts: the GroupedExperts drop-in, with either score_before_experts
  (the MoE scales the rows or the outputs outside the experts).

GroupedExperts.forward is torchtitan's inner-experts call (rows already dispatched, sorted by expert; rows past the
counts' sum are padding and come out 0): megamoe.grouped_moe. RoutedExperts.forward is torchtitan's RoutedExperts
call (its LocalTokenDispatcher's sort, the experts and the score-weighted scatter-add combine in one op):
megamoe.moe on the topk ids, y_t = sum_k topk_scores[t, k] o_{topk_expert_ids[t, k]}(x_t). Its counts are only
checked for their shape (megamoe routes by the ids on the device: no host sync). The scores multiply the experts'
outputs, as torchtitan's RoutedExperts combine does.

The computation runs in the weights' dtype (torchtitan casts to bf16) and returns x's dtype. Expert-parallel DTensor
weights (Shard(0)) work with GroupedExperts (grouped_moe reads their local experts); RoutedExperts needs every expert
(replicated weights), as megamoe.moe. The parameters may be loaded from either naming: load_state_dict accepts
torchtitan's w1_EFD / w2_EDF / w3_EFD keys.
"""

import torch
from torch import nn

from ..grouped import grouped_moe
from ..layouts import SEPARATE
from ..ops import moe
from . import _checks

_TORCHTITAN_NAMES = (("w1_EFD", "w1"), ("w2_EDF", "w2"), ("w3_EFD", "w3"))
# megamoe's argument names -> this module's, in megamoe's error messages
_GROUPED_NAMES = {"x_sorted": "x", "tokens_per_expert": "num_tokens_per_expert", "w13": "w1"}
_ROUTED_NAMES = {"topk_ids": "topk_expert_ids", "topk_weights": "topk_scores", "w13": "w1"}


def _accept_torchtitan_names(module, state_dict, prefix, *args):
    """load_state_dict pre-hook: rename torchtitan's shape-suffixed keys to w1 / w2 / w3."""
    for theirs, ours in _TORCHTITAN_NAMES:
        if prefix + theirs in state_dict and prefix + ours not in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + theirs)


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts on megamoe: w1 [E, I, H], w2 [E, H, I], w3 [E, I, H] (see the module docstring).

    forward(x_sorted [R, H], num_tokens_per_expert [E]) -> [R, H]: rows grouped by expert (expert 0's rows first),
    num_tokens_per_expert on x's device (int32 / int64); rows past its sum are padding (output 0).
    recompute=True keeps only the inputs for the backward (megamoe's recompute mode). precision: megamoe.moe's
    ("bf16", or "fp8": blockwise FP8 GEMMs on sm_90 CUDA, the FP8 copies of w1 / w3 / w2 cached per optimizer step).
    """

    def __init__(self, dim, hidden_dim, num_experts, dtype=None, device=None, recompute=False, precision="bf16"):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.num_experts = num_experts
        self.recompute = recompute
        self.precision = precision
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))  # [E, I, H] gate
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **factory))  # [E, H, I] down
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))  # [E, I, H] up
        self.register_load_state_dict_pre_hook(_accept_torchtitan_names)
        self.init_weights(0.02)

    def init_weights(self, init_std):
        """torchtitan's initialisation: truncated normal, std 0.02 for w1 and init_std for w2, w3."""
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)

    def forward(self, x_sorted, num_tokens_per_expert):
        entry = "megamoe.adapters.torchtitan.GroupedExperts"
        _checks.tensor(entry, "x", x_sorted, 2)
        _checks.counts(entry, "num_tokens_per_expert", num_tokens_per_expert, self.num_experts)
        with _checks.framework_names(entry, _GROUPED_NAMES):
            out = grouped_moe(x_sorted.to(self.w1.dtype), num_tokens_per_expert, self.w1, self.w2,
                              recompute=self.recompute, w3=self.w3, layout=SEPARATE,
                              precision=self.precision)  # [R, H]
        return out.to(x_sorted.dtype)


class RoutedExperts(nn.Module):
    """torchtitan's RoutedExperts (dispatch, experts, combine) as one megamoe call; `inner_experts` holds the
    parameters (a GroupedExperts, as in torchtitan's module tree).

    forward(x [..., H], topk_scores [..., K], topk_expert_ids [..., K], num_tokens_per_expert [E]) -> y [..., H] in
    x's dtype, with x's leading shape: torchtitan 0.3.0 (PyPI) calls it with x [B, L, H] and scores / ids [B, L, K],
    torchtitan main with x [T, H] and [T, K]. y_t = sum_k topk_scores[t, k] * o_e(x_t), e = topk_expert_ids[t, k] (-1:
    a dropped slot, megamoe's convention). topk_scores in f32 or x's dtype (others are cast to f32);
    num_tokens_per_expert is not read (shape checked only).
    """

    def __init__(self, dim, hidden_dim, num_experts, dtype=None, device=None, recompute=False, precision="bf16"):
        super().__init__()
        self.inner_experts = GroupedExperts(dim, hidden_dim, num_experts, dtype=dtype, device=device,
                                            recompute=recompute, precision=precision)

    def forward(self, x, topk_scores, topk_expert_ids, num_tokens_per_expert=None):
        entry = "megamoe.adapters.torchtitan.RoutedExperts"
        experts = self.inner_experts
        _checks.routing(entry, x, "topk_scores", topk_scores, "topk_expert_ids", topk_expert_ids)
        if num_tokens_per_expert is not None:
            _checks.counts(entry, "num_tokens_per_expert", num_tokens_per_expert, experts.num_experts)
        K = topk_expert_ids.shape[-1]
        x_in = x.reshape(-1, x.shape[-1]).to(experts.w1.dtype)  # [T, H]
        ids, scores = topk_expert_ids.reshape(-1, K), topk_scores.reshape(-1, K)  # [T, K]
        with _checks.framework_names(entry, _ROUTED_NAMES):
            y = moe(x_in, ids, _checks.scores_dtype(scores, x_in), experts.w1, experts.w2,
                    recompute=experts.recompute, w3=experts.w3, layout=SEPARATE,
                    precision=experts.precision)  # [T, H]
        return y.to(x.dtype).view(x.shape)
