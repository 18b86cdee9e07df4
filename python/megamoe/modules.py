"""nn.Modules over `megamoe.moe`, for users without Hugging Face transformers.

    experts = MoEExperts(num_experts, hidden, intermediate)   # w13 [E, 2I, H], w2 [E, H, I]
    y = experts(x, topk_ids, topk_weights)                    # routing done by the caller

    block = MoEBlock(hidden, intermediate, num_experts, topk)  # router + experts
    y, router_logits = block(x)                               # x [B, S, H] or [T, H]

The router follows Qwen3-MoE / prime-rl: logits in (at least) fp32 -> softmax -> top-k -> optional
renormalisation of the top-k probabilities. The router logits come back for auxiliary losses
(`load_balancing_loss` computes the Switch-Transformer / Qwen3-MoE one).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._lib import precision_code
from .argument_errors import ARGUMENT_ERRORS, raise_argument_error
from .ops import moe


def _router_dtype(dtype):
    """The router runs in fp32, or in fp64 for fp64 inputs (so fp64 tests stay exact)."""
    return torch.promote_types(dtype, torch.float32)


def positive_int(name, value):
    """`value` itself when it is an int > 0 (not a bool), else TypeError / ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"megamoe: {name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"megamoe: {name} must be > 0, got {value}")
    return value


def check_rows(name, tensor, hidden, owner):
    """`tensor` [..., hidden]: a tensor whose last dimension is the module's hidden size (ValueError naming `name`
    and the module's hidden size otherwise), checked before any reshape."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"megamoe: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0 or tensor.shape[-1] != hidden:
        raise ValueError(f"megamoe: {name}: expected shape [..., H] with H = {hidden} (the hidden size of this "
                         f"{owner}), got {list(tensor.shape)}")


def check_routing(x, topk_ids, topk_weights):
    """topk_ids [..., topk] with the leading dimensions of x [..., H], topk_weights shaped as topk_ids and of a float
    dtype: each mismatch a ValueError / TypeError naming the argument, before any reshape (a reshape would accept a
    transposed topk_weights of the same size)."""
    for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"megamoe: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if topk_ids.dim() != x.dim() or topk_ids.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"megamoe: topk_ids: expected shape [..., topk] with the leading dimensions of x "
                         f"{list(x.shape[:-1])}, got {list(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"megamoe: topk_weights: expected the shape of topk_ids {list(topk_ids.shape)}, got "
                         f"{list(topk_weights.shape)}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"megamoe: topk_weights: dtype {topk_weights.dtype} not allowed (a float dtype: float32 or "
                         "the dtype of x run as they are, another one is cast to float32)")


def reshaped(tensor, shape):
    """tensor with `shape`, itself when it has it already: a module returning a view makes FSDP2 warn (an in-place
    op on the view would skip its pre-backward hook)."""
    return tensor if tensor.shape == shape else tensor.reshape(shape)


class MoEExperts(nn.Module):
    """The routed experts: `num_experts` SwiGLU MLPs as two stacked weights, run by `megamoe.moe`.

    Parameters (Hugging Face names in brackets; the properties `gate_up_proj` / `down_proj` return the same
    Parameter objects, and `load_state_dict` accepts either name):
        w13 [E, 2I, H]  (`gate_up_proj`): rows [0, I) gate, rows [I, 2I) up.
        w2  [E, H, I]   (`down_proj`).

    Initialised like Hugging Face Qwen3-MoE: normal(0, init_std). `recompute=True` selects the memory mode that
    keeps only the inputs for the backward (it recomputes h = [g, u]); the default keeps h ([T*topk, 2I]).
    `precision="fp8"` runs the GEMMs in blockwise FP8 (megamoe.moe's precision; CUDA sm_90, H and I multiples of 128)
    on FP8 copies of w13 / w2 that megamoe.fp8's cache makes once per update of the weights (as much memory again as
    the weights, kept while the module lives; megamoe.fp8.clear_cache() drops them); the default "bf16" computes in
    the weights' dtype.

    Under FSDP2 (`fully_shard`) the forward sees the unsharded parameters (plain tensors, or DTensors replicated over
    their mesh), which megamoe.moe takes; for experts sharded over ranks use megamoe.ep.MoEExperts.
    """

    def __init__(self, num_experts, hidden, intermediate, dtype=None, device=None, init_std=0.02, recompute=False,
                 precision="bf16"):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        for name, value in (("num_experts", num_experts), ("hidden", hidden), ("intermediate", intermediate)):
            positive_int(name, value)
        if not isinstance(recompute, bool):
            raise TypeError(f"megamoe: recompute must be True or False, got {type(recompute).__name__}")
        precision_code(precision)  # ValueError naming `precision` for an unknown one
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.init_std = init_std
        self.recompute = recompute
        self.precision = precision
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, **factory))  # [E, 2I, H]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate, **factory))  # [E, H, I]
        self.register_load_state_dict_pre_hook(_accept_hf_names)
        self.reset_parameters()

    def reset_parameters(self):
        """normal(0, init_std) for both weights, as Hugging Face initialises its experts."""
        nn.init.normal_(self.w13, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w2, mean=0.0, std=self.init_std)

    @property
    def gate_up_proj(self):
        """Hugging Face's name for `w13` (the same Parameter)."""
        return self.w13

    @property
    def down_proj(self):
        """Hugging Face's name for `w2` (the same Parameter)."""
        return self.w2

    def forward(self, x, topk_ids, topk_weights):
        """x [..., H], topk_ids [..., topk] (-1 = dropped slot), topk_weights [..., topk] -> y [..., H] in x's dtype.

        topk_weights may be fp32 or x's dtype; any other float dtype is cast to fp32. The shapes are checked before
        anything is reshaped (ValueError naming the argument; under torch.compile raised when the graph runs).
        """
        try:
            check_rows("x", x, self.hidden, "MoEExperts")
            check_routing(x, topk_ids, topk_weights)
        except ARGUMENT_ERRORS as error:
            return raise_argument_error(error, x)  # eager: raised now; traced: by the graph (argument_errors.py)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden)  # [T, H]
        ids = topk_ids.reshape(-1, topk_ids.shape[-1])  # [T, topk] (T = 0 too)
        weights = topk_weights.reshape(ids.shape)  # [T, topk]
        if weights.dtype not in (torch.float32, x.dtype):
            weights = weights.float()
        y = moe(x2, ids, weights, self.w13, self.w2, recompute=self.recompute, precision=self.precision)  # [T, H]
        return reshaped(y, (*lead, self.hidden))

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"recompute={self.recompute}, precision={self.precision!r}")


def _accept_hf_names(module, state_dict, prefix, *args):
    """load_state_dict pre-hook: rename Hugging Face `gate_up_proj` / `down_proj` keys to `w13` / `w2`."""
    for hf_name, ours in (("gate_up_proj", "w13"), ("down_proj", "w2")):
        if prefix + hf_name in state_dict and prefix + ours not in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + hf_name)


class MoEBlockOutput(NamedTuple):
    """What `MoEBlock.forward` returns; unpacks as `y, router_logits = block(x)`.

    y             [..., H]  x's dtype.
    router_logits [..., E]  fp32 (fp64 for fp64 inputs), before the softmax; same leading dims as x.
    """

    y: torch.Tensor
    router_logits: torch.Tensor


def route(router_logits, topk, norm_topk_prob=True):
    """softmax -> top-k -> optional renormalisation, as Qwen3-MoE does.

    router_logits [T, E] -> (topk_ids [T, topk] int64, topk_weights [T, topk] in the logits' dtype).
    """
    probs = torch.softmax(router_logits, dim=-1)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, topk, dim=-1)  # [T, topk]
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights


class MoEBlock(nn.Module):
    """A routed-expert block: router Linear -> softmax -> top-k -> optional renormalisation -> MoEExperts.

    forward(x) with x [B, S, H] or [T, H] returns `MoEBlockOutput(y, router_logits)`: y has x's shape and
    dtype, router_logits x's leading dims by E. The router weight `router.weight` [E, H] (Hugging Face
    Qwen3-MoE calls it `gate.weight`) is stored in the block's dtype and applied in fp32 (fp64 for fp64
    inputs); the top-k weights reach the experts in that precision. Experts are in `experts` (`precision`: theirs,
    "bf16" or "fp8"; see MoEExperts).
    """

    def __init__(
        self,
        hidden,
        intermediate,
        num_experts,
        topk,
        norm_topk_prob=True,
        dtype=None,
        device=None,
        init_std=0.02,
        recompute=False,
        precision="bf16",
    ):
        super().__init__()
        for name, value in (("hidden", hidden), ("intermediate", intermediate), ("num_experts", num_experts),
                            ("topk", topk)):
            positive_int(name, value)
        if topk > num_experts:
            raise ValueError(f"megamoe: topk must be in [1, num_experts={num_experts}], got {topk}")
        self.hidden, self.num_experts, self.topk = hidden, num_experts, topk
        self.norm_topk_prob = norm_topk_prob
        self.init_std = init_std
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)  # weight [E, H]
        self.experts = MoEExperts(
            num_experts, hidden, intermediate, dtype=dtype, device=device, init_std=init_std, recompute=recompute,
            precision=precision,
        )
        nn.init.normal_(self.router.weight, mean=0.0, std=init_std)

    def router_logits(self, x):
        """x [T, H] -> router logits [T, E] in fp32 (fp64 for fp64 x)."""
        dtype = _router_dtype(x.dtype)
        return F.linear(x.to(dtype), self.router.weight.to(dtype))

    def forward(self, x):
        try:
            check_rows("x", x, self.hidden, "MoEBlock")  # before any reshape
        except ARGUMENT_ERRORS as error:
            output = raise_argument_error(error, x)  # eager: raised now; traced: by the graph (argument_errors.py)
            placeholder = torch.empty(0) if not isinstance(x, torch.Tensor) else x.new_empty(0)
            return MoEBlockOutput(output, placeholder)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden)  # [T, H]
        logits = self.router_logits(x2)  # [T, E]
        topk_ids, topk_weights = route(logits, self.topk, self.norm_topk_prob)  # [T, topk] each
        y = self.experts(x2, topk_ids, topk_weights)  # [T, H]
        return MoEBlockOutput(reshaped(y, x.shape), reshaped(logits, (*lead, self.num_experts)))

    def extra_repr(self):
        return f"topk={self.topk}, norm_topk_prob={self.norm_topk_prob}"


def load_balancing_loss(router_logits, topk):
    """The Switch-Transformer auxiliary loss as Hugging Face Qwen3-MoE computes it (without attention mask).

    router_logits: one tensor [..., E] or a list/tuple of them (e.g. one per layer, concatenated over tokens).
    Returns E * sum_e f_e P_e, where f_e is the number of top-k slots choosing expert e per token and P_e the mean
    router probability of e; only P carries a gradient. Multiply by the aux-loss coefficient (Qwen3-MoE: 0.001)
    and add it to the loss. No host synchronisation.
    """
    logits = list(router_logits) if isinstance(router_logits, (list, tuple)) else [router_logits]
    if not logits:
        raise ValueError("megamoe: router_logits: an empty list (one tensor [..., E] per layer expected)")
    for index, tensor in enumerate(logits):
        name = "router_logits" if tensor is router_logits else f"router_logits[{index}]"
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() == 0:
            what = f"a {tensor.dtype} tensor of {tensor.dim()} dimensions" if isinstance(tensor, torch.Tensor) else (
                type(tensor).__name__)
            raise TypeError(f"megamoe: {name} must be a float tensor [..., E] of router logits, got {what}")
        if tensor.shape[-1] != logits[0].shape[-1]:
            raise ValueError(f"megamoe: {name}: E = {tensor.shape[-1]} experts, but router_logits[0] has "
                             f"{logits[0].shape[-1]}")
    num_experts = logits[0].shape[-1]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 0 < topk <= num_experts:
        raise ValueError(f"megamoe: topk must be an int in [1, E={num_experts}] (E: the last dimension of "
                         f"router_logits), got {topk!r}")
    router_logits = torch.cat([r.reshape(-1, num_experts) for r in logits]) if len(logits) > 1 else logits[0]
    probs = torch.softmax(router_logits.reshape(-1, num_experts).float(), dim=-1)  # [T, E]
    chosen = torch.topk(probs, topk, dim=-1).indices.reshape(-1)  # [T * topk]
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=probs.dtype))  # [E], exact small integers
    tokens_per_expert = counts / probs.shape[0]  # [E]
    prob_per_expert = probs.mean(dim=0)  # [E]
    return num_experts * (tokens_per_expert * prob_per_expert).sum()
