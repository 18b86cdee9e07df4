"""The torchtitan-style expert-parallel baseline of bench_ep.py: counts exchanged by all_to_all_single and read back
(the same host sync as megamoe.ep), rows moved by the autograd-aware functional all-to-all
(`all_to_all_single_autograd`, as torchtitan's dispatcher does), received rows permuted to expert order, the local
experts as two `torch._grouped_mm` with SwiGLU between them (bench/torch_moe_baseline.py's `moe_grouped` path), the
outputs sent back, weighted and added into their tokens with index_add.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd


def _exclusive_cumsum(x):
    return torch.cumsum(x, 0) - x


def expert_order(counts, num_rows):
    """counts [P, E_l] rows from rank s for local expert e -> (recv_of_grouped [R], grouped_of_recv [R]): the
    received (source-major) rows in expert-major order and back."""
    P, E_l = counts.shape
    flat = counts.reshape(-1)
    block = torch.repeat_interleave(torch.arange(P * E_l, device=counts.device), flat, output_size=num_rows)
    pos = torch.arange(num_rows, device=counts.device) - _exclusive_cumsum(flat)[block]
    start = _exclusive_cumsum(counts.t().reshape(-1)).view(E_l, P)
    grouped_of_recv = start[block % E_l, block // E_l] + pos
    recv_of_grouped = torch.empty_like(grouped_of_recv)
    recv_of_grouped[grouped_of_recv] = torch.arange(num_rows, device=counts.device)
    return recv_of_grouped, grouped_of_recv


def route(topk_ids, num_local_experts, group):
    """(order [S], send_sizes, recv_sizes, recv_counts [P, E_l]) after the counts exchange and its host read."""
    P = dist.get_world_size(group)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [S]
    counts = torch.zeros(P * num_local_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    send_counts = counts.view(P, num_local_experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_sizes, recv_sizes = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    return order, send_sizes, recv_sizes, recv_counts


def local_experts(xs, tokens_per_expert, w13, w2):
    """The grouped_mm path on rows sorted by local expert: [R, H] -> [R, H]."""
    I = w2.shape[2]
    offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [R, 2I]
    a = F.silu(h[:, :I]) * h[:, I:]  # [R, I]
    return torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)  # [R, H]


def moe(x, topk_ids, topk_weights, w13_local, w2_local, group):
    """y [T_r, H] (no dropped slots: every id in [0, E)), differentiable through autograd."""
    topk = topk_ids.shape[1]
    order, send_sizes, recv_sizes, recv_counts = route(topk_ids, w13_local.shape[0], group)
    token = order // topk  # [S]
    x_recv = all_to_all_single_autograd(x[token], recv_sizes, send_sizes, group)  # [R, H] by source rank
    recv_of_grouped, grouped_of_recv = expert_order(recv_counts, sum(recv_sizes))
    out = local_experts(x_recv[recv_of_grouped], recv_counts.sum(0), w13_local, w2_local)  # [R, H] by expert
    back = all_to_all_single_autograd(out[grouped_of_recv], send_sizes, recv_sizes, group)  # [S, H] sorted slots
    weights = topk_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)  # [S, 1]
    return torch.zeros_like(x).index_add(0, token, back * weights)
