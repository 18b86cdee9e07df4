"""The chunked expert-parallel pipeline of `megamoe.ep.moe`, forward and backward, as one torch.autograd.Function.

Per chunk: dispatch (all-to-all of the chunk's rows and scores to their experts' ranks), the local experts on the
received rows as grouped rows (`megamoe::grouped_forward` / `grouped_backward`), combine (all-to-all of the results
back to the tokens' ranks). Chunk c + 1's dispatch is issued (async) before chunk c's experts run and chunk c's
combine before chunk c + 1's, so on NCCL the transfers of one chunk overlap the compute of its neighbours; gloo
runs them on its own threads. The topk contributions of a token are summed on its rank after every combine, in
slot order j = 0, 1, ... with gathers only (no atomics, no order-dependent reduction): the same inputs give bitwise
the same y, dx and d topk_weights run to run and for every num_chunks.
"""

import torch
import torch.distributed as dist

from ._lib import FP8_ARGS
from .grouped import grouped_backward, grouped_forward


def _wide(dtype):
    """The accumulation dtype of the topk sums: f32 for bf16 / f16 / f32, f64 for f64."""
    return torch.promote_types(dtype, torch.float32)


def _returned_buffer(like, num_rows, *trailing):
    """[num_rows + 1, *trailing] in like's dtype: the combines write rows [0, num_rows); the last row is zero (dropped
    slots read it)."""
    buffer = like.new_empty((num_rows + 1, *trailing))
    buffer[num_rows].zero_()
    return buffer


def sum_over_topk(rows, row_of_slot, dtype):
    """y [T, H] in dtype: y_t = rows[row_of_slot[0, t]] + rows[row_of_slot[1, t]] + ..., accumulated in _wide(dtype)
    in that order. rows [N + 1, H] (row N zero); row_of_slot [topk, T]."""
    topk, T = row_of_slot.shape
    if topk == 0:
        return rows.new_zeros((T, rows.shape[1]), dtype=dtype)
    acc = rows.index_select(0, row_of_slot[0]).to(_wide(dtype))  # [T, H]
    for j in range(1, topk):
        acc += rows.index_select(0, row_of_slot[j])
    return acc.to(dtype)


class _AllToAll:
    """Async all_to_all_single exchanges of one chunk; wait() returns the outputs, in issue order."""

    def __init__(self, group, pairs, out_sizes, in_sizes):
        self.outputs = [out for out, _ in pairs]
        self.inputs = [inp for _, inp in pairs]  # kept alive until the transfer is done
        self.works = [dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=group, async_op=True)
                      for out, inp in pairs]

    def wait(self):
        for work in self.works:
            work.wait()
        self.inputs = None
        return self.outputs


def _dispatch(route, chunk, tensors):
    """Start sending the chunk's rows of each tensor (rows of this rank's sent rows, in order) to their experts'
    ranks. Returns the exchange; its outputs are the received rows [R_c, ...] by source rank."""
    lo, hi = chunk.send_offset, chunk.send_offset + chunk.num_sent
    pairs = [(t.new_empty((chunk.num_received, *t.shape[1:])), t[lo:hi]) for t in tensors]
    return _AllToAll(route.group, pairs, chunk.recv_sizes, chunk.send_sizes)


def _combine(route, chunk, buffers, tensors):
    """Start sending the chunk's results (received-row order) back to the tokens' ranks, into their rows of each
    returned buffer."""
    lo, hi = chunk.send_offset, chunk.send_offset + chunk.num_sent
    pairs = [(buffer[lo:hi], t) for buffer, t in zip(buffers, tensors)]
    return _AllToAll(route.group, pairs, chunk.send_sizes, chunk.recv_sizes)


def _run_chunks(route, sent, compute):
    """The pipeline: dispatch chunk 0; then for each chunk c: wait its dispatch, start chunk c + 1's, compute c,
    start c's combine. sent: the tensors to dispatch ([N_send, ...]); compute(c, chunk, received) -> the tensors to
    send back. Returns after every combine is done."""
    chunks = route.chunks
    pending = _dispatch(route, chunks[0], sent)
    combines = []
    for c, chunk in enumerate(chunks):
        received = pending.wait()
        if c + 1 < len(chunks):
            pending = _dispatch(route, chunks[c + 1], sent)
        combines.append(compute(c, chunk, received))
    for combine in combines:
        combine.wait()


class ExpertParallelMoE(torch.autograd.Function):
    """apply(x, topk_weights, w13_local, w2_local, route, keep_h, main_grads, fp8_experts) -> y [T, H]; see
    megamoe.ep.moe. main_grads: (w13 buffer or None, w2 buffer or None), checked by megamoe.ep.moe, kept on ctx by
    reference. fp8_experts: the local experts' megamoe.fp8.Fp8Experts (precision "fp8"; every chunk's forward and
    backward reads them), or None (the GEMMs in the weights' dtype)."""

    @staticmethod
    def forward(ctx, x, topk_weights, w13, w2, route, keep_h, main_grads=(None, None), fp8_experts=None):
        T, H = x.shape
        token_of_row = route.sent_slots // route.topk  # [N_send]
        x_sent = x.index_select(0, token_of_row)  # [N_send, H]
        scores_sent = topk_weights.reshape(-1).index_select(0, route.sent_slots)  # [N_send]
        y_rows = _returned_buffer(x, route.num_sent, H)  # [N_send + 1, H]
        saved = []

        def compute(c, chunk, received):
            x_recv, scores_recv = received  # [R_c, H], [R_c] by source rank
            x_grouped = x_recv.index_select(0, chunk.recv_of_grouped)  # [R_c, H] by local expert
            scores_grouped = scores_recv.index_select(0, chunk.recv_of_grouped)  # [R_c]
            out, h = grouped_forward(x_grouped, chunk.tokens_per_expert, w13, w2, scores_grouped, keep_h,
                                     **_fp8_options(fp8_experts))
            saved.append((x_grouped, scores_grouped, h))
            return _combine(route, chunk, [y_rows], [out.index_select(0, chunk.grouped_of_recv)])

        _run_chunks(route, [x_sent, scores_sent], compute)
        y = sum_over_topk(y_rows, route.row_of_slot, x.dtype)  # [T, H]
        ctx.route, ctx.saved, ctx.keep_h, ctx.consumed = route, saved, keep_h, False
        ctx.fp8_experts = fp8_experts  # made for this call (quantized or cached): kept, not saved
        ctx.shapes, ctx.scores_dtype = (x.shape, topk_weights.shape), topk_weights.dtype
        ctx.save_for_backward(w13, w2)
        # Kept as they are, not saved: other backwards add into them in between (microbatches), as in ops.py.
        ctx.main_grads = tuple(main_grads)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        if ctx.keep_h and ctx.consumed:
            raise RuntimeError(
                "megamoe.ep.moe: a second backward through the same call (retain_graph=True) needs the saved h, "
                "which the first backward consumed; use megamoe.ep.moe(..., recompute=True) for graphs that are "
                "backpropagated more than once")
        ctx.consumed = True
        route, saved = ctx.route, ctx.saved
        w13, w2 = ctx.saved_tensors
        (T, H), weights_shape = ctx.shapes
        dy = dy.contiguous()
        dy_sent = dy.index_select(0, route.sent_slots // route.topk)  # [N_send, H]
        dx_rows = _returned_buffer(dy, route.num_sent, H)  # [N_send + 1, H]
        dscores_rows = _returned_buffer(dy.new_empty(0, dtype=ctx.scores_dtype), route.num_sent)  # [N_send + 1]
        wgrad_f32 = len(route.chunks) > 1 and w13.dtype not in (torch.float32, torch.float64)
        # Per weight: wanted (requires grad), and then added into its main_grads buffer by every chunk's epilogue, or
        # summed here over the chunks (f32 when wgrad_f32) as autograd's gradient.
        wanted = ctx.needs_input_grad[2:4]
        buffers = [buffer if want else None for buffer, want in zip(ctx.main_grads, wanted)]
        summed = [want and buffer is None for buffer, want in zip(buffers, wanted)]
        main_grads = {name: buffer for name, buffer in zip(("w13", "w2"), buffers) if buffer is not None} or None
        names = ("dx_sorted", "dscores") + tuple(name for name, want in zip(("dw13", "dw2"), wanted) if want)
        dw = [None, None]

        def compute(c, chunk, received):
            (dy_recv,) = received  # [R_c, H] by source rank
            x_grouped, scores_grouped, h = saved[c]
            dout = dy_recv.index_select(0, chunk.recv_of_grouped)  # [R_c, H] by local expert
            saved_h = h if h.dim() == 2 else None
            grads = grouped_backward(dout, x_grouped, chunk.tokens_per_expert, w13, w2, scores_grouped, saved_h,
                                     wgrad_f32, grads=names, main_grads=main_grads,
                                     precision="bf16" if ctx.fp8_experts is None else "fp8",
                                     fp8_experts=ctx.fp8_experts)
            for i, grad in enumerate((grads.dw13, grads.dw2)):
                if summed[i]:
                    if dw[i] is None:
                        dw[i] = grad
                    else:
                        dw[i] += grad
            back = [grads.dx_sorted.index_select(0, chunk.grouped_of_recv),
                    grads.dscores.index_select(0, chunk.grouped_of_recv)]
            return _combine(route, chunk, [dx_rows, dscores_rows], back)

        _run_chunks(route, [dy_sent], compute)
        if ctx.keep_h:  # h is consumed (dh written over it): free the chunks' saved rows now; recompute mode keeps
            ctx.saved = None  # them for another backward through the same graph (retain_graph=True)
        dx = sum_over_topk(dx_rows, route.row_of_slot, dy.dtype)  # [T, H]
        dtopk_weights = dscores_rows.index_select(0, route.row_of_slot.t().reshape(-1)).view(weights_shape)
        dw13, dw2 = (grad.to(w.dtype) if grad is not None else None for grad, w in zip(dw, (w13, w2)))
        return dx, dtopk_weights, dw13, dw2, None, None, None, None


def _fp8_options(fp8_experts):
    """The grouped forward op's precision option and FP8 weight arguments for fp8_experts (None: none)."""
    if fp8_experts is None:
        return {}
    return {"precision": "fp8", **dict(zip(FP8_ARGS, fp8_experts))}
