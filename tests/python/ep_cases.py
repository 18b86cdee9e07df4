"""The expert-parallel checks that run inside a gloo process group (spawned by test_ep.py): each rank builds every
rank's tokens from one seed, so it can compute the reference, `megamoe.moe` with the full weights on the
concatenated batch, by itself (y, dx, d topk_weights: its tokens' rows; dw13, dw2: its experts' slice, which sums
every rank's tokens). float64 through the CPU reference.

Each case returns normally or raises AssertionError; run_cases records the outcome per case, so a failing
assertion on one rank (raised after every collective of its case) never leaves the others waiting.
"""

import datetime
import importlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import megamoe

TOL = 1e-12  # relative error against the full-weight reference (float64; sums in another order)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def make_batch(P, tokens, H, I, E_l, topk, seed, routing="random", dtype=torch.float64, ids_dtype=torch.int64):
    """Every rank's (x, topk_ids, topk_weights, dy) and the full w13 [E, 2I, H], w2 [E, H, I], from one seed.
    routing: random (about a quarter of the slots dropped, one token with every slot dropped), full (none dropped)
    or idle_last (the last rank's experts are never picked)."""
    gen = torch.Generator().manual_seed(seed)
    E = P * E_l
    w13 = (torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen, dtype=torch.float64) / I**0.5).to(dtype)
    pool = E - E_l if routing == "idle_last" else E
    ranks = []
    for T in tokens:
        x = (torch.randn(T, H, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
        ids = torch.rand(T, pool, generator=gen).argsort(dim=1)[:, :topk]  # distinct experts per token
        if routing == "random":
            ids[torch.rand(T, topk, generator=gen) < 0.25] = -1
            ids[:1] = -1
        s = torch.rand(T, topk, generator=gen, dtype=torch.float64) + 0.05
        dy = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dtype)
        ranks.append((x, ids.to(ids_dtype), s.to(torch.float32 if dtype != torch.float64 else dtype), dy))
    return ranks, w13, w2


def grads(fn, x, ids, s, w13, w2, dy):
    """[y, dx, d topk_weights, dw13, dw2] of <dy, fn(x, ids, s, w13, w2)> on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, s, w13, w2)]
    y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def reference(ranks, w13, w2, rank, E_l):
    """megamoe.moe with the full weights on the concatenated batch: this rank's rows and experts."""
    cat = [torch.cat([r[i] for r in ranks]) for i in range(4)]
    y, dx, ds, dw13, dw2 = grads(megamoe.moe, cat[0], cat[1], cat[2], w13, w2, cat[3])
    start = sum(r[0].shape[0] for r in ranks[:rank])
    rows = slice(start, start + ranks[rank][0].shape[0])
    experts = slice(rank * E_l, (rank + 1) * E_l)
    return [y[rows], dx[rows], ds[rows], dw13[experts], dw2[experts]]


def expert_parallel(ranks, w13, w2, rank, E_l, **kwargs):
    x, ids, s, dy = ranks[rank]
    experts = slice(rank * E_l, (rank + 1) * E_l)
    fn = lambda x, ids, s, a, b: megamoe.ep.moe(x, ids, s, a, b, **kwargs)  # noqa: E731
    return grads(fn, x, ids, s, w13[experts], w2[experts], dy)


NAMES = ("y", "dx", "dtopk_weights", "dw13", "dw2")


def assert_close(ours, want, tol=TOL, what=""):
    for name, a, b in zip(NAMES, ours, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}{name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        if b.numel() and b.abs().max() > 0:
            assert rel_err(a, b) < tol, f"{what}{name}: relative error {rel_err(a, b):.3e}"
        else:
            assert torch.equal(a, torch.zeros_like(a)), f"{what}{name}: expected exact zeros"


def assert_bitwise(ours, want, names=NAMES, what=""):
    for name, a, b in zip(NAMES, ours, want):
        if name in names:
            assert torch.equal(a, b), f"{what}{name}: not bitwise equal (max diff {(a - b).abs().max():.3e})"


def tokens_for(P):
    """Uneven tokens per rank; with 4 ranks one rank has none."""
    return [9, 4] if P == 2 else [6, 0, 11, 3]


# ---- the cases: case(rank, P, seed) ----

def case_uneven_tokens_dropped_slots(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 12, 7, 2, 3, seed)
    ours, want = expert_parallel(ranks, w13, w2, rank, 2), reference(ranks, w13, w2, rank, 2)
    assert_close(ours, want)
    assert_bitwise(ours, want, ("y",), "against the whole layer: ")  # the reference's per-slot math, same order


def case_rank_whose_experts_get_nothing(rank, P, seed):
    ranks, w13, w2 = make_batch(P, [5] * P, 10, 6, 2, 2, seed, routing="idle_last")
    ours = expert_parallel(ranks, w13, w2, rank, 2)
    assert_close(ours, reference(ranks, w13, w2, rank, 2))
    if rank == P - 1:
        assert torch.equal(ours[3], torch.zeros_like(ours[3])) and torch.equal(ours[4], torch.zeros_like(ours[4]))


def case_chunked_equals_unchunked(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 12, 5, 2, 3, seed)
    one = expert_parallel(ranks, w13, w2, rank, 2, num_chunks=1)
    assert_close(one, reference(ranks, w13, w2, rank, 2))
    for chunks in (2, 3, 7):  # 7: more chunks than tokens on some ranks (empty chunks)
        many = expert_parallel(ranks, w13, w2, rank, 2, num_chunks=chunks)
        assert_bitwise(many, one, ("y", "dx", "dtopk_weights"), f"num_chunks={chunks}: ")
        assert_close(many, one, what=f"num_chunks={chunks}: ")


def case_bitwise_run_to_run(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 8, 5, 1, 2, seed)
    for chunks in (1, 3):
        first = expert_parallel(ranks, w13, w2, rank, 1, num_chunks=chunks)
        assert_bitwise(expert_parallel(ranks, w13, w2, rank, 1, num_chunks=chunks), first, what=f"C={chunks}: ")


def case_recompute_mode_and_int32_ids(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 9, 4, 3, 2, seed, ids_dtype=torch.int32)
    keep = expert_parallel(ranks, w13, w2, rank, 3)
    assert_close(keep, reference(ranks, w13, w2, rank, 3))
    assert_bitwise(expert_parallel(ranks, w13, w2, rank, 3, recompute=True, num_chunks=2), keep,
                   ("y", "dx", "dtopk_weights"), "recompute: ")


def case_bf16_close_to_whole_layer(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 32, 16, 2, 2, seed, dtype=torch.bfloat16)
    ours = expert_parallel(ranks, w13, w2, rank, 2, num_chunks=2)
    assert_close(ours, reference(ranks, w13, w2, rank, 2), tol=2e-2, what="bf16: ")


def case_no_grad_and_unused_inputs(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 8, 4, 1, 2, seed)
    x, ids, s, _ = ranks[rank]
    with torch.no_grad():
        y = megamoe.ep.moe(x, ids, s, w13[rank:rank + 1], w2[rank:rank + 1])
    assert not y.requires_grad and rel_err(y, reference(ranks, w13, w2, rank, 1)[0]) < TOL
    w13_l = w13[rank:rank + 1].clone().requires_grad_()  # only the weights want gradients
    megamoe.ep.moe(x, ids, s, w13_l, w2[rank:rank + 1]).sum().backward()
    assert w13_l.grad is not None and w13_l.grad.shape == w13_l.shape


def case_module_matches_whole_layer(rank, P, seed):
    torch.manual_seed(seed)
    full = megamoe.MoEExperts(2 * P, 10, 6, dtype=torch.float64, init_std=0.3)
    shard = megamoe.ep.MoEExperts.from_full(full.w13, full.w2, num_chunks=2)
    assert shard.w13_local.shape == (2, 12, 10) and shard.w2_local.shape == (2, 10, 6)
    assert {n for n, _ in shard.named_parameters()} == {"w13_local", "w2_local"}
    fresh = megamoe.ep.MoEExperts(2 * P, 10, 6, dtype=torch.float64)
    assert fresh.w13_local.std().item() > 0 and "local_experts=" in repr(fresh)
    ranks, _, _ = make_batch(P, tokens_for(P), 10, 6, 2, 2, seed + 1)
    x, ids, s, dy = ranks[rank]
    T = x.shape[0]
    x = x.view(1, T, 10).requires_grad_()  # [B, S, H]
    shard(x, ids.view(1, T, 2), s.view(1, T, 2)).backward(dy.view(1, T, 10))
    want = reference(ranks, full.w13.detach(), full.w2.detach(), rank, 2)
    got = [None, x.grad.view(-1, 10), None, shard.w13_local.grad, shard.w2_local.grad]
    for name, a, b in zip(NAMES, got, want):
        if a is not None:
            assert rel_err(a, b) < TOL or b.abs().max() == 0 and a.abs().max() == 0, name


# ---- Hugging Face transformers' expert parallelism with megamoe ----

def _hf_grads(module, x, ids, s, dy):
    """[y, dx, d routing weights, d gate_up_proj, d down_proj] (local shards of DTensor gradients)."""
    x, s = x.clone().requires_grad_(), s.clone().requires_grad_()
    y = module(x, ids, s)
    y.backward(dy)
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in (module.gate_up_proj,
                                                                                    module.down_proj)]
    return [y.detach(), x.grad, s.grad] + local


def case_hf_expert_parallel(rank, P, seed):
    try:
        import megamoe.hf  # noqa: F401  registers experts_implementation / ep_implementation "megamoe"
        from transformers import Qwen3MoeConfig
        from transformers.distributed.expert_parallel import apply_expert_parallelism
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError as ex:
        raise SkipCase(f"transformers with transformers.distributed.expert_parallel is not importable: {ex}")
    from torch.distributed.device_mesh import init_device_mesh

    E_l, H, I, topk = 2, 12, 6, 2
    ranks, w13, w2 = make_batch(P, tokens_for(P), H, I, E_l, topk, seed, routing="full")  # HF never drops slots

    def experts(impl):
        config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=P * E_l,
                                num_experts_per_tok=topk, experts_implementation=impl)
        holder = torch.nn.Module()
        holder.experts = Qwen3MoeExperts(config).double()
        with torch.no_grad():
            holder.experts.gate_up_proj.copy_(w13)
            holder.experts.down_proj.copy_(w2)
        return holder

    plan = {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm",
            "experts": "ep_dispatch_experts"}
    batch = [torch.cat([r[i] for r in ranks]) for i in range(4)]
    full = _hf_grads(experts("eager").experts, *batch)  # HF's own eager experts, full weights, every rank's tokens
    start = sum(r[0].shape[0] for r in ranks[:rank])
    rows, own = slice(start, start + ranks[rank][0].shape[0]), slice(rank * E_l, (rank + 1) * E_l)
    want = [full[0][rows], full[1][rows], full[2][rows], full[3][own], full[4][own]]
    mesh = init_device_mesh("cpu", (P, 1), mesh_dim_names=("ep", "tp"))
    for impl in ("megamoe", "all_to_all"):  # megamoe.ep's dispatch; HF's all-to-all calling megamoe's experts
        holder = apply_expert_parallelism(experts("megamoe"), mesh["ep"], mesh["tp"], plan, ep_implementation=impl)
        assert_close(_hf_grads(holder.experts, *ranks[rank]), want, what=f"ep_implementation={impl}: ")
    # HF's all_reduce: every rank the whole batch, other ranks' slots as the sentinel id num_local_experts (weight 0)
    shared = init_device_mesh("cpu", (P,), mesh_dim_names=("ep",))
    holder = apply_expert_parallelism(experts("megamoe"), shared, shared, plan, ep_implementation="all_reduce")
    got = _hf_grads(holder.experts, *batch)
    assert_close(got, full[:3] + [full[3][own], full[4][own]], what="ep_implementation=all_reduce: ")


# ---- bad input: the same error on every rank, and the group still works afterwards ----

def _raises(fn, kind, *texts):
    try:
        fn()
    except kind as ex:
        for text in texts:
            assert text in str(ex), f"{kind.__name__} without {text!r}: {ex}"
        return
    raise AssertionError(f"no {kind.__name__} raised (expected one naming {texts})")


def case_bad_input_raises_on_every_rank(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 8, 4, 2, 2, seed)
    x, ids, s, _ = ranks[rank]
    a, b = w13[2 * rank:2 * rank + 2], w2[2 * rank:2 * rank + 2]
    moe = megamoe.ep.moe
    _raises(lambda: moe(x, ids, s, a, b, num_experts=2 * P + 1), ValueError, "num_experts")
    _raises(lambda: moe(x, ids, s, a, b, num_experts=4 * P), ValueError, "num_experts")
    _raises(lambda: megamoe.ep.MoEExperts(2 * P + 1, 8, 4), ValueError, "num_experts", "divisible")
    last = rank == P - 1
    too_high, too_low = ids.clone(), ids.clone()
    if last:
        too_high.view(-1)[0] = 2 * P  # one id = E, on the last rank only
    if rank == 0:
        too_low.view(-1)[-1] = -2
    _raises(lambda: moe(x, too_high, s, a, b), ValueError, "topk_ids", f"rank {P - 1}")
    _raises(lambda: moe(x, too_low, s, a, b), ValueError, "topk_ids", "rank 0")
    wrong_s = s[:, :1] if rank == 0 else s
    _raises(lambda: moe(x, ids, wrong_s, a, b), ValueError, "topk_weights")
    _raises(lambda: moe(x, ids, s, a, b, num_chunks=2 if rank == 0 else 1), ValueError, "num_chunks")
    _raises(lambda: moe(x, ids, s, a, b, num_chunks=0), ValueError, "num_chunks")
    # hidden / intermediate / experts per rank differ on the last rank
    wide_x = torch.cat([x, x[:, :1]], 1) if last else x
    wide_w13 = torch.cat([a, a[:, :, :1]], 2) if last else a
    wide_w2 = torch.cat([b, b[:, :1]], 1) if last else b
    _raises(lambda: moe(wide_x, ids, s, wide_w13, wide_w2), ValueError, "hidden", "x")
    _raises(lambda: moe(x, ids, s, a[:, 2:] if last else a, b[:, :, 1:] if last else b), ValueError, "w2_local")
    _raises(lambda: moe(x, ids, s, a[:1] if last else a, b[:1] if last else b), ValueError, "w13_local")
    _raises(lambda: moe(x, ids.float() if rank == 0 else ids, s, a, b), TypeError, "topk_ids")
    grad_a = a.clone().requires_grad_(rank == 0)
    _raises(lambda: moe(x, ids, s, grad_a, b), ValueError, "gradient mode")
    _raises(lambda: moe(x, ids, s, a, b, precision="e5m2" if last else "bf16"), ValueError, "precision")
    _raises(lambda: moe(x, ids, s, a, b, precision="fp8" if rank == 0 else "bf16"), ValueError, "precision")
    case_uneven_tokens_dropped_slots(rank, P, seed)  # the group is still in step


def case_fp8_on_cpu_is_not_supported_on_every_rank(rank, P, seed):
    """precision="fp8" reaches the library's FP8 path (CUDA on sm_90 only): on CPU every rank raises its
    NotImplementedError naming FP8, and the group stays in step."""
    ranks, w13, w2 = make_batch(P, tokens_for(P), 128, 128, 2, 2, seed, dtype=torch.bfloat16)
    x, ids, s, _ = ranks[rank]
    a, b = w13[2 * rank:2 * rank + 2], w2[2 * rank:2 * rank + 2]
    _raises(lambda: megamoe.ep.moe(x, ids, s, a, b, precision="fp8"), NotImplementedError, "FP8")
    shard = megamoe.ep.MoEExperts(2 * P, 128, 128, dtype=torch.bfloat16, precision="fp8")
    assert "precision='fp8'" in repr(shard)
    _raises(lambda: shard(x, ids, s), NotImplementedError, "FP8")
    case_uneven_tokens_dropped_slots(rank, P, seed)


# ---- main_grads: the local weights' gradients added into f32 buffers ----

def initial_buffers(w13_l, w2_l, seed):
    """Random f32 buffers shaped as the local weights (never zeros, so an addition shows)."""
    gen = torch.Generator().manual_seed(seed + 12)
    return tuple(torch.randn(w.shape, generator=gen, dtype=torch.float64).float() for w in (w13_l, w2_l))


def expert_parallel_main_grads(ranks, w13, w2, rank, E_l, main_grads, requires=(True, True), **kwargs):
    """[y, dx, d topk_weights, w13_local.grad, w2_local.grad] of one call with main_grads, on fresh leaves (the
    weights requiring grad as `requires` says)."""
    x, ids, s, dy = ranks[rank]
    experts = slice(rank * E_l, (rank + 1) * E_l)
    x, s = (t.detach().clone().requires_grad_() for t in (x, s))
    a, b = (w[experts].detach().clone().requires_grad_(want) for w, want in zip((w13, w2), requires))
    y = megamoe.ep.moe(x, ids, s, a, b, main_grads=main_grads, **kwargs)
    y.backward(dy)
    return [y.detach(), x.grad, s.grad, a.grad, b.grad]


def assert_added(buffer, before, grad, times=1, what=""):
    """buffer = before + times * grad up to f32 rounding (relative to the sizes of before and grad)."""
    error = (buffer.double() - before.double() - times * grad.double()).norm().item()
    scale = before.double().norm().item() + times * grad.double().norm().item()
    assert error <= 1e-6 * scale, f"{what}buffer - before is not {times} x the gradient: {error:.3e} / {scale:.3e}"


def case_main_grads_add_the_gradient(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 12, 7, 2, 3, seed)
    for chunks in (1, 3):
        what = f"num_chunks={chunks}: "
        plain = expert_parallel(ranks, w13, w2, rank, 2, num_chunks=chunks)
        buffers = initial_buffers(w13[:2], w2[:2], seed)
        before = [b.clone() for b in buffers]
        got = expert_parallel_main_grads(ranks, w13, w2, rank, 2, buffers, num_chunks=chunks)
        assert got[3] is None and got[4] is None, f"{what}autograd gradients of weights with buffers: not None"
        assert_bitwise(got[:3], plain[:3], ("y", "dx", "dtopk_weights"), what)
        for name, buffer, start, grad in zip(("w13", "w2"), buffers, before, plain[3:]):
            assert buffer.dtype == torch.float32 and buffer.shape == start.shape
            assert_added(buffer, start, grad, what=f"{what}{name}: ")
            if chunks == 1:  # one epilogue addition of the f32-rounded gradient
                assert torch.equal(buffer, start + grad.float()), f"{what}{name}: not bitwise before + grad"
        # two backwards (a second call into the same buffers) add twice
        got = expert_parallel_main_grads(ranks, w13, w2, rank, 2, {"w13": buffers[0], "w2_local": buffers[1]},
                                         num_chunks=chunks)
        assert got[3] is None and got[4] is None
        for name, buffer, start, grad in zip(("w13", "w2"), buffers, before, plain[3:]):
            assert_added(buffer, start, grad, times=2, what=f"{what}twice: {name}: ")
        # bitwise reproducible run to run for this num_chunks
        again = initial_buffers(w13[:2], w2[:2], seed)
        for _ in range(2):
            expert_parallel_main_grads(ranks, w13, w2, rank, 2, again, num_chunks=chunks)
        for name, a, b in zip(("w13", "w2"), again, buffers):
            assert torch.equal(a, b), f"{what}{name}: buffers differ run to run"


def case_main_grads_recompute_backward_twice(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 9, 4, 1, 2, seed)
    x, ids, s, dy = ranks[rank]
    plain = expert_parallel(ranks, w13, w2, rank, 1, num_chunks=2)
    buffers = initial_buffers(w13[:1], w2[:1], seed)
    before = [b.clone() for b in buffers]
    a, b = (w[rank:rank + 1].clone().requires_grad_() for w in (w13, w2))
    y = megamoe.ep.moe(x, ids, s, a, b, num_chunks=2, recompute=True, main_grads=buffers)
    y.backward(dy, retain_graph=True)
    y.backward(dy)  # one graph backpropagated twice adds twice
    assert a.grad is None and b.grad is None
    for name, buffer, start, grad in zip(("w13", "w2"), buffers, before, plain[3:]):
        assert_added(buffer, start, grad, times=2, what=f"{name}: ")
    a, b = (w[rank:rank + 1].clone().requires_grad_() for w in (w13, w2))  # and without main_grads: .grad twice
    y = megamoe.ep.moe(x, ids, s, a, b, num_chunks=2, recompute=True)
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    for name, got, grad in zip(("w13", "w2"), (a.grad, b.grad), plain[3:]):
        assert torch.equal(got, grad + grad), f"{name}.grad after two backwards"


def case_main_grads_partial_and_frozen(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 10, 6, 2, 2, seed)
    plain = expert_parallel(ranks, w13, w2, rank, 2, num_chunks=2)
    buf13, buf2 = initial_buffers(w13[:2], w2[:2], seed)
    start13, start2 = buf13.clone(), buf2.clone()
    # a buffer for w13 only: w2 gets its usual autograd gradient (through an f32 buffer, as in megamoe.moe)
    got = expert_parallel_main_grads(ranks, w13, w2, rank, 2, (buf13,), num_chunks=2)
    assert got[3] is None and got[4] is not None and got[4].dtype == w2.dtype
    assert_bitwise(got[:3], plain[:3], ("y", "dx", "dtopk_weights"), "w13 buffer only: ")
    assert_added(buf13, start13, plain[3], what="w13 buffer only: ")
    assert rel_err(got[4], plain[4]) < 1e-6 or torch.equal(got[4], plain[4]), "w2 without a buffer"
    # a frozen weight with a buffer: nothing added into it; the other buffer gets its gradient
    start13 = buf13.clone()
    got = expert_parallel_main_grads(ranks, w13, w2, rank, 2, (buf13, buf2), requires=(False, True), num_chunks=2)
    assert got[3] is None and got[4] is None
    assert torch.equal(buf13, start13), "a frozen w13's buffer changed"
    assert_added(buf2, start2, plain[4], what="frozen w13: w2: ")
    assert_bitwise(got[:3], plain[:3], ("y", "dx", "dtopk_weights"), "frozen w13: ")


def case_main_grads_module(rank, P, seed):
    torch.manual_seed(seed)
    full = megamoe.MoEExperts(2 * P, 10, 6, dtype=torch.float64, init_std=0.3)
    plain, fused = (megamoe.ep.MoEExperts.from_full(full.w13, full.w2, num_chunks=2) for _ in range(2))
    ranks, _, _ = make_batch(P, tokens_for(P), 10, 6, 2, 2, seed + 1)
    x, ids, s, dy = ranks[rank]
    buffers = {name: torch.zeros_like(getattr(fused, name), dtype=torch.float32) for name in ("w13_local", "w2_local")}
    plain(x, ids, s).backward(dy)
    fused(x, ids, s, main_grads=buffers).backward(dy)
    for name, buffer in buffers.items():
        assert getattr(fused, name).grad is None, f"{name}.grad is not None"
        assert_added(buffer, torch.zeros_like(buffer), getattr(plain, name).grad, what=f"{name}: ")


def case_main_grads_bf16(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 32, 16, 2, 2, seed, dtype=torch.bfloat16)
    for chunks in (1, 2):
        plain = expert_parallel(ranks, w13, w2, rank, 2, num_chunks=chunks)
        buffers = tuple(torch.zeros(w[:2].shape) for w in (w13, w2))
        got = expert_parallel_main_grads(ranks, w13, w2, rank, 2, buffers, num_chunks=chunks)
        assert_bitwise(got[:3], plain[:3], ("y", "dx", "dtopk_weights"), f"bf16, num_chunks={chunks}: ")
        for name, buffer, grad in zip(("w13", "w2"), buffers, plain[3:]):
            if grad.abs().max() > 0:
                assert rel_err(buffer, grad) < 1e-2, f"bf16, num_chunks={chunks}: {name}: {rel_err(buffer, grad):.3e}"
            else:
                assert torch.equal(buffer, torch.zeros_like(buffer)), name


def case_main_grads_bad_buffer_raises_on_every_rank(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), 8, 4, 2, 2, seed)
    x, ids, s, _ = ranks[rank]
    a, b = (w[2 * rank:2 * rank + 2].clone().requires_grad_() for w in (w13, w2))
    good = tuple(torch.zeros(w.shape) for w in (a, b))
    first, last = rank == 0, rank == P - 1

    def call(bad, on_this_rank):
        return lambda: megamoe.ep.moe(x, ids, s, a, b, main_grads=bad if on_this_rank else good)

    _raises(call((good[0][:1], good[1]), first), ValueError, "main_grads", "w13", "shape")
    _raises(call((good[0], good[1].double()), last), ValueError, "main_grads", "w2", "float32")
    _raises(call({"w3": good[0]}, first), ValueError, "main_grads", "w3")
    _raises(call({"w1": good[0]}, last), ValueError, "main_grads", "unknown")
    strided = torch.zeros(a.shape[0], a.shape[2], a.shape[1]).transpose(1, 2)  # a's shape, not contiguous
    _raises(call((strided,), first), ValueError, "main_grads", "contiguous")
    _raises(call((good[0].clone().requires_grad_(),), last), ValueError, "main_grads", "requires grad")
    _raises(call([1.0, 2.0], first), TypeError, "main_grads")
    _raises(call("w13", last), TypeError, "main_grads")
    assert a.grad is None and torch.equal(good[0], torch.zeros_like(good[0]))
    case_main_grads_add_the_gradient(rank, P, seed)  # the group is still in step


class SkipCase(Exception):
    """Raised by a case that cannot run here; its message is the reason."""


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def run_cases(rank, P, init_file, seed, out_dir, names, backend="gloo", registry=__name__):
    """Spawned entry point: join the group (gloo; nccl: one GPU per rank), run the named cases of the module
    `registry` (its CASES) in order, write {case: None | "SKIP: reason" | failure}."""
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=60))
    cases = importlib.import_module(registry).CASES
    results = {}
    try:
        for name in names:
            try:
                cases[name](rank, P, seed)
                results[name] = None
            except SkipCase as ex:
                results[name] = f"SKIP: {ex}"
            except Exception:  # noqa: BLE001  recorded per case; the other ranks' outcome is theirs
                results[name] = traceback.format_exc(limit=6)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        # Every rank done with its collectives before any tears its groups down: a gloo peer closing its pairs while
        # another still sends aborts that one ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
    # Leave without the interpreter's shutdown: after a backward, destroying torch's and gloo's threads at exit races
    # (about 1 process in 7 aborted there, its results already written). The results are on disk (the file is
    # closed above) and the group is gone; only the output streams still need flushing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
