"""The expert-parallel checks on one GPU: a group of size 1 over NCCL (spawned by test_ep_cuda.py), where the local
shard is the whole weight, against megamoe.moe on the same GPU. bf16: grouped rows round each row's s_r o_r before
the topk sum (the whole layer sums in f32 first), so the two agree to bf16 rounding, not bitwise; the chunked and
unchunked paths, and two runs, agree bitwise on y, dx and d topk_weights."""

import warnings

import torch

import megamoe
from ep_cases import NAMES, assert_bitwise, expert_parallel, expert_parallel_main_grads, make_batch, reference, rel_err

AGREEMENT = 1e-2  # as the grouped-rows GPU tests: a wrong row, expert or score gives errors of order 1


def _on_gpu(ranks, w13, w2):
    move = lambda t: t.cuda()  # noqa: E731
    return [tuple(move(t) for t in r) for r in ranks], move(w13), move(w2)


def case_equals_whole_layer_and_chunks_agree(rank, P, seed):
    ranks, w13, w2 = _on_gpu(*make_batch(P, [150], 72, 40, 4, 2, seed, dtype=torch.bfloat16))
    want = reference(ranks, w13, w2, rank, 4)
    one = expert_parallel(ranks, w13, w2, rank, 4)
    for name, a, b in zip(NAMES, one, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < AGREEMENT, f"{name}: {rel_err(a, b):.3e}"
    assert_bitwise(expert_parallel(ranks, w13, w2, rank, 4), one, what="run to run: ")
    for chunks in (2, 5):
        assert_bitwise(expert_parallel(ranks, w13, w2, rank, 4, num_chunks=chunks), one,
                       ("y", "dx", "dtopk_weights"), f"num_chunks={chunks}: ")


def case_one_host_sync_in_the_forward_none_in_the_backward(rank, P, seed):
    ranks, w13, w2 = _on_gpu(*make_batch(P, [64], 72, 40, 4, 2, seed, dtype=torch.bfloat16))
    x, ids, s, dy = ranks[rank]
    x = x.clone().requires_grad_()
    megamoe.ep.moe(x, ids, s, w13, w2).backward(dy)  # warm-up: the gloo twin group is made on the first call
    torch.cuda.synchronize()
    syncs = []
    for step in ("forward", "backward"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if step == "forward":
                    y = megamoe.ep.moe(x, ids, s, w13, w2)
                else:
                    y.backward(dy)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # the sync warnings themselves; set_sync_debug_mode also warns once per process that it is a prototype
        syncs.append([f"{w.filename}:{w.lineno}" for w in caught
                      if "called a synchronizing CUDA operation" in str(w.message)])
    assert [len(s) for s in syncs] == [1, 0], f"host synchronisations (forward, backward), at: {syncs}"


def case_bad_ids_raise(rank, P, seed):
    ranks, w13, w2 = _on_gpu(*make_batch(P, [8], 72, 40, 4, 2, seed, dtype=torch.bfloat16))
    x, ids, s, _ = ranks[rank]
    ids = ids.clone()
    ids[2, 1] = 4
    try:
        megamoe.ep.moe(x, ids, s, w13, w2)
    except ValueError as ex:
        assert "topk_ids" in str(ex), str(ex)
        return
    raise AssertionError("no ValueError for an id = E")


def case_empty_batch(rank, P, seed):
    ranks, w13, w2 = _on_gpu(*make_batch(P, [0], 72, 40, 4, 2, seed, dtype=torch.bfloat16))
    y, dx, ds, dw13, dw2 = expert_parallel(ranks, w13, w2, rank, 4)
    assert y.shape == (0, 72) and torch.equal(dw13, torch.zeros_like(dw13)) and torch.equal(dw2, torch.zeros_like(dw2))


def case_main_grads(rank, P, seed):
    """main_grads on the GPU: f32 buffers get the weight gradients (bf16 weights: the f32 gradient the bf16 .grad
    rounds), .grad stays None, y / dx / d topk_weights bitwise the call's without them, buffers bitwise run to run;
    a bad buffer raises ValueError."""
    ranks, w13, w2 = _on_gpu(*make_batch(P, [150], 72, 40, 4, 2, seed, dtype=torch.bfloat16))
    for chunks in (1, 3):
        what = f"num_chunks={chunks}: "
        plain = expert_parallel(ranks, w13, w2, rank, 4, num_chunks=chunks)
        runs = []
        for _ in range(2):
            buffers = tuple(torch.full(w.shape, 0.5, device="cuda") for w in (w13, w2))
            got = expert_parallel_main_grads(ranks, w13, w2, rank, 4, buffers, num_chunks=chunks)
            assert got[3] is None and got[4] is None, f"{what}.grad of weights with buffers"
            assert_bitwise(got[:3], plain[:3], ("y", "dx", "dtopk_weights"), what)
            runs.append(buffers)
        for name, a, b, grad in zip(("w13", "w2"), *runs, plain[3:]):
            assert torch.equal(a, b), f"{what}{name}: buffers differ run to run"
            assert rel_err(a - 0.5, grad) < AGREEMENT, f"{what}{name}: {rel_err(a - 0.5, grad):.3e}"
    x, ids, s, _ = ranks[rank]
    try:
        megamoe.ep.moe(x, ids, s, w13, w2, main_grads=(torch.zeros(w13.shape, device="cuda").bfloat16(),))
    except ValueError as ex:
        assert "main_grads" in str(ex) and "float32" in str(ex), str(ex)
    else:
        raise AssertionError("no ValueError for a bf16 buffer")


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
