"""DTensor weights at the entry points: a `torch.distributed.tensor.DTensor` weight (an FSDP2 or expert-parallel
parameter) is read through its local shard, `.to_local()`, as torchtitan's GroupedExperts reads its expert-sharded
weights. to_local is differentiable: autograd hands each weight's gradient back as a DTensor with the weight's mesh
and placements, its local value this rank's gradient (reducing it over data-parallel ranks stays the framework's job,
as for a plain parameter). What each entry point accepts, per mesh dimension:

    megamoe.moe          Replicate only (every expert on every rank)
    megamoe.grouped_moe  Shard(0) (experts) or Replicate; the local shard holds the experts tokens_per_expert counts
    megamoe.ep.moe       Shard(0) over the mesh dimension of the expert-parallel group (the same ranks, in the same
                         order, so the local shard is experts [r E/P, (r+1) E/P) of rank r), Replicate elsewhere;
                         Replicate only for a group of one rank

Activations (x, topk_ids, topk_weights; x_sorted, tokens_per_expert, scores) as DTensors raise TypeError, and so
does any DTensor passed to the backward functions for frameworks that drive the backward themselves
(megamoe.moe_backward, megamoe.grouped_backward: plain tensors in, plain gradients out).

Nothing here imports torch.distributed.tensor: while no module has imported it, no tensor can be a DTensor.
"""

import sys

import torch.distributed as dist


def is_dtensor(tensor):
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _sharding(tensor):
    """'placements (Shard(dim=0),) on a mesh of shape (2,)': how a DTensor is laid out, for the messages."""
    return f"placements {tuple(tensor.placements)} on a mesh of shape {tuple(tensor.device_mesh.shape)}"


def refuse_dtensors(entry, reason, **tensors):
    """TypeError naming the first of `tensors` given as a DTensor, saying why it must be a plain tensor."""
    for name, tensor in tensors.items():
        if is_dtensor(tensor):
            raise TypeError(f"{entry}: {name} is a DTensor ({_sharding(tensor)}); {reason}: pass this rank's {name} "
                            f"as a plain tensor ({name}.to_local())")


def refuse_dtensor_activations(entry, **activations):
    """TypeError naming the first activation given as a DTensor (only the weights may be DTensors)."""
    refuse_dtensors(entry, "only the expert weights may be DTensors", **activations)


def replicated_local(entry, name, tensor):
    """The local tensor of a DTensor replicated over its whole mesh (a plain tensor as it is); ValueError naming the
    argument for any other placement."""
    if not is_dtensor(tensor):
        return tensor
    if all(placement.is_replicate() for placement in tensor.placements):
        return tensor.to_local()
    raise ValueError(f"{entry}: {name} is a DTensor with {_sharding(tensor)}; {entry} needs every expert on every "
                     "rank (every placement Replicate): use megamoe.ep.moe for expert-sharded weights, or gather them "
                     f"first ({name}.full_tensor(), or {name}.redistribute(placements=[Replicate()] * mesh.ndim))")


def expert_shard_local(entry, name, tensor):
    """The local experts of a DTensor sharded over experts (Shard(0) or Replicate on every mesh dimension; a plain
    tensor as it is); ValueError naming the argument for any other placement."""
    if not is_dtensor(tensor):
        return tensor
    if all(placement.is_shard(0) or placement.is_replicate() for placement in tensor.placements):
        return tensor.to_local()
    # TODO: tensor-parallel experts (Shard(1) / Shard(2): partial outputs to reduce).
    raise ValueError(f"{entry}: {name} is a DTensor with {_sharding(tensor)}; only Shard(0) (experts) or Replicate "
                     "placements are supported (its local shard must hold whole experts)")


def same_sharding(entry, **weights):
    """ValueError naming the first DTensor weight laid out otherwise than the first one: the experts' parameters of
    one call must hold the same experts."""
    sharded = [(name, tensor) for name, tensor in weights.items() if is_dtensor(tensor)]
    for name, tensor in sharded[1:]:
        first_name, first = sharded[0]
        if tensor.device_mesh != first.device_mesh or tensor.placements != first.placements:
            raise ValueError(f"{entry}: {name} is a DTensor with {_sharding(tensor)} but {first_name} has "
                             f"{_sharding(first)}; the expert weights must be sharded alike")


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _expert_parallel_dim(name, tensor, group):
    """The mesh dimension over which the DTensor shards its experts as the group does (None: replicated over a
    group of one rank); ValueError naming the argument otherwise."""
    entry, placements, mesh = "megamoe.ep.moe", tensor.placements, tensor.device_mesh
    if not all(placement.is_shard(0) or placement.is_replicate() for placement in placements):
        raise ValueError(f"{entry}: {name} is a DTensor with {_sharding(tensor)}; expected Shard(0) over the expert-"
                         "parallel group's mesh dimension and Replicate on the others")
    sharded = [dim for dim, placement in enumerate(placements) if placement.is_shard(0)]
    world = dist.get_world_size(group)
    if not sharded:
        if world == 1:
            return None
        raise ValueError(f"{entry}: {name} is a DTensor replicated over its mesh ({_sharding(tensor)}) but the "
                         f"group has {world} ranks, each holding its own experts: shard it as Shard(0) over the "
                         "group's mesh dimension, or pass the full weights to megamoe.moe")
    if len(sharded) > 1:
        raise ValueError(f"{entry}: {name} is a DTensor sharded over several mesh dimensions ({_sharding(tensor)}); "
                         "expected Shard(0) over the expert-parallel group's mesh dimension only")
    dim = sharded[0]
    if _ranks(mesh.get_group(dim)) != _ranks(group):
        raise ValueError(f"{entry}: {name} is sharded over mesh dimension {dim} ({_sharding(tensor)}), whose ranks "
                         f"{_ranks(mesh.get_group(dim))} are not the group's {_ranks(group)}: pass group="
                         f"mesh.get_group({dim}) (the group its experts are sharded over)")
    return dim


def expert_parallel_local(name, tensor, group):
    """This rank's experts of a DTensor weight of megamoe.ep.moe (a plain tensor as it is): its local shard, after
    checking that the shard is experts [r E/P, (r+1) E/P) of rank r of `group`; ValueError naming the argument
    otherwise."""
    if not is_dtensor(tensor):
        return tensor
    dim = _expert_parallel_dim(name, tensor, group)
    local = tensor.to_local()
    world = dist.get_world_size(group)
    if dim is not None and tensor.shape[0] != world * local.shape[0]:
        raise ValueError(f"megamoe.ep.moe: {name} is a DTensor of {tensor.shape[0]} experts sharded unevenly over "
                         f"{world} ranks (this rank holds {local.shape[0]}); the number of experts must be divisible "
                         "by the group size")
    return local
