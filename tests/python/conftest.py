"""Shared fixtures of the Python tests: random problems (fresh data each run, never zeros), ragged
routings, an independent plain-PyTorch implementation of DESIGN.md section 1, the whole layer's slots as
grouped rows (group_rows, grouped_as_layer) for the grouped-rows tests, the library's test overrides and a recorder
of the library's calls."""

import os
import types

import pytest
import torch
import torch.nn.functional as F

import megamoe

# Ragged problems: (name, T, H, I, E, topk, routing). routing: random | one_expert | dropped | half_empty.
RAGGED = [
    ("basic", 9, 16, 12, 4, 2, "random"),
    ("zero_token_experts", 11, 24, 10, 8, 2, "half_empty"),
    ("one_expert_takes_all", 10, 20, 9, 5, 1, "one_expert"),
    ("topk1", 7, 18, 6, 3, 1, "random"),
    ("T1", 1, 10, 7, 4, 3, "random"),
    ("dropped_slots", 13, 15, 11, 6, 3, "dropped"),
    ("E1", 6, 12, 5, 1, 1, "random"),
    ("odd_sizes", 67, 70, 33, 9, 4, "random"),
]


@pytest.fixture
def gen():
    """A generator with a fresh seed each run (printed, so a failure can be replayed with MEGAMOE_SEED)."""
    seed = int(os.environ.get("MEGAMOE_SEED", torch.seed() % 2**31))
    print(f"seed={seed}")
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def make_ids(T, E, topk, routing, gen):
    """topk_ids [T, topk] int64: distinct experts per token where E allows, with the ragged variants."""
    pool = torch.arange(E) if routing != "half_empty" else torch.arange(0, E, 2)
    scores = torch.rand(T, pool.numel(), generator=gen)
    order = scores.argsort(dim=1)
    reps = (topk + pool.numel() - 1) // pool.numel()
    ids = pool[order.repeat(1, reps)[:, :topk]]
    if routing == "one_expert":
        ids[:, 0] = 0
    if routing == "dropped":
        ids[torch.rand(T, topk, generator=gen) < 0.3] = -1
        ids[:1] = -1  # one token with every slot dropped (none when T = 0)
    return ids


def make_problem(T, H, I, E, topk, routing="random", dtype=torch.float64, gen=None, device="cpu"):
    """x, topk_ids, topk_weights, w13, w2, dy on `device` (float leaves require grad)."""
    x = torch.randn(T, H, generator=gen, dtype=torch.float64) * 0.5
    w13 = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen, dtype=torch.float64) / I**0.5
    ids = make_ids(T, E, topk, routing, gen)
    s = torch.rand(T, topk, generator=gen, dtype=torch.float64) + 0.05
    dy = torch.randn(T, H, generator=gen, dtype=torch.float64)
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = [x.to(dtype), ids, s.to(weight_dtype), w13.to(dtype), w2.to(dtype), dy.to(dtype)]
    out = [t.to(device) for t in out]
    for t in (out[0], out[2], out[3], out[4]):
        t.requires_grad_(True)
    return out


def torch_moe(x, topk_ids, topk_weights, w13, w2):
    """DESIGN.md section 1 in plain PyTorch, slot by slot via gathered expert weights (small shapes only)."""
    I = w2.shape[2]
    valid = topk_ids >= 0  # [T, topk]
    experts = topk_ids.clamp(min=0)
    h = torch.einsum("tknh,th->tkn", w13[experts], x)  # [T, topk, 2I]
    a = F.silu(h[..., :I]) * h[..., I:]  # [T, topk, I]
    o = torch.einsum("tkhi,tki->tkh", w2[experts], a)  # [T, topk, H]
    s = torch.where(valid, topk_weights, torch.zeros_like(topk_weights))
    return (o * s.unsqueeze(-1).to(o.dtype)).sum(dim=1)


def grads_of(fn, x, ids, s, w13, w2, dy):
    """y and the gradients (dx, ds, dw13, dw2) of <dy, fn(...)>."""
    for t in (x, s, w13, w2):
        t.grad = None
    y = fn(x, ids, s, w13, w2)
    y.backward(dy)
    out = [y.detach()] + [t.grad.detach().clone() for t in (x, s, w13, w2)]
    for t in (x, s, w13, w2):
        t.grad = None
    return out


def rel_err(a, b):
    """||a - b|| / ||b|| in float64 (NaN in a gives NaN)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def group_rows(x, topk_ids, topk_weights, num_experts, num_padding=0, gen=None):
    """The whole layer's slots as grouped rows: the non-dropped slots sorted by expert (stably, so by slot within an
    expert), x_sorted = their tokens' rows, scores = their weights, then num_padding padding rows (random values).
    Differentiable in x and topk_weights (gathers; x is gathered in f32 / f64 so its gradient sums without extra
    rounding). Returns x_sorted [R, H], tokens_per_expert [E] (int64), scores [R], token_of_row [R - num_padding]."""
    topk = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    kept = (flat_ids >= 0).nonzero().squeeze(1)
    order = kept[torch.sort(flat_ids[kept], stable=True).indices]  # sorted row -> slot
    token_of_row = order // topk
    counts = torch.bincount(flat_ids[order], minlength=num_experts)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_sorted = x.to(wide)[token_of_row].to(x.dtype)
    scores = topk_weights.reshape(-1)[order]
    if num_padding:
        pad_x = torch.randn(num_padding, x.shape[1], generator=gen, dtype=torch.float64).to(x)
        pad_s = torch.rand(num_padding, generator=gen, dtype=torch.float64).to(scores)
        x_sorted, scores = torch.cat([x_sorted, pad_x]), torch.cat([scores, pad_s])
    return x_sorted, counts.to(topk_ids.device), scores, token_of_row


def grouped_as_layer(num_padding=0, recompute=False, counts_dtype=torch.int64, gen=None):
    """megamoe.moe's signature run through megamoe.grouped_moe: group the slots (group_rows), apply the experts to
    the rows, add each row back into its token (in f32 / f64)."""
    def layer(x, topk_ids, topk_weights, w13, w2):
        x_sorted, counts, scores, token_of_row = group_rows(x, topk_ids, topk_weights, w13.shape[0], num_padding, gen)
        out = megamoe.grouped_moe(x_sorted, counts.to(counts_dtype), w13, w2, scores, recompute=recompute)
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = torch.zeros(x.shape, dtype=wide, device=x.device)
        return y.index_add(0, token_of_row, out[: token_of_row.numel()].to(wide)).to(x.dtype)
    return layer


def torch_grouped(x_sorted, tokens_per_expert, w13, w2, scores=None):
    """Grouped rows in plain PyTorch: the whole layer's torch_moe with one slot per row (padding rows: dropped)."""
    R, E = x_sorted.shape[0], w13.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(E, device=x_sorted.device), tokens_per_expert.long())
    ids = torch.full((R, 1), -1, dtype=torch.int64, device=x_sorted.device)
    ids[: expert_of_row.numel(), 0] = expert_of_row
    weights = scores[:, None] if scores is not None else torch.ones(R, 1, dtype=x_sorted.dtype, device=x_sorted.device)
    return torch_moe(x_sorted, ids, weights, w13, w2)


@pytest.fixture
def overrides():
    """Sets the library's test overrides for one test (overrides(flags): megamoe._lib.TEST_* values), restoring the
    previous ones after it."""
    from megamoe import _lib

    previous = []

    def set_overrides(flags):
        previous.append(_lib.set_test_overrides(flags))

    yield set_overrides
    if previous:
        _lib.set_test_overrides(previous[0])


@pytest.fixture
def recorder(monkeypatch):
    """Replaces the library's calls (_lib.call) by a recorder: each call's kind, tensors and options are kept, its
    outputs filled with zeros (the accumulating backward's weight gradients left as they are)."""
    from megamoe import _lib

    calls = []

    def record(kind, tensors, options=None, **fields):
        calls.append(types.SimpleNamespace(kind=kind, tensors=dict(tensors), options=dict(options or {})))
        inputs = {"x", "x_sorted", "dy", "dout", "saved_h"} if "backward" in kind else {"x", "x_sorted"}
        for name, tensor in tensors.items():
            if tensor is None or name in inputs or not (name in ("y", "out", "saved_h") or name.startswith("d")):
                continue
            if not (fields.get("accumulate_weight_grads") and name[1:] in ("w13", "w2", "w3", "b13", "b2")):
                tensor.zero_()

    monkeypatch.setattr(_lib, "call", record)
    return calls
