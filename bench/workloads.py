"""Benchmark inputs: the reference shapes of DESIGN.md §4, random data built as the baseline builds it, routings."""
from dataclasses import dataclass

import torch

import torch_moe_baseline as baseline

SHAPES = baseline.SHAPES  # name: (T, H, I, E, topk)
TEST_SHAPES = {"tiny": (64, 128, 96, 8, 2)}  # for runs of the benchmark flow on the CPU (bench.py --device cpu)
ROUTINGS = ("balanced", "skewed")
L2_BYTES = 60 * 10**6  # H200 L2 cache


@dataclass
class Case:
    """One benchmark problem. Leaves that get gradients have requires_grad set."""
    name: str
    routing: str
    x: torch.Tensor  # [T, H] bf16
    ids: torch.Tensor  # [T, topk] int64
    s: torch.Tensor  # [T, topk] f32 (topk_weights)
    w13: torch.Tensor  # [E, 2I, H] bf16
    w2: torch.Tensor  # [E, H, I] bf16
    dy: torch.Tensor  # [T, H] bf16

    @property
    def dims(self):
        T, H = self.x.shape
        E, I = self.w2.shape[0], self.w2.shape[2]
        return T, H, I, E, self.ids.shape[1]

    def leaves(self):
        return self.x, self.s, self.w13, self.w2

    def clear_grads(self):
        for t in self.leaves():
            t.grad = None


def flops(T, H, I, topk):
    """(forward, forward+backward) FLOPs of DESIGN §1: 6·T·topk·H·I and 3x that."""
    fwd = 6.0 * T * topk * H * I
    return fwd, 3.0 * fwd


def working_set_bytes(T, H, I, E):
    """Bytes one forward+backward touches at least once: x, dy, w13, w2 (bf16)."""
    return 2 * (2 * T * H + 3 * E * I * H)


def _randn_bf16(shape, scale, gen, device, chunk_elems=2**28):
    """bf16 tensor of randn * scale, drawn in fp32 in slices along dim 0 (no multi-GB fp32 temporary)."""
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    rows_per_chunk = max(1, chunk_elems // max(1, out[0].numel()))
    for r0 in range(0, shape[0], rows_per_chunk):
        r1 = min(shape[0], r0 + rows_per_chunk)
        out[r0:r1] = torch.randn((r1 - r0, *shape[1:]), device=device, generator=gen) * scale
    return out


def route_balanced(T, E, topk, gen, device):
    """The baseline's routing: softmax of random logits, top-k, renormalized."""
    logits = torch.randn(T, E, device=device, dtype=torch.float32, generator=gen)  # [T, E]
    w, ids = logits.softmax(-1).topk(topk, dim=-1)  # [T, topk]
    return ids, w / w.sum(-1, keepdim=True)


def route_skewed(T, E, topk, gen, device):
    """Every token picks one hot expert in slot 0; a third of the experts are never picked; the other slots pick
    distinct random experts among the rest. Weights: softmax of random logits at the picked experts, renormalized."""
    perm = torch.randperm(E, device=device, generator=gen)
    hot, pool = perm[0], perm[1 + E // 3:]  # perm[1 : 1 + E//3] are the never-picked experts
    assert pool.numel() >= topk - 1, "too few experts for skewed routing"
    pick = torch.rand(T, pool.numel(), device=device, generator=gen).argsort(-1)[:, :topk - 1]  # [T, topk-1]
    ids = torch.cat([hot.expand(T, 1), pool[pick]], dim=1)  # [T, topk]
    logits = torch.randn(T, E, device=device, dtype=torch.float32, generator=gen)  # [T, E]
    w = logits.softmax(-1).gather(1, ids)  # [T, topk]
    return ids, w / w.sum(-1, keepdim=True)


def make_case(name, dims, routing, device, seed=0):
    """Fresh random inputs as the baseline makes them: x*0.5, weights scaled 1/sqrt(fan_in), dy ~ N(0, 1)."""
    T, H, I, E, topk = dims
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    x = _randn_bf16((T, H), 0.5, gen, device)
    w13 = _randn_bf16((E, 2 * I, H), H ** -0.5, gen, device)
    w2 = _randn_bf16((E, H, I), I ** -0.5, gen, device)
    router = route_balanced if routing == "balanced" else route_skewed
    ids, s = router(T, E, topk, gen, device)
    dy = _randn_bf16((T, H), 1.0, gen, device)
    case = Case(name, routing, x, ids, s, w13, w2, dy)
    for t in case.leaves():
        t.requires_grad_()
    return case


def check_subsets(ids, E, n_tokens, seed=0):
    """Where correctness is checked: n_tokens random tokens (y, dx, d topk_weights) and up to 4 experts for the
    weight grads: the most loaded, the least loaded (often empty under skewed routing), and two random ones."""
    gen = torch.Generator().manual_seed(seed)
    ids = ids.cpu()
    T = ids.shape[0]
    tokens = torch.randperm(T, generator=gen)[:n_tokens].sort().values
    counts = torch.bincount(ids[ids >= 0], minlength=E)
    experts = [int(counts.argmax()), int(counts.argmin())]
    experts += [int(e) for e in torch.randperm(E, generator=gen) if int(e) not in experts][:2]
    return tokens, sorted(set(experts))
