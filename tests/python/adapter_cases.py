"""Shared pieces of the adapter tests (test_adapters_*.py): ragged routings, the gradients of a function of named
leaves, the comparison of two such results, and the frameworks' rows grouped by expert in plain PyTorch."""

import torch
import torch.nn.functional as F

from conftest import make_ids, rel_err

# (name, T, H, I, E, topk, routing): conftest.make_ids routings; "dropped" only where the framework has dropped slots.
ROUTINGS = [
    ("basic", 9, 16, 12, 4, 2, "random"),
    ("empty_experts", 11, 24, 10, 8, 2, "half_empty"),
    ("one_expert_takes_all", 10, 20, 9, 5, 1, "one_expert"),
    ("topk1", 7, 18, 6, 3, 1, "random"),
    ("T1", 1, 10, 7, 4, 3, "random"),
]
DROPPED = ("dropped_slots", 13, 15, 11, 6, 3, "dropped")
IDS = [case[0] for case in ROUTINGS]


def routing(T, E, topk, kind, gen):
    """topk ids [T, topk] int64 and positive scores [T, topk] float64."""
    return make_ids(T, E, topk, kind, gen), torch.rand(T, topk, generator=gen, dtype=torch.float64) + 0.05


def randn(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()


def grads(fn, leaves, dout):
    """{"out": fn(), name: d<dout, fn()>/d leaf} for the named leaves (tensors requiring grad)."""
    out = fn()
    out = out[0] if isinstance(out, tuple) else out
    computed = torch.autograd.grad(out, list(leaves.values()), dout, allow_unused=True)
    return {"out": out.detach(), **dict(zip(leaves, computed))}


def record_needs(monkeypatch, owner, op_name):
    """The need_* flags each call of backward op `owner.op_name` (an OpFamily's backward_op) is asked for, as a list
    of sets (one per call)."""
    asked = []
    original = getattr(owner, op_name)

    def recording(*args, **kwargs):
        asked.append({name for name, value in kwargs.items() if name.startswith("need_") and value})
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, op_name, recording)
    return asked


def assert_close(ours, theirs, bound=1e-12):
    assert ours.keys() == theirs.keys()
    for name, expected in theirs.items():
        got = ours[name]
        assert got is not None and expected is not None, name
        assert got.shape == expected.shape and got.dtype == expected.dtype, f"{name}: {got.shape} {expected.shape}"
        if expected.abs().max() == 0:
            assert got.abs().max() == 0, name
        else:
            assert rel_err(got, expected) < bound, f"{name}: {rel_err(got, expected):.3e}"


def sort_by_expert(x, ids, scores):
    """Rows grouped by expert as a framework's local dispatcher makes them (stable argsort of the flat ids, dropped
    slots left out): x_sorted [R, H], counts [E] (int64), scores_sorted [R], token_of_row [R]."""
    flat = ids.reshape(-1)
    kept = (flat >= 0).nonzero().squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    token_of_row = order // ids.shape[1]
    return x[token_of_row], order, scores.reshape(-1)[order], token_of_row


def counts_of(ids, E):
    flat = ids.reshape(-1)
    return torch.bincount(flat[flat >= 0], minlength=E)


def grouped_swiglu(x_sorted, counts, gate, up, down, gate_bias=None, up_bias=None, down_bias=None, act=None):
    """Per-expert loop over rows grouped by expert (padding rows past the counts' sum: 0), each expert
    down[e] @ act(gate[e] @ x + gb, up[e] @ x + ub) + db with weights [E, out, in] (each bias optional);
    act default silu(g) * u."""
    act = act or (lambda g, u: F.silu(g) * u)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x_sorted[start:start + n]
        g, u = rows @ gate[e].T, rows @ up[e].T
        g = g if gate_bias is None else g + gate_bias[e]
        u = u if up_bias is None else u + up_bias[e]
        o = act(g, u) @ down[e].T
        outs.append(o + down_bias[e] if down_bias is not None else o)
        start += n
    out = torch.cat(outs) if outs else x_sorted[:0]
    return torch.cat([out, x_sorted.new_zeros(x_sorted.shape[0] - start, x_sorted.shape[1])])


def gpt_oss_act(limit=7.0, alpha=1.702):
    def act(g, u):
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * (u + 1)
    return act
