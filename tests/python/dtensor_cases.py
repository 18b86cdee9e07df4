"""DTensor weights inside a gloo process group (spawned by test_dtensor.py through test_ep.py's harness; the cases
are run by ep_cases.run_cases): each entry point against the same call on the plain local tensors (outputs and
activation gradients bitwise equal; weight gradients DTensors with the weights' placements whose local values are
bitwise the plain call's), the placements each entry point refuses, and FSDP2 (`fully_shard`) around megamoe's
modules. float64 through the CPU reference.
"""

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import megamoe
from ep_cases import TOL, SkipCase, _raises, make_batch, rel_err, tokens_for

H, I, E_LOCAL, TOPK = 12, 7, 2, 3


@functools.cache
def mesh_of(shape, names=None):
    """A CPU DeviceMesh over the group's ranks, made once per process (each creation makes new process groups)."""
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def leaves(args, weights=(), mesh=None, placements=None):
    """Fresh leaves of the float tensors of `args` (the others as they are); those named in `weights` as DTensors
    with these local values, mesh and placements."""
    out = {}
    for name, tensor in args.items():
        if tensor is None or not tensor.is_floating_point():
            out[name] = tensor
        elif name in weights:
            out[name] = DTensor.from_local(tensor.detach().clone(), mesh, placements, run_check=False)
            out[name].requires_grad_()
        else:
            out[name] = tensor.detach().clone().requires_grad_()
    return out


def run(fn, args, dout, **options):
    """(out, {name: gradient}) of <dout, fn(**args, **options)> for the args that require grad."""
    out = fn(**args, **options)
    out.backward(dout)
    grads = {name: t.grad for name, t in args.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    return out.detach(), grads


def assert_like_plain(got, want, weights, placements, what=""):
    """got (DTensor weights) against want (the plain local weights): out and activation gradients bitwise equal;
    each weight's gradient a DTensor with `placements` and the plain gradient as its local value, bitwise."""
    (out, grads), (want_out, want_grads) = got, want
    assert torch.equal(out, want_out), f"{what}out differs (max {(out - want_out).abs().max():.3e})"
    assert grads.keys() == want_grads.keys(), f"{what}gradients of {sorted(grads)} vs {sorted(want_grads)}"
    for name, grad in grads.items():
        if name in weights:
            assert isinstance(grad, DTensor), f"{what}{name}.grad is a {type(grad).__name__}, not a DTensor"
            assert grad.placements == tuple(placements), f"{what}{name}.grad placements {grad.placements}"
            grad = grad.to_local()
        assert torch.equal(grad, want_grads[name]), f"{what}{name}.grad differs from the plain call's"


def compare(fn, args, dout, weights, mesh, placements, what="", **options):
    want = run(fn, leaves(args), dout, **options)
    got = run(fn, leaves(args, weights, mesh, placements), dout, **options)
    assert_like_plain(got, want, weights, placements, what)


def ep_problem(rank, P, seed):
    """This rank's megamoe.ep.moe arguments (its tokens; w13_local / w2_local: its experts), dy, the full weights."""
    ranks, w13, w2 = make_batch(P, tokens_for(P), H, I, E_LOCAL, TOPK, seed)
    x, ids, s, dy = ranks[rank]
    experts = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    args = dict(x=x, topk_ids=ids, topk_weights=s, w13_local=w13[experts], w2_local=w2[experts])
    return args, dy, w13, w2


def separate_experts(num_experts, gen):
    """torchtitan-style experts with biases: w13 (w1) and w3 [E, I, H], w2 [E, H, I], b13 [E, 2I], b2 [E, H]."""
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    return dict(w13=randn(num_experts, I, H, scale=H**-0.5), w3=randn(num_experts, I, H, scale=H**-0.5),
                w2=randn(num_experts, H, I, scale=I**-0.5), b13=randn(num_experts, 2 * I, scale=0.3),
                b2=randn(num_experts, H, scale=0.3))


EP_WEIGHTS = ("w13_local", "w2_local")
WEIGHTS = ("w13", "w2", "w3", "b13", "b2")


# ---- megamoe.ep.moe: this rank's experts ----

def case_ep_sharded_experts_equal_plain(rank, P, seed):
    args, dy, _, _ = ep_problem(rank, P, seed)
    for chunks in (1, 2):
        compare(megamoe.ep.moe, args, dy, EP_WEIGHTS, mesh_of((P,)), [Shard(0)], f"Shard(0), num_chunks={chunks}: ",
                num_chunks=chunks)
    # FSDP2's layout of an expert-parallel parameter on a (dp, ep) mesh: Replicate on dp, Shard(0) on ep
    mesh = mesh_of((1, P), ("dp", "ep"))
    compare(megamoe.ep.moe, args, dy, EP_WEIGHTS, mesh, [Replicate(), Shard(0)], "(Replicate, Shard(0)): ",
            group=mesh["ep"].get_group())


def case_ep_replicated_over_a_group_of_one(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), H, I, E_LOCAL, TOPK, seed)
    x, ids, s, dy = ranks[rank]
    mesh = mesh_of((P, 1), ("dp", "ep"))  # every expert on every rank, expert parallelism over one rank
    args = dict(x=x, topk_ids=ids, topk_weights=s, w13_local=w13, w2_local=w2)
    compare(megamoe.ep.moe, args, dy, EP_WEIGHTS, mesh, [Replicate(), Replicate()], group=mesh["ep"].get_group())


def case_ep_module_with_dtensor_parameters(rank, P, seed):
    torch.manual_seed(seed)
    full = megamoe.MoEExperts(E_LOCAL * P, H, I, dtype=torch.float64, init_std=0.3)
    plain, sharded = (megamoe.ep.MoEExperts.from_full(full.w13, full.w2) for _ in range(2))
    for name in EP_WEIGHTS:  # torchtitan's distribute_module: every expert, Shard(0) over the EP mesh
        local = getattr(sharded, name).detach()
        setattr(sharded, name, nn.Parameter(DTensor.from_local(local, mesh_of((P,)), [Shard(0)], run_check=False)))
    args, dy, _, _ = ep_problem(rank, P, seed + 1)
    inputs = dict(x=args["x"], topk_ids=args["topk_ids"], topk_weights=args["topk_weights"])
    results = [run(module, leaves(inputs), dy) for module in (plain, sharded)]
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1]["x"], results[0][1]["x"])
    for name in EP_WEIGHTS:
        grad = getattr(sharded, name).grad
        assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), name
        assert torch.equal(grad.to_local(), getattr(plain, name).grad), name


def case_ep_bad_placements_raise_on_every_rank(rank, P, seed):
    args, _, _, _ = ep_problem(rank, P, seed)
    mesh = mesh_of((P,))

    def call(placements=None, group=None, **changed):
        def fn():
            a = leaves({**args, **changed}, EP_WEIGHTS if placements else (), mesh, placements)
            megamoe.ep.moe(**a, group=group)
        return fn

    _raises(call([Replicate()]), ValueError, "w13_local", "replicated", "Shard(0)")
    _raises(call([Shard(1)] if rank == 0 else [Shard(0)]), ValueError, "w13_local", "Shard(0)")  # rank 0's alone
    _raises(call([Partial()]), ValueError, "w13_local", "Partial")
    own, _ = dist.new_subgroups(group_size=1)  # a group of one rank, the weights sharded over the whole mesh
    _raises(call([Shard(0)], group=own), ValueError, "w13_local", "mesh.get_group(0)")
    num_experts = E_LOCAL * P - 1  # torch.chunk's split: 2 experts per rank, 1 on the last
    local = args["w13_local"][:1] if rank == P - 1 else args["w13_local"]
    w13_uneven = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                    shape=torch.Size((num_experts, 2 * I, H)), stride=(2 * I * H, H, 1))
    _raises(lambda: megamoe.ep.moe(args["x"], args["topk_ids"], args["topk_weights"], w13_uneven, args["w2_local"]),
            ValueError, "w13_local", "unevenly")
    for name in ("x", "topk_weights"):
        activation = DTensor.from_local(args[name], mesh, [Shard(0)], run_check=False)
        _raises(call(**{name: activation}), TypeError, name, "DTensor")
    case_ep_sharded_experts_equal_plain(rank, P, seed)  # the group is still in step


def _no_grad(grad):
    """A weight given main_grads has no .grad; torch 2.11 (the oldest pyproject.toml accepts) gives a DTensor weight an
    all-zero DTensor one instead (torch 2.12 on: None)."""
    if grad is None:
        return True
    old_torch = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 12)
    return old_torch and isinstance(grad, DTensor) and not grad.to_local().any()


def case_ep_main_grads_with_dtensor_weights(rank, P, seed):
    """main_grads of DTensor weights: buffers shaped as the local shards, bitwise those of the plain local weights;
    the DTensors' .grad stays None; x / topk_weights gradients bitwise the call's without main_grads."""
    args, dy, _, _ = ep_problem(rank, P, seed)
    mesh = mesh_of((P,))
    gen = torch.Generator().manual_seed(seed + 3)
    start = [torch.randn(args[name].shape, generator=gen, dtype=torch.float64).float() for name in EP_WEIGHTS]
    for chunks in (1, 2):
        what = f"num_chunks={chunks}: "
        want_out, want_grads = run(megamoe.ep.moe, leaves(args), dy, num_chunks=chunks)
        plain_buffers, dtensor_buffers = [b.clone() for b in start], [b.clone() for b in start]
        plain_out, plain_grads = run(megamoe.ep.moe, leaves(args), dy, num_chunks=chunks, main_grads=plain_buffers)
        sharded = leaves(args, EP_WEIGHTS, mesh, [Shard(0)])
        out, grads = run(megamoe.ep.moe, sharded, dy, num_chunks=chunks,
                         main_grads=dict(zip(EP_WEIGHTS, dtensor_buffers)))
        assert torch.equal(out, want_out) and torch.equal(plain_out, want_out), f"{what}out"
        for name in ("x", "topk_weights"):
            assert torch.equal(grads[name], want_grads[name]), f"{what}{name}.grad"
            assert torch.equal(plain_grads[name], want_grads[name]), f"{what}{name}.grad (plain weights)"
        for name, a, b, s in zip(EP_WEIGHTS, dtensor_buffers, plain_buffers, start):
            assert plain_grads[name] is None and _no_grad(grads[name]), f"{what}{name}.grad is not None"
            assert torch.equal(a, b), f"{what}{name}: the DTensor's buffer differs from the plain weight's"
            want = s.double() + want_grads[name].double()
            assert rel_err(a, want) < 1e-6, f"{what}{name}: buffer - before is not the gradient"
    # a DTensor buffer (on one rank) raises TypeError on every rank
    bad = [DTensor.from_local(b.clone(), mesh, [Shard(0)], run_check=False) if rank == 0 else b.clone() for b in start]
    _raises(lambda: megamoe.ep.moe(**leaves(args, EP_WEIGHTS, mesh, [Shard(0)]), main_grads=bad), TypeError,
            "main_grads", "DTensor")
    # a buffer shaped as the global weight, not the local shard (on the last rank): ValueError on every rank
    wrong = [torch.zeros(P * b.shape[0], *b.shape[1:]) if rank == P - 1 else b.clone() for b in start]
    _raises(lambda: megamoe.ep.moe(**leaves(args, EP_WEIGHTS, mesh, [Shard(0)]), main_grads=wrong), ValueError,
            "main_grads", "shape")


# ---- megamoe.grouped_moe: the local experts ----

def grouped_problem(rank, seed, layout_args):
    """x_sorted [R, H] (2 padding rows), tokens_per_expert [E_LOCAL], scores [R], dout, this rank's experts."""
    gen = torch.Generator().manual_seed(seed + rank)
    counts = torch.tensor([4, 3] if rank % 2 else [0, 6])
    R = int(counts.sum()) + 2
    x = torch.randn(R, H, generator=gen, dtype=torch.float64) * 0.5
    scores = torch.rand(R, generator=gen, dtype=torch.float64) + 0.05
    args = dict(x_sorted=x, tokens_per_expert=counts, scores=scores, **layout_args(gen))
    return args, torch.randn(R, H, generator=gen, dtype=torch.float64)


def default_experts(gen):
    return dict(w13=torch.randn(E_LOCAL, 2 * I, H, generator=gen, dtype=torch.float64) * H**-0.5,
                w2=torch.randn(E_LOCAL, H, I, generator=gen, dtype=torch.float64) * I**-0.5)


def case_grouped_rows_on_local_experts(rank, P, seed):
    args, dout = grouped_problem(rank, seed, default_experts)
    compare(megamoe.grouped_moe, args, dout, WEIGHTS, mesh_of((P,)), [Shard(0)], "default layout: ")
    args, dout = grouped_problem(rank, seed, lambda gen: separate_experts(E_LOCAL, gen))
    compare(megamoe.grouped_moe, args, dout, WEIGHTS, mesh_of((P,)), [Shard(0)], "separate + biases: ",
            layout=megamoe.SEPARATE)
    a = leaves(args, WEIGHTS, mesh_of((P,)), [Shard(0)])
    assert megamoe.grouped_path_of(**a, layout=megamoe.SEPARATE) == "reference"


def case_grouped_rows_compiled(rank, P, seed):
    args, dout = grouped_problem(rank, seed, default_experts)
    compiled = torch.compile(megamoe.grouped_moe, fullgraph=True)
    want = run(megamoe.grouped_moe, leaves(args, WEIGHTS, mesh_of((P,)), [Shard(0)]), dout)
    got = run(compiled, leaves(args, WEIGHTS, mesh_of((P,)), [Shard(0)]), dout)
    assert_like_plain(got, (want[0], {name: g.to_local() if name in WEIGHTS else g for name, g in want[1].items()}),
                      WEIGHTS, [Shard(0)], "torch.compile(fullgraph=True): ")


def case_grouped_bad_placements_raise(rank, P, seed):
    args, _ = grouped_problem(rank, seed, default_experts)
    mesh = mesh_of((P,))
    a = leaves(args, WEIGHTS, mesh, [Shard(0)])
    mixed = dict(a, w2=DTensor.from_local(args["w2"], mesh, [Replicate()], run_check=False))
    _raises(lambda: megamoe.grouped_moe(**mixed), ValueError, "w2", "sharded alike")
    _raises(lambda: megamoe.grouped_moe(**leaves(args, WEIGHTS, mesh, [Shard(1)])), ValueError, "w13", "Shard(0)")
    for name in ("x_sorted", "tokens_per_expert", "scores"):
        activation = DTensor.from_local(args[name], mesh, [Shard(0)], run_check=False)
        _raises(lambda: megamoe.grouped_moe(**dict(a, **{name: activation})), TypeError, name, "DTensor")
    _raises(lambda: megamoe.grouped_backward(args["x_sorted"], **a), TypeError, "megamoe.grouped_backward: w13",
            "to_local")


# ---- megamoe.moe: every expert on every rank ----

def whole_layer_problem(rank, P, seed):
    ranks, w13, w2 = make_batch(P, tokens_for(P), H, I, E_LOCAL, TOPK, seed)
    x, ids, s, dy = ranks[rank]
    return dict(x=x, topk_ids=ids, topk_weights=s, w13=w13, w2=w2), dy


def case_replicated_weights_whole_layer(rank, P, seed):
    args, dy = whole_layer_problem(rank, P, seed)
    compare(megamoe.moe, args, dy, WEIGHTS, mesh_of((P,)), [Replicate()], "default layout: ")
    compare(megamoe.moe, args, dy, WEIGHTS, mesh_of((P,)), [Replicate()], "recompute: ", recompute=True)
    separate = separate_experts(E_LOCAL * P, torch.Generator().manual_seed(seed))
    args = {**args, **separate}
    compare(megamoe.moe, args, dy, WEIGHTS, mesh_of((1, P)), [Replicate(), Replicate()], "separate + biases: ",
            layout=megamoe.SEPARATE)
    a = leaves(args, WEIGHTS, mesh_of((P,)), [Replicate()])
    assert megamoe.path_of(**a, layout=megamoe.SEPARATE) == "reference"


def case_replicated_module_parameters(rank, P, seed):
    torch.manual_seed(seed)
    plain = megamoe.MoEExperts(E_LOCAL * P, H, I, dtype=torch.float64, init_std=0.3)
    replicated = megamoe.MoEExperts(E_LOCAL * P, H, I, dtype=torch.float64)
    for name in ("w13", "w2"):
        local = getattr(plain, name).detach().clone()
        setattr(replicated, name, nn.Parameter(DTensor.from_local(local, mesh_of((P,)), [Replicate()],
                                                                  run_check=False)))
    args, dy = whole_layer_problem(rank, P, seed + 1)
    inputs = dict(x=args["x"], topk_ids=args["topk_ids"], topk_weights=args["topk_weights"])
    results = [run(module, leaves(inputs), dy) for module in (plain, replicated)]
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1]["x"], results[0][1]["x"])
    for name in ("w13", "w2"):
        grad = getattr(replicated, name).grad
        assert isinstance(grad, DTensor) and grad.placements == (Replicate(),), name
        assert torch.equal(grad.to_local(), getattr(plain, name).grad), name


def case_sharded_weights_into_whole_layer_raise(rank, P, seed):
    args, _ = whole_layer_problem(rank, P, seed)
    mesh = mesh_of((P,))
    experts = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    sharded = dict(args, w13=DTensor.from_local(args["w13"][experts], mesh, [Shard(0)], run_check=False))
    _raises(lambda: megamoe.moe(**sharded), ValueError, "megamoe.moe: w13", "megamoe.ep.moe", "full_tensor")
    _raises(lambda: megamoe.path_of(**sharded), ValueError, "w13", "megamoe.ep.moe")
    partial = dict(args, w2=DTensor.from_local(args["w2"], mesh, [Partial()], run_check=False))
    _raises(lambda: megamoe.moe(**partial), ValueError, "megamoe.moe: w2", "Partial")
    biases = separate_experts(E_LOCAL * P, torch.Generator().manual_seed(seed))
    biases["b2"] = DTensor.from_local(biases["b2"][experts], mesh, [Shard(0)], run_check=False)
    _raises(lambda: megamoe.moe(**dict(args, **biases), layout=megamoe.SEPARATE), ValueError, "megamoe.moe: b2")
    for name in ("x", "topk_ids", "topk_weights"):
        activation = DTensor.from_local(args[name], mesh, [Shard(0)], run_check=False)
        _raises(lambda: megamoe.moe(**dict(args, **{name: activation})), TypeError, f"megamoe.moe: {name}", "DTensor")
    replicated = dict(args, w2=DTensor.from_local(args["w2"], mesh, [Replicate()], run_check=False))
    _raises(lambda: megamoe.moe_backward(args["x"], **replicated), TypeError, "megamoe.moe_backward: w2", "to_local")


# ---- FSDP2 (fully_shard) around megamoe's modules ----

def fully_shard_or_skip():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as ex:
        raise SkipCase(f"torch.distributed.fsdp.fully_shard is not importable: {ex}")
    return fully_shard


def record_parameters(module):
    """A list that each forward of `module` appends {name: (type name, placements or None, shape)} of its parameters
    to, as the forward sees them."""
    seen = []

    def hook(module, args):
        seen.append({name: (type(p).__name__, getattr(p, "placements", None), tuple(p.shape))
                     for name, p in module.named_parameters()})

    module.register_forward_pre_hook(hook)
    return seen


def every_rank_grads(make, P, loss):
    """The mean over ranks r of each parameter's gradient of loss(module, r) (FSDP2 averages its reduce-scatter over
    the data-parallel ranks), from a plain module made by make(); every rank's tokens come from the seed."""
    module = make()
    for r in range(P):
        loss(module, r).backward()
    return {name: p.grad / P for name, p in module.named_parameters()}


def assert_mean_gradients(module, want, placements=None):
    """Each parameter's gradient a DTensor (with `placements` if given) whose full tensor is want[name]."""
    for name, p in module.named_parameters():
        assert isinstance(p.grad, DTensor), f"{name}.grad is a {type(p.grad).__name__}"
        assert placements is None or p.grad.placements == placements, f"{name}.grad placements {p.grad.placements}"
        err = rel_err(p.grad.full_tensor(), want[name])
        assert err < TOL, f"{name}.grad: relative error {err:.3e} against the mean of the plain gradients"


def case_fsdp2_block_sees_unsharded_plain_parameters(rank, P, seed):
    fully_shard = fully_shard_or_skip()
    mesh = mesh_of((P,))
    ranks, _, _ = make_batch(P, tokens_for(P), H, I, E_LOCAL, TOPK, seed)

    def make():
        torch.manual_seed(seed)
        return megamoe.MoEBlock(H, I, E_LOCAL * P, TOPK, dtype=torch.float64, init_std=0.3)

    def loss_of(outputs, r):
        y, logits = outputs
        return (y * ranks[r][3]).sum() + logits.square().sum()

    want = every_rank_grads(make, P, lambda block, r: loss_of(block(ranks[r][0]), r))
    y_plain, _ = make()(ranks[rank][0])
    block = make()
    seen = record_parameters(block.experts)
    fully_shard(block.experts, mesh=mesh)
    fully_shard(block, mesh=mesh)
    assert isinstance(block.experts.w13, DTensor) and block.experts.w13.placements == (Shard(0),)
    outputs = block(ranks[rank][0])
    assert torch.equal(outputs.y, y_plain), "y under fully_shard differs from the plain module's"
    loss_of(outputs, rank).backward()
    E = E_LOCAL * P
    assert seen == [{"w13": ("Parameter", None, (E, 2 * I, H)), "w2": ("Parameter", None, (E, H, I))}], seen
    assert_mean_gradients(block, want, (Shard(0),))


def case_fsdp2_replicated_dtensor_experts(rank, P, seed):
    fully_shard = fully_shard_or_skip()
    mesh = mesh_of((P, 1), ("dp", "tp"))
    inputs = {r: whole_layer_problem(r, P, seed) for r in range(P)}

    def make():
        torch.manual_seed(seed)
        return megamoe.MoEExperts(E_LOCAL * P, H, I, dtype=torch.float64, init_std=0.3)

    def loss(experts, r):
        args, dy = inputs[r]
        return (experts(args["x"], args["topk_ids"], args["topk_weights"]) * dy).sum()

    want = every_rank_grads(make, P, loss)
    experts = make()
    for name in ("w13", "w2"):  # replicated over a tensor-parallel mesh dimension, as FSDP2 + TP leaves experts
        local = getattr(experts, name).detach()
        setattr(experts, name, nn.Parameter(DTensor.from_local(local, mesh["tp"], [Replicate()], run_check=False)))
    seen = record_parameters(experts)
    fully_shard(experts, mesh=mesh["dp"])
    loss(experts, rank).backward()
    E = E_LOCAL * P
    assert seen == [{"w13": ("DTensor", (Replicate(),), (E, 2 * I, H)),
                     "w2": ("DTensor", (Replicate(),), (E, H, I))}], seen
    assert_mean_gradients(experts, want)


def case_fsdp2_expert_parallel_module(rank, P, seed):
    fully_shard = fully_shard_or_skip()
    mesh = mesh_of((1, P), ("dp", "ep"))  # torchtitan: experts Shard(0) over ep, fully_shard over the rest (dp)
    group = mesh["ep"].get_group()
    torch.manual_seed(seed)
    full = megamoe.MoEExperts(E_LOCAL * P, H, I, dtype=torch.float64, init_std=0.3)
    plain, sharded = (megamoe.ep.MoEExperts.from_full(full.w13, full.w2, group=group) for _ in range(2))
    for name in EP_WEIGHTS:
        local = getattr(sharded, name).detach()
        setattr(sharded, name, nn.Parameter(DTensor.from_local(local, mesh["ep"], [Shard(0)], run_check=False)))
    seen = record_parameters(sharded)
    fully_shard(sharded, mesh=mesh["dp"])
    args, dy, _, _ = ep_problem(rank, P, seed + 1)
    inputs = dict(x=args["x"], topk_ids=args["topk_ids"], topk_weights=args["topk_weights"])
    results = [run(module, leaves(inputs), dy) for module in (plain, sharded)]
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1]["x"], results[0][1]["x"])
    E = E_LOCAL * P
    assert seen == [{"w13_local": ("DTensor", (Shard(0),), (E, 2 * I, H)),
                     "w2_local": ("DTensor", (Shard(0),), (E, H, I))}], seen
    for name in EP_WEIGHTS:
        grad = getattr(sharded, name).grad
        assert isinstance(grad, DTensor), name
        assert torch.equal(grad.to_local(), getattr(plain, name).grad), f"{name}: not the plain gradient"


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
