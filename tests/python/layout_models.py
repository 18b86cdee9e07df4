"""Expert weights in every layout megamoe reads, and plain-PyTorch experts computing from each layout as the frameworks
that store it do (written from their published code, none of them imported): Hugging Face Qwen3-MoE (gate_up_proj
[E, 2I, H] concatenated), HF is_transposed experts ([E, H, 2I] / [E, I, H]), gpt-oss (interleaved, transposed,
biased, clamped SwiGLU), torchtitan (separate w1 / w3 [E, I, H], w2 [E, H, I]) and torchtitan's fused interleaved w13;
and one generic plain-PyTorch function over any (layout, activation, biases) for the combination sweep."""

import itertools

import torch
import torch.nn.functional as F

import megamoe

LAYOUTS = {
    "concatenated": megamoe.CONCATENATED,
    "interleaved": megamoe.INTERLEAVED,
    "separate": megamoe.SEPARATE,
    "hf_transposed": megamoe.HF_TRANSPOSED,
    "gpt_oss": megamoe.GPT_OSS,
    "separate_transposed": megamoe.Layout("separate", True, True),
    "interleaved_w13_transposed": megamoe.Layout("interleaved", True, False),
    "concatenated_w2_transposed": megamoe.Layout("concatenated", False, True),
}
ACTIVATIONS = {"swiglu": megamoe.SWIGLU, "clamped": megamoe.GPT_OSS_ACTIVATION,
               "clamped_tight": megamoe.clamped_swiglu(limit=0.4, alpha=1.3)}  # tight: many clamps active
BIASES = {"none": (False, False), "b13": (True, False), "b2": (False, True), "both": (True, True)}
COMBINATIONS = list(itertools.product(LAYOUTS, ACTIVATIONS, BIASES))


to_layout = megamoe.layouts.arrange_weights  # canonical weights stored as a layout stores them


def layout_problem(T, H, I, E, topk, layout, with_b13, with_b2, routing="random", gen=None, dtype=torch.float64):
    """x, topk_ids, topk_weights, dy and the expert parameters in `layout` (dict: w13, w3, w2, b13, b2; absent ones
    None); float leaves require grad."""
    from conftest import make_problem  # the tests' own problem maker (fresh data, never zeros)

    x, ids, s, w13, w2, dy = [t.detach() for t in make_problem(T, H, I, E, topk, routing, gen=gen)]
    b13 = torch.randn(E, 2 * I, generator=gen, dtype=torch.float64) * 0.3 if with_b13 else None
    b2 = torch.randn(E, H, generator=gen, dtype=torch.float64) * 0.3 if with_b2 else None
    params = to_layout(w13, w2, b13, layout)
    params["b2"] = b2
    leaves = {name: t.to(dtype).requires_grad_() if t is not None else None for name, t in params.items()}
    x, s, dy = x.to(dtype).requires_grad_(), s.to(dtype).requires_grad_(), dy.to(dtype)
    return x, ids, s, dy, leaves


def apply_activation(gate, up, activation):
    """gpt-oss's clamped SwiGLU as its modeling code writes it, or SwiGLU."""
    if activation.kind == "swiglu":
        return F.silu(gate) * up
    gate = gate.clamp(min=None, max=activation.limit)
    up = up.clamp(min=-activation.limit, max=activation.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))


def _combine(o, topk_ids, topk_weights):
    """y_t = sum_j s_tj o_tj over the non-dropped slots; o [T, topk, H]."""
    s = torch.where(topk_ids >= 0, topk_weights, torch.zeros_like(topk_weights))
    return (o * s.unsqueeze(-1).to(o.dtype)).sum(dim=1)


def torch_experts(x, topk_ids, topk_weights, w13, w2, w3=None, b13=None, b2=None, layout=None, activation=None):
    """Any layout / activation / biases in plain PyTorch, read from the layout's definition (layouts.py), slot by slot
    through gathered expert weights (small shapes only)."""
    layout = layout or megamoe.CONCATENATED
    activation = activation or megamoe.SWIGLU
    experts = topk_ids.clamp(min=0)  # [T, topk]
    rows = w13.transpose(1, 2) if layout.w13_transposed else w13  # [E, 2I, H] or [E, I, H]
    if layout.gate_up == "separate":
        gate_w, up_w = rows, (w3.transpose(1, 2) if layout.w13_transposed else w3)
    elif layout.gate_up == "interleaved":
        gate_w, up_w = rows[:, 0::2], rows[:, 1::2]
    else:
        half = rows.shape[1] // 2
        gate_w, up_w = rows[:, :half], rows[:, half:]
    down = w2.transpose(1, 2) if layout.w2_transposed else w2  # [E, H, I]
    gate = torch.einsum("tkih,th->tki", gate_w[experts], x)  # [T, topk, I]
    up = torch.einsum("tkih,th->tki", up_w[experts], x)
    if b13 is not None:
        I = gate.shape[-1]
        interleaved = layout.gate_up == "interleaved"
        gate = gate + (b13[:, 0::2] if interleaved else b13[:, :I])[experts]
        up = up + (b13[:, 1::2] if interleaved else b13[:, I:])[experts]
    o = torch.einsum("tkhi,tki->tkh", down[experts], apply_activation(gate, up, activation))  # [T, topk, H]
    if b2 is not None:
        o = o + b2[experts]
    return _combine(o, topk_ids, topk_weights)


def _per_slot(x, topk_ids, topk_weights, expert_fn):
    """y from expert_fn(e, rows of x) -> outputs, expert by expert (the frameworks' loop over experts)."""
    T, topk = topk_ids.shape
    o = x.new_zeros(T, topk, x.shape[1])
    for e in topk_ids[topk_ids >= 0].unique().tolist():
        token_idx, slot_idx = (topk_ids == e).nonzero(as_tuple=True)
        o = o.index_put((token_idx, slot_idx), expert_fn(e, x[token_idx]))
    return _combine(o, topk_ids, topk_weights)


def hf_qwen3_experts(x, topk_ids, topk_weights, gate_up_proj, down_proj):
    """HF Qwen3-MoE experts: gate_up_proj [E, 2I, H] (chunk(2): gate, up), down_proj [E, H, I]."""
    def expert(e, rows):
        gate, up = F.linear(rows, gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down_proj[e])
    return _per_slot(x, topk_ids, topk_weights, expert)


def hf_transposed_experts(x, topk_ids, topk_weights, gate_up_proj, down_proj):
    """HF experts with is_transposed=True: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""
    def expert(e, rows):
        gate, up = (rows @ gate_up_proj[e]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ down_proj[e]
    return _per_slot(x, topk_ids, topk_weights, expert)


def gpt_oss_experts(x, topk_ids, topk_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias,
                    limit=7.0, alpha=1.702):
    """HF gpt-oss experts: gate_up_proj [E, H, 2I] interleaved (gate ::2, up 1::2) with its bias [E, 2I], down_proj
    [E, I, H] with its bias [E, H]; gate clamped above at limit, up to [-limit, limit], (up + 1) * gate sigmoid(alpha
    gate)."""
    def expert(e, rows):
        gate_up = rows @ gate_up_proj[e] + gate_up_proj_bias[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        return ((up + 1) * glu) @ down_proj[e] + down_proj_bias[e]
    return _per_slot(x, topk_ids, topk_weights, expert)


def torchtitan_experts(x, topk_ids, topk_weights, w1, w2, w3):
    """torchtitan GroupedExperts: w1, w3 [E, I, H], w2 [E, H, I]; silu(x w1^T) * (x w3^T) w2^T."""
    def expert(e, rows):
        return (F.silu(rows @ w1[e].transpose(-2, -1)) * (rows @ w3[e].transpose(-2, -1))) @ w2[e].transpose(-2, -1)
    return _per_slot(x, topk_ids, topk_weights, expert)


def torchtitan_fused_experts(x, topk_ids, topk_weights, w13, w2):
    """torchtitan's fused override: w13 [E, 2I, H] with gate / up rows interleaved, w2 [E, H, I]."""
    def expert(e, rows):
        h = rows @ w13[e].transpose(-2, -1)
        return (F.silu(h[..., 0::2]) * h[..., 1::2]) @ w2[e].transpose(-2, -1)
    return _per_slot(x, topk_ids, topk_weights, expert)
