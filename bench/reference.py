"""Correctness: DESIGN §1 in plain PyTorch at high precision, on subsets, and the comparisons against it.

A full fp32 reference does not fit comfortably for the big shapes (deepseek-v3: w13 alone is 256x4096x7168, 30 GB in
fp32, plus its fp32 gradient and the autograd graph). Every output of §1 is local, though:
- y_t, dx_t and ds_t (d topk_weights) of a token depend only on that token's x_t, dy_t, routing and the weights of
  the experts it is routed to, so they are computed exactly on a subset of tokens;
- dW13[e] and dW2[e] depend only on the slots routed to expert e, so they are computed exactly, over all their
  tokens, on a subset of experts.
The reference runs one expert at a time (weights upcast one expert at a time, each expert's graph freed at once),
with torch autograd for the backward, so it is independent of any hand-derived gradient formula.
"""
import math

import torch
import torch.nn.functional as F

FWD_KEYS = ("y",)
FWDBWD_KEYS = ("y", "dx", "dtopk_weights", "dw13", "dw2")


def _expert_fwd_bwd(xr, sr, dyr, w13e, w2e, want_wgrad):
    """One expert, rows r routed to it, via autograd: yr = s·o, dx, ds, dW13[e], dW2[e] (None if not wanted)."""
    I = w2e.shape[1]
    xr, sr = xr.requires_grad_(), sr.requires_grad_()
    w13e, w2e = w13e.requires_grad_(want_wgrad), w2e.requires_grad_(want_wgrad)
    h = xr @ w13e.t()  # [r, 2I]
    a = F.silu(h[:, :I]) * h[:, I:]  # [r, I]
    yr = sr[:, None] * (a @ w2e.t())  # [r, H]
    yr.backward(dyr)
    return yr.detach(), xr.grad, sr.grad, w13e.grad, w2e.grad


def reference_outputs(case, tokens, experts, dtype, backward=True):
    """DESIGN §1 in `dtype`: y, dx, dtopk_weights on `tokens` (a sorted index tensor) and dw13, dw2 on `experts`
    (a list), from the case's (bf16) inputs. Slots with id -1 contribute nothing."""
    T, H, I, E, topk = case.dims
    dev = case.x.device
    tokens = tokens.to(dev)
    n = tokens.numel()
    row_of = torch.full((T,), -1, dtype=torch.long, device=dev)  # token -> row in the token subset
    row_of[tokens] = torch.arange(n, device=dev)
    in_subset = row_of >= 0  # [T]
    out = {"y": torch.zeros(n, H, dtype=dtype, device=dev)}
    if backward:
        out["dx"] = torch.zeros(n, H, dtype=dtype, device=dev)
        out["dtopk_weights"] = torch.zeros(n, topk, dtype=dtype, device=dev)
        out["dw13"] = torch.zeros(len(experts), 2 * I, H, dtype=dtype, device=dev)
        out["dw2"] = torch.zeros(len(experts), H, I, dtype=dtype, device=dev)
    x, ids, s, dy = case.x.detach(), case.ids, case.s.detach(), case.dy
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the baseline module turns TF32 on; the reference must not use it
    try:
        for e in range(E):
            want_wgrad = backward and e in experts
            sel = ids == e  # [T, topk]
            if not want_wgrad:
                sel &= in_subset[:, None]
            t, j = sel.nonzero(as_tuple=True)  # slots of expert e that matter
            if t.numel() == 0:
                continue
            yr, dxr, dsr, dw13e, dw2e = _expert_fwd_bwd(
                x[t].to(dtype), s[t, j].to(dtype), dy[t].to(dtype),
                case.w13[e].detach().to(dtype), case.w2[e].detach().to(dtype), want_wgrad)
            keep = in_subset[t]
            rows = row_of[t[keep]]
            out["y"].index_add_(0, rows, yr[keep])
            if backward:
                out["dx"].index_add_(0, rows, dxr[keep])
                out["dtopk_weights"][rows, j[keep]] = dsr[keep]
            if want_wgrad:
                out["dw13"][experts.index(e)] = dw13e
                out["dw2"][experts.index(e)] = dw2e
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return out


def path_outputs(fn, case, tokens, experts, backward):
    """Runs one MoE implementation on the full case and returns its outputs on the check subsets (fp32 copies; the
    full-size gradients are released). fn is fn(x, ids, topk_weights, w13, w2), or an impls.Impl, which also names
    the leaves a peer keeps its weights in and maps their gradients back to [E, 2I, H] / [E, H, I]."""
    impl = fn if hasattr(fn, "weight_grads") else None
    fn = impl.fn if impl else fn
    tokens = tokens.to(case.x.device)
    leaves = impl.leaves(case) if impl else case.leaves()  # x, topk_weights, w13-like, w2-like
    _clear(leaves)
    if not backward:
        with torch.no_grad():
            y = fn(case.x, case.ids, case.s, case.w13, case.w2)
        return {"y": y[tokens].float()}
    y = fn(case.x, case.ids, case.s, case.w13, case.w2)
    y.backward(case.dy)
    grads = dict(zip(("dx", "dtopk_weights", "dw13", "dw2"), (t.grad for t in leaves)))
    missing = [k for k, g in grads.items() if g is None]
    if missing:
        _clear(leaves)
        raise RuntimeError(f"no gradient for {', '.join(missing)}")
    dw13, dw2 = (impl.weight_grads if impl else expert_rows)(grads["dw13"], grads["dw2"], experts)
    out = {"y": y.detach()[tokens].float(), "dx": grads["dx"][tokens].float(),
           "dtopk_weights": grads["dtopk_weights"][tokens].float(), "dw13": dw13.float(), "dw2": dw2.float()}
    del y, grads
    _clear(leaves)
    return out


def expert_rows(dw13, dw2, experts):
    """(dw13 [n, 2I, H], dw2 [n, H, I]) of the experts: megamoe's layout."""
    return dw13[experts], dw2[experts]


def _clear(leaves):
    for t in leaves:
        t.grad = None


def rel_err(a, ref):
    """Relative Frobenius error ||a - ref|| / ||ref|| (absolute if ref is all zeros); not finite if a is not."""
    diff = torch.linalg.vector_norm((a.to(ref.dtype) - ref), dtype=torch.float64).item()
    den = torch.linalg.vector_norm(ref, dtype=torch.float64).item()
    return diff / den if den > 0 else diff


def passes(err, floor_err, tolerance=None):
    """DESIGN's acceptance rule: megamoe error <= 5x the bf16 torch path's error + 1e-3, and finite; with a tolerance
    (the FP8 implementations: impls.FP8_TOLERANCE), error <= tolerance, and finite."""
    if not math.isfinite(err):
        return False
    if tolerance is not None:
        return err <= tolerance
    return not math.isfinite(floor_err) or err <= 5 * floor_err + 1e-3


def compare(outs, floor_outs, ref, floor_label="torch_bf16", label="megamoe", tolerance=None):
    """{key: {label: err, floor_label: err, "pass": bool}} for every key of ref; floor_outs is the bf16 baseline
    whose error sets the tolerance (or `tolerance`, a bound on the relative error, where given)."""
    res = {}
    for k, r in ref.items():
        e_m, e_f = rel_err(outs[k], r), rel_err(floor_outs[k], r)
        res[k] = {label: e_m, floor_label: e_f, "pass": passes(e_m, e_f, tolerance)}
    return res
