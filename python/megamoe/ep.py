"""Expert parallelism on torch.distributed: each rank of a process group holds a contiguous shard of the experts and
its own tokens; tokens travel to their experts' ranks and back by `all_to_all_single` (NCCL on GPUs, gloo on CPU).

    y = megamoe.ep.moe(x, topk_ids, topk_weights, w13_local, w2_local, group=None)   # autograd
    experts = megamoe.ep.MoEExperts(num_experts, hidden, intermediate, group=None)     # owns its shard
    y = experts(x, topk_ids, topk_weights)

Rank r of a group of P ranks holds experts [r E/P, (r+1) E/P). The local experts run as grouped rows
(`megamoe.grouped_moe`'s kernels); see docs/DESIGN.md ("Expert parallelism") for the dispatch, the combine order
and the chunking.
"""

import torch
import torch.distributed as dist
from torch import nn

from . import ep_routing
from . import fp8 as _fp8
from . import main_grads as _main_grads
from ._lib import FP8_ARGS
from .dtensor import expert_parallel_local, refuse_dtensor_activations
from .ep_pipeline import ExpertParallelMoE
from .layouts import op_options
from .modules import reshaped

# TODO: choose by measurement on several GPUs (NCCL): the overlap a chunk buys against its extra launches and
# smaller GEMMs; 1 (no chunking) until then.
DEFAULT_NUM_CHUNKS = 1

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_FLOAT_DTYPES)}
# What every rank must agree on, one int each in the metadata exchange: (field, argument named, what it is).
_AGREED = (
    ("hidden", "x", "hidden size x.shape[1]"),
    ("intermediate", "w2_local", "intermediate size w2_local.shape[2]"),
    ("local_experts", "w13_local", "experts per rank w13_local.shape[0]"),
    ("dtype", "x", "dtype code of x (0 bf16, 1 f16, 2 f32, 3 f64)"),
    ("cuda", "x", "device type of x (1 cuda, 0 cpu)"),
    ("num_chunks", "num_chunks", "num_chunks"),
    ("num_experts", "num_experts", "num_experts (-1: None)"),
    ("needs_grad", "x", "gradient mode (1: autograd on and an input requires grad)"),
    ("precision", "precision", "precision code (0 bf16, 1 fp8)"),
)
_host_groups = {}


def _is_tensor_of(name, tensor, dtypes, what):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"megamoe.ep.moe: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"megamoe.ep.moe: {name} has dtype {tensor.dtype}; expected {what}")


def _check_local(x, topk_ids, topk_weights, w13, w2, num_chunks, num_experts, world, backend):
    """Raises TypeError / ValueError naming the argument for what this rank alone can see is wrong."""
    _is_tensor_of("x", x, _FLOAT_DTYPES, "bf16, f16, f32 or f64")
    _is_tensor_of("topk_ids", topk_ids, (torch.int32, torch.int64), "int32 or int64")
    _is_tensor_of("topk_weights", topk_weights, _FLOAT_DTYPES, "f32 or the dtype of x")
    _is_tensor_of("w13_local", w13, (x.dtype,), f"the dtype of x ({x.dtype})")
    _is_tensor_of("w2_local", w2, (x.dtype,), f"the dtype of x ({x.dtype})")
    if x.dim() != 2:
        raise ValueError(f"megamoe.ep.moe: x must be [T_r, H], got shape {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"megamoe.ep.moe: topk_ids must be [T_r={x.shape[0]}, topk], got {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"megamoe.ep.moe: topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    if topk_weights.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"megamoe.ep.moe: topk_weights has dtype {topk_weights.dtype}; expected f32 or {x.dtype}")
    if w13.dim() != 3 or w13.shape[0] < 1 or w13.shape[2] != x.shape[1] or w13.shape[1] % 2:
        raise ValueError(f"megamoe.ep.moe: w13_local must be [E/P >= 1, 2I, H={x.shape[1]}], got {tuple(w13.shape)}")
    expected_w2 = (w13.shape[0], x.shape[1], w13.shape[1] // 2)
    if tuple(w2.shape) != expected_w2:
        raise ValueError(f"megamoe.ep.moe: w2_local must be [E/P, H, I] = {expected_w2}, got {tuple(w2.shape)}")
    for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13_local", w13), ("w2_local", w2)):
        if tensor.device != x.device:
            raise ValueError(f"megamoe.ep.moe: {name} is on {tensor.device}, x on {x.device}")
    wanted = {"gloo": "cpu", "nccl": "cuda"}.get(backend)  # mixed backends ("cpu:gloo,cuda:nccl") move both
    if wanted is not None and x.device.type != wanted:
        raise ValueError(f"megamoe.ep.moe: x is on {x.device} but the group's backend {backend!r} moves {wanted} "
                         "tensors")
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"megamoe.ep.moe: num_chunks must be an int >= 1, got {num_chunks!r}")
    if num_experts is not None:
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts % world:
            raise ValueError(f"megamoe.ep.moe: num_experts={num_experts!r} must be divisible by the group size {world}")
        if num_experts != world * w13.shape[0]:
            raise ValueError(f"megamoe.ep.moe: num_experts={num_experts} but w13_local holds {w13.shape[0]} experts "
                             f"per rank x {world} ranks = {world * w13.shape[0]}")


# main_grads may name the weights as ep.moe's arguments / ep.MoEExperts' parameters do, or as main_grads.by_param does.
_LOCAL_NAMES = {"w13_local": "w13", "w2_local": "w2"}


def _main_grad_buffers(main_grads, w13, w2):
    """(w13 buffer or None, w2 buffer or None) from main_grads (None, a tuple / list in (w13, w2) order, or a dict by
    name: w13 / w2 or w13_local / w2_local), checked against this rank's local weights by main_grads.by_param:
    TypeError / ValueError naming main_grads otherwise."""
    if isinstance(main_grads, dict):
        renamed = {_LOCAL_NAMES.get(name, name): buffer for name, buffer in main_grads.items()}
        if len(renamed) != len(main_grads):
            raise ValueError("megamoe.ep.moe: main_grads names a weight twice (w13 and w13_local, or w2 and "
                             "w2_local)")
        main_grads = renamed
    buffers = _main_grads.by_param("megamoe.ep.moe", main_grads, dict(w13=w13, w2=w2, w3=None, b13=None, b2=None))
    return buffers["w13"], buffers["w2"]


def _metadata(x, w2, w13, num_chunks, num_experts, needs_grad, precision):
    values = {"hidden": x.shape[1], "intermediate": w2.shape[2], "local_experts": w13.shape[0],
              "dtype": _DTYPE_CODE[x.dtype], "cuda": int(x.is_cuda), "num_chunks": num_chunks,
              "num_experts": -1 if num_experts is None else num_experts, "needs_grad": int(needs_grad),
              "precision": int(precision == "fp8")}
    return [values[field] for field, _, _ in _AGREED]


def _host_group(group):
    """A group over the same ranks that moves CPU tensors: the group itself unless its backend is NCCL alone, else a
    gloo twin made once (only the group's ranks take part)."""
    backend = dist.get_backend(group)
    if "gloo" in backend or "nccl" not in backend:
        return group
    if group not in _host_groups:
        ranks = dist.get_process_group_ranks(group)
        _host_groups[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _host_groups[group]


def _agree_or_raise(group, error, metadata):
    """One small all-gather (host tensors) of every rank's metadata, with a flag for a local error; then every rank
    raises the same error where any rank's input is bad or the ranks disagree, so no rank is left in a collective."""
    host_group, world = _host_group(group), dist.get_world_size(group)
    mine = torch.tensor([int(error is not None)] + (metadata or [0] * len(_AGREED)), dtype=torch.int64)
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
    dist.all_gather_into_tensor(everyone, mine, group=host_group)
    everyone = everyone.view(world, mine.numel())  # [P, 1 + len(_AGREED)]
    if everyone[:, 0].any():  # a second exchange, of the messages, only on the way to raising
        messages = [None] * world
        dist.all_gather_object(messages, None if error is None else (type(error).__name__, str(error)),
                               group=host_group)
        rank, (kind, text) = next((r, m) for r, m in enumerate(messages) if m is not None)
        if error is not None:
            raise error
        raise (TypeError if kind == "TypeError" else ValueError)(f"{text} (on rank {rank} of the group)")
    rows = everyone[:, 1:].tolist()
    for column, (_, name, what) in enumerate(_AGREED):
        values = [row[column] for row in rows]
        if len(set(values)) > 1:
            raise ValueError(f"megamoe.ep.moe: every rank must pass the same {what}; {name} gives "
                             + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))


@torch.compiler.disable
def moe(x, topk_ids, topk_weights, w13_local, w2_local, group=None, num_chunks=DEFAULT_NUM_CHUNKS, num_experts=None,
        recompute=False, main_grads=None, precision="bf16", fp8_experts=None):
    """The routed-expert MLP of megamoe.moe over experts sharded across the ranks of `group` (collective: every rank
    of the group calls it, and later runs the backward, together).

    x [T_r, H]: this rank's tokens (T_r may differ between ranks, 0 included); topk_ids [T_r, topk] int32/int64:
    global expert ids in [0, E) or -1 (dropped slot); topk_weights [T_r, topk] f32 or x's dtype; w13_local
    [E/P, 2I, H] and w2_local [E/P, H, I]: the experts [r E/P, (r+1) E/P) of rank r of the P ranks of `group`
    (None: the default group), so E = P * w13_local.shape[0] (num_experts, if given, must equal it). Returns this
    rank's y [T_r, H] in x's dtype, differentiable in x, topk_weights, w13_local and w2_local (the local weights'
    gradients sum every rank's tokens routed to them). recompute: as megamoe.moe (keep h = [g, u] of the received
    rows by default, or recompute it in the backward).

    Host synchronisation: one per call, the exchange of per-rank counts (all_to_all_single takes its split sizes on
    the host, so the counts are read back before the tokens move; the backward reuses them). Not CUDA-graph
    capturable; torch.compile runs it outside the graph. Before that exchange, one all-gather of a few host ints per
    rank (shapes, dtype, num_chunks) makes a bad argument on any rank raise the same TypeError / ValueError on every
    rank instead of hanging the others; ids outside [-1, E) on any rank raise ValueError on every rank after the
    counts exchange (CPU and CUDA alike).

    num_chunks splits this rank's tokens into contiguous chunks whose all-to-alls are issued asynchronously so that
    chunk c's transfers overlap chunk c - 1's compute (every rank must pass the same value). y, dx and
    d topk_weights are bitwise the same for every num_chunks and run to run (each token's topk contributions are
    summed on its rank in slot order, no atomics); the weight gradients are bitwise reproducible run to run for a
    given num_chunks, and differ across num_chunks only by rounding (the rows of an expert are summed chunk by chunk).

    w13_local / w2_local may be DTensors holding every expert (global shape [E, ...]) sharded Shard(0) over the mesh
    dimension of `group` (Replicate on any other dimension, e.g. FSDP2's data-parallel ones), as torchtitan's expert
    parallelism lays them out: this rank's experts are their .to_local(), and their gradients come back as DTensors
    with the same placements. Other placements raise ValueError naming the argument, DTensor activations TypeError
    (dtensor.py), on every rank.

    main_grads (Megatron-style gradient accumulation fusion; main_grads.py): f32 buffers for this rank's weights, e.g.
    (w13_local.main_grad, w2_local.main_grad), as a tuple in the order (w13_local, w2_local) (None entries: no buffer)
    or a dict by name ("w13" / "w2", or "w13_local" / "w2_local"). Each buffer is a contiguous float32 tensor shaped
    as its local weight (for a DTensor weight: as its .to_local(), [E/P, ...]), on its device, not requiring grad;
    they are checked inside the agreement exchange above, so a bad buffer on one rank raises the same TypeError /
    ValueError (naming main_grads) on every rank. Semantics as megamoe.moe's main_grads: every backward through this
    call adds each weight's gradient (every rank's tokens routed to this rank's experts) into its buffer (buffer =
    buffer + grad, f32, in the kernels' epilogue: each chunk's backward adds straight into the buffer, no f32
    temporaries; bitwise reproducible run to run for a given num_chunks and initial buffer, and across num_chunks
    only up to rounding; experts with no rows leave their part untouched), only for weights that require grad;
    autograd's gradient of such a weight is None (its .grad, a DTensor's too, is not created or changed; on torch 2.10
    and 2.11 a DTensor weight's .grad becomes an all-zero DTensor instead, torch's doing, None from 2.12); weights
    without a buffer, x and topk_weights get their usual gradients (x's and topk_weights' bitwise those of the call
    without main_grads; a weight without a buffer beside one with a buffer gets its gradient through an f32 buffer,
    as in megamoe.moe). Two backwards add twice. The buffers are kept by reference, not saved for backward (other
    backwards may add into them in between). Each rank chooses its own buffers (they need not agree).

    precision / fp8_experts: megamoe.moe's, for this rank's experts (precision "fp8": blockwise FP8 GEMMs on sm_90
    CUDA; fp8_experts the local weights' megamoe.fp8.Fp8Experts, else megamoe.fp8's cache of w13_local / w2_local;
    every rank must pass the same precision).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("megamoe.ep.moe: torch.distributed is not initialized (call init_process_group first)")
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                 for t in (x, topk_weights, w13_local, w2_local))
    error = metadata = None
    buffers = (None, None)
    try:
        refuse_dtensor_activations("megamoe.ep.moe", x=x, topk_ids=topk_ids, topk_weights=topk_weights)
        w13_local = expert_parallel_local("w13_local", w13_local, group)
        w2_local = expert_parallel_local("w2_local", w2_local, group)
        _check_local(x, topk_ids, topk_weights, w13_local, w2_local, num_chunks, num_experts, world,
                     dist.get_backend(group))
        buffers = _main_grad_buffers(main_grads, w13_local, w2_local)
        options = op_options(None, None, precision)  # ValueError for an unknown precision, agreed below
        metadata = _metadata(x, w2_local, w13_local, num_chunks, num_experts, needs_grad, precision)
    except (TypeError, ValueError) as ex:
        error = ex
    _agree_or_raise(group, error, metadata)
    fp8 = _fp8.op_arguments("megamoe.ep.moe", options, w13_local, w2_local, fp8_experts)
    route = ep_routing.plan(topk_ids, w13_local.shape[0], num_chunks, group)
    x, topk_weights = x.contiguous(), topk_weights.contiguous()
    fp8_local = _fp8.Fp8Experts(*(fp8[name] for name in FP8_ARGS)) if fp8 else None
    return ExpertParallelMoE.apply(x, topk_weights, w13_local, w2_local, route, needs_grad and not recompute, buffers,
                                   fp8_local)


class MoEExperts(nn.Module):
    """This rank's shard of `num_experts` SwiGLU experts, run by `megamoe.ep.moe` over `group` (None: the default
    group): the experts [r E/P, (r+1) E/P) of rank r of its P ranks.

    Parameters: w13_local [E/P, 2I, H] (gate rows, then up rows) and w2_local [E/P, H, I], initialised like
    megamoe.MoEExperts: normal(0, init_std). forward(x, topk_ids, topk_weights) takes global expert ids (-1:
    dropped). `from_full` takes a rank's slice of a whole megamoe.MoEExperts (or of w13 / w2 tensors). The parameters
    may be replaced by DTensors of every expert sharded Shard(0) over the group's mesh dimension (torchtitan's
    expert parallelism, distribute_module): megamoe.ep.moe runs their local shards. forward(..., main_grads=...):
    f32 buffers of the local shards the weight gradients are added into, as megamoe.ep.moe's main_grads (a dict may
    use the parameter names w13_local / w2_local).
    """

    def __init__(self, num_experts, hidden, intermediate, group=None, dtype=None, device=None, init_std=0.02,
                 recompute=False, num_chunks=DEFAULT_NUM_CHUNKS, precision="bf16"):
        super().__init__()
        world = dist.get_world_size(group)
        if num_experts % world:
            raise ValueError(f"megamoe.ep.MoEExperts: num_experts={num_experts} must be divisible by the group "
                             f"size {world}")
        factory = {"dtype": dtype, "device": device}
        self.group, self.num_chunks, self.recompute, self.precision = group, num_chunks, recompute, precision
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.num_local_experts = num_experts // world
        self.first_expert = dist.get_rank(group) * self.num_local_experts
        self.init_std = init_std
        E_l = self.num_local_experts
        self.w13_local = nn.Parameter(torch.empty(E_l, 2 * intermediate, hidden, **factory))  # [E/P, 2I, H]
        self.w2_local = nn.Parameter(torch.empty(E_l, hidden, intermediate, **factory))  # [E/P, H, I]
        self.reset_parameters()

    @classmethod
    def from_full(cls, w13, w2, group=None, **kwargs):
        """A shard holding this rank's experts of full weights w13 [E, 2I, H] and w2 [E, H, I] (tensors, or the
        Parameters of a megamoe.MoEExperts: `from_full(experts.w13, experts.w2)`), copied."""
        E, two_i, H = w13.shape
        module = cls(E, H, two_i // 2, group=group, dtype=w13.dtype, device=w13.device, **kwargs)
        experts = slice(module.first_expert, module.first_expert + module.num_local_experts)
        with torch.no_grad():
            module.w13_local.copy_(w13[experts])
            module.w2_local.copy_(w2[experts])
        return module

    def reset_parameters(self):
        """normal(0, init_std) for both weights, as megamoe.MoEExperts and Hugging Face initialise experts."""
        nn.init.normal_(self.w13_local, mean=0.0, std=self.init_std)
        nn.init.normal_(self.w2_local, mean=0.0, std=self.init_std)

    def forward(self, x, topk_ids, topk_weights, main_grads=None):
        """x [..., H], topk_ids [..., topk] global ids (-1: dropped), topk_weights [..., topk] -> y [..., H] in x's
        dtype; topk_weights other than fp32 or x's dtype are cast to fp32. main_grads: as megamoe.ep.moe's (buffers
        shaped as w13_local / w2_local, or their local shards for DTensor parameters)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden)  # [T_r, H]
        ids = topk_ids.reshape(-1, topk_ids.shape[-1])  # [T_r, topk] (T_r = 0 too)
        weights = topk_weights.reshape(ids.shape)  # [T_r, topk]
        if weights.dtype not in (torch.float32, x.dtype):
            weights = weights.float()
        y = moe(x2, ids, weights, self.w13_local, self.w2_local, group=self.group, num_chunks=self.num_chunks,
                num_experts=self.num_experts, recompute=self.recompute, main_grads=main_grads,
                precision=self.precision)  # [T_r, H]
        return reshaped(y, (*lead, self.hidden))

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, local_experts=[{self.first_expert}, "
                f"{self.first_expert + self.num_local_experts}), hidden={self.hidden}, "
                f"intermediate={self.intermediate}, num_chunks={self.num_chunks}, recompute={self.recompute}, "
                f"precision={self.precision!r}")
