"""Expert-parallel routing for `megamoe.ep.moe`: which of this rank's slots go to which rank, the one exchange of
per-rank counts (the layer's one host synchronisation: `all_to_all_single` takes its split sizes on the host), and,
per chunk, the permutations between the order rows arrive in (by source rank, then local expert) and the order of
grouped rows (by local expert, then source rank).

Index tensors are built on the device with sizes the host already knows, so nothing else reads device memory.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ChunkRoute:
    """One chunk's exchange, seen from this rank."""

    send_sizes: list  # rows this rank sends to each rank
    recv_sizes: list  # rows this rank receives from each rank
    send_offset: int  # the chunk's first row among this rank's sent rows
    tokens_per_expert: torch.Tensor  # [E_l] int64: the received rows per local expert
    recv_of_grouped: torch.Tensor  # [R_c]: for each grouped row (by local expert), its received row
    grouped_of_recv: torch.Tensor  # [R_c]: for each received row, its grouped row

    @property
    def num_sent(self):
        return sum(self.send_sizes)

    @property
    def num_received(self):
        return sum(self.recv_sizes)


@dataclass
class Route:
    """Where this rank's slots go and where their results come back.

    Sent rows are slots, chunk by chunk, sorted by global expert within a chunk (so grouped by destination rank, in
    slot order within an expert); dropped slots are not sent. Results come back into a buffer of num_sent + 1 rows
    whose last row is zero: row_of_slot points dropped slots at it.
    """

    group: object
    topk: int
    sent_slots: torch.Tensor  # [N_send] int64: the flat slot index (t * topk + j) of each sent row
    row_of_slot: torch.Tensor  # [topk, T] int64: each slot's row in the returned buffer (N_send: dropped)
    chunks: list  # ChunkRoute per chunk

    @property
    def num_sent(self):
        return self.sent_slots.shape[0]


def chunk_bounds(num_tokens, num_chunks):
    """Token bounds [num_chunks + 1] of contiguous chunks whose sizes differ by at most one (the first are larger)."""
    base, rem = divmod(num_tokens, num_chunks)
    return [c * base + min(c, rem) for c in range(num_chunks + 1)]


def _chunk_of_token(num_tokens, num_chunks, device):
    """[T] int64: the chunk of each token, for chunk_bounds' split, from device arithmetic alone."""
    t = torch.arange(num_tokens, device=device)
    base, rem = divmod(num_tokens, num_chunks)
    if base == 0:
        return t  # fewer tokens than chunks: token t is chunk t
    big = rem * (base + 1)  # tokens in the first rem chunks, of base + 1 tokens each
    return torch.where(t < big, t // (base + 1), rem + (t - big) // base)


def _exclusive_cumsum(x):
    return torch.cumsum(x, 0) - x


def _grouped_permutation(counts, num_rows):
    """counts [P, E_l] (rows from rank s for local expert e, on the device), num_rows = counts.sum() (host).

    Received rows come source-major: (s=0, e=0), (s=0, e=1), ..., (s=1, e=0), ...; grouped rows expert-major:
    (e=0, s=0), (e=0, s=1), .... Returns (recv_of_grouped [R], grouped_of_recv [R]), inverse permutations."""
    P, E_l = counts.shape
    device = counts.device
    flat = counts.reshape(-1)  # [P*E_l] source-major blocks
    block = torch.repeat_interleave(torch.arange(P * E_l, device=device), flat, output_size=num_rows)  # [R]
    pos_in_block = torch.arange(num_rows, device=device) - _exclusive_cumsum(flat)[block]  # [R]
    grouped_start = _exclusive_cumsum(counts.t().reshape(-1)).view(E_l, P)  # [E_l, P] expert-major block starts
    grouped_of_recv = grouped_start[block % E_l, block // E_l] + pos_in_block  # [R]
    recv_of_grouped = torch.empty_like(grouped_of_recv)
    recv_of_grouped[grouped_of_recv] = torch.arange(num_rows, device=device)
    return recv_of_grouped, grouped_of_recv


def plan(topk_ids, num_local_experts, num_chunks, group):
    """The Route of this rank's topk_ids [T, topk] (global ids; -1 dropped), after the one exchange of counts.

    Every rank of the group must call it (it is collective). Ids outside [-1, E) raise ValueError on every rank (each
    rank's count of them travels with its counts)."""
    world = dist.get_world_size(group)
    T, topk = topk_ids.shape
    E_l = num_local_experts
    E = world * E_l
    C = num_chunks
    device = topk_ids.device
    with torch.no_grad():
        ids = topk_ids.reshape(-1).long()  # [S]
        bad = (ids < -1) | (ids >= E)  # [S]
        key = torch.where((ids >= 0) & ~bad, ids, E)  # [S]: the expert, or E (dropped / bad: never sent)
        chunk_of_slot = _chunk_of_token(T, C, device)[:, None].expand(T, topk).reshape(-1)  # [S]
        chunk_key = chunk_of_slot * (E + 1) + key  # [S]: by chunk, then expert
        order = torch.sort(chunk_key, stable=True).indices  # [S]: slot of each sorted position
        counts = torch.zeros(C * (E + 1), dtype=torch.int64, device=device)
        counts.scatter_add_(0, chunk_key, torch.ones_like(chunk_key))  # no bincount: it reads its size on the host
        per_dest = counts.view(C, E + 1)[:, :E].reshape(C, world, E_l).transpose(0, 1)  # [P, C, E_l]
        num_bad = bad.sum().reshape(1, 1, 1).expand(world, C, 1)  # [P, C, 1] every rank learns our bad-id count
        send_counts = torch.cat([per_dest, num_bad], dim=2).contiguous()  # [P, C, E_l + 1]
        recv_counts = torch.empty_like(send_counts)  # [P (source), C, E_l + 1]
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        # The one host synchronisation of the layer: all_to_all_single needs the split sizes on the host.
        host = torch.cat([send_counts.reshape(-1), recv_counts.reshape(-1)]).tolist()
    half = world * C * (E_l + 1)
    sent, received = _nested(host[:half], world, C, E_l + 1), _nested(host[half:], world, C, E_l + 1)
    bad_ranks = [s for s in range(world) if received[s][0][E_l] > 0]
    if bad_ranks:
        counts_text = ", ".join(f"rank {s}: {received[s][0][E_l]}" for s in bad_ranks)
        raise ValueError(f"megamoe.ep.moe: topk_ids must be in [-1, E={E}) (E = group size {world} x "
                         f"w13_local.shape[0] {E_l}); ids outside it ({counts_text})")
    return _route(group, topk, T, C, E_l, order, sent, received, recv_counts, device)


def _nested(flat, a, b, c):
    return [[flat[(i * b + j) * c:(i * b + j + 1) * c] for j in range(b)] for i in range(a)]


def _route(group, topk, T, C, E_l, order, sent, received, recv_counts, device):
    world = len(sent)
    bounds = chunk_bounds(T, C)
    chunks, slices, offset = [], [], 0
    with torch.no_grad():
        for c in range(C):
            send_sizes = [sum(sent[d][c][:E_l]) for d in range(world)]
            recv_sizes = [sum(received[s][c][:E_l]) for s in range(world)]
            start = bounds[c] * topk  # the chunk's sorted slots begin where its first token's slots do
            slices.append(order[start:start + sum(send_sizes)])
            counts = recv_counts[:, c, :E_l]  # [P, E_l] on the device
            recv_of_grouped, grouped_of_recv = _grouped_permutation(counts, sum(recv_sizes))
            chunks.append(ChunkRoute(send_sizes, recv_sizes, offset, counts.sum(0), recv_of_grouped, grouped_of_recv))
            offset += sum(send_sizes)
        sent_slots = torch.cat(slices) if C > 1 else slices[0]  # [N_send]
        row_of_slot = torch.full((T * topk,), offset, dtype=torch.int64, device=device)  # dropped: the zero row
        row_of_slot[sent_slots] = torch.arange(offset, device=device)
    return Route(group, topk, sent_slots, row_of_slot.view(T, topk).t().contiguous(), chunks)
