"""The whole layer's PyTorch face: the `megamoe::moe_forward`, `megamoe::moe_backward` and
`megamoe::moe_backward_accumulate` custom ops (generated from the argument description below by op_family.py, with
fake kernels and autograd) over the C API's megamoe_forward / megamoe_backward, and the Python entry points moe,
moe_backward and path_of. CPU tensors run the C++ reference, CUDA tensors the CUDA path, on the current stream, with
every buffer allocated through torch (so CUDA graphs and the caching allocator just work).

The experts' layout and activation (layouts.py) and their optional w3, b13, b2 are plain arguments of the ops; the
weight gradients come back in the parameters' own layout. With main_grads (main_grads.py) the weight gradients are
added into the caller's f32 buffers by moe_backward_accumulate, which declares them mutated. precision="fp8" runs the
GEMMs in blockwise FP8 on the FP8 weights of fp8.py (the caller's fp8_experts, or the cache's), optional tensor
arguments of the ops that the forward saves for its backward.
"""

import torch

from .argument_errors import ARGUMENT_ERRORS, raise_argument_error
from .dtensor import refuse_dtensor_activations, replicated_local
from .op_family import EntryPoint, OpFamily, gradients, tensor_args

MoEGrads = gradients("MoEGrads", __name__, "x", "topk_weights", """moe_backward's gradients: dx [T, H], dtopk_weights
[T, topk], dw13, dw2, dw3 (shaped as w13, w2, w3), db13 [E, 2I], db2 [E, H]; None where not asked for or where the
parameter is absent.""")
GRAD_NAMES = MoEGrads._fields  # moe_backward's outputs, in order


def _num_slots(a):
    """T * topk of topk_ids [T, topk] (None for another rank)."""
    ids = a["topk_ids"]
    return ids.shape[0] * ids.shape[1] if ids.dim() == 2 else None


def _too_many_slots(a):
    T, topk = a["topk_ids"].shape
    return f"topk_ids: T * topk = {T} * {topk} exceeds 2^31 - 1 slots"


OPS = OpFamily(EntryPoint(name="moe", user_entry="megamoe.moe", c_prefix="", output="y", grad_output="dy",
                          inputs=tensor_args("x", "topk_ids", "topk_weights", "w13", "w2"), grads=MoEGrads,
                          num_slots=_num_slots, too_many_slots=_too_many_slots))

# torch.ops.megamoe.moe_forward(x, topk_ids, topk_weights, w13, w2, keep_h=False, w3, b13, b2, <options>, fp8_*,
# main_grad_*) -> (y [T, H], h [T*topk, 2I] by sorted row when keep_h, else [0])
moe_forward = OPS.forward_op


def _replicated_weights(entry, x, topk_ids, topk_weights, w13, w2, experts):
    """The inputs and experts as plain tensors: the local tensors of replicated DTensor weights (dtensor.py)."""
    refuse_dtensor_activations(entry, x=x, topk_ids=topk_ids, topk_weights=topk_weights)
    w13, w2 = replicated_local(entry, "w13", w13), replicated_local(entry, "w2", w2)
    inputs = dict(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2)
    return inputs, {name: replicated_local(entry, name, tensor) for name, tensor in experts.items()}


def moe(x, topk_ids, topk_weights, w13, w2, recompute=False, *, w3=None, b13=None, b2=None, layout=None,
        activation=None, main_grads=None, precision="bf16", fp8_experts=None):
    """Routed-expert MLP (DESIGN.md section 1), differentiable in x, topk_weights and the expert parameters.

    x [T, H]; topk_ids [T, topk] int32/int64 in [0, E) or -1 (dropped); topk_weights [T, topk] f32 or
    x's dtype; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]. Returns y [T, H] in x's dtype:
    y_t = sum_j topk_weights[t, j] * w2[e] (silu(w13[e, :I] x_t) * (w13[e, I:] x_t)), e = topk_ids[t, j].

    Other layouts and activations (megamoe.Layout, megamoe.Activation; layouts.py): layout=megamoe.SEPARATE takes the
    up projection as w3, layout=megamoe.GPT_OSS gpt-oss's interleaved transposed weights, activation=
    megamoe.clamped_swiglu(7.0, 1.702) its activation; b13 [E, 2I] (arranged as w13's rows) and b2 [E, H] are
    optional biases: o = w2[e] act(w13[e] x_t + b13[e]) + b2[e]. CUDA runs every option, on the fused
    sm_90a kernels on a Hopper GPU (a w3 or bias too misaligned for them takes the portable CUDA kernels, and a
    one-time warning names it); megamoe.path_of tells which path a call takes and why.

    Memory mode when gradients are wanted: by default the forward keeps h = [g, u] ([T*topk, 2I], the fastest
    backward, which writes dh over it: one backward per forward); recompute=True keeps only the inputs and recomputes
    h in the backward (same gradients; also for graphs backpropagated more than once).

    DTensor weights (every placement Replicate, as FSDP2 presents replicated parameters in its forward) are read
    through .to_local() and get DTensor gradients; sharded ones raise ValueError (megamoe.ep.moe takes expert-sharded
    weights), DTensor activations TypeError (dtensor.py).

    main_grads (Megatron-style gradient accumulation fusion; main_grads.py): f32 buffers for the weights, e.g.
    (w13.main_grad, w2.main_grad), as a tuple in the order (w13, w2, w3, b13, b2) (None entries: no buffer) or a dict
    by name. Each buffer is a contiguous float32 tensor shaped as its parameter (a DTensor weight's local tensor), on
    its device, not requiring grad. What the user gets: every backward through this call adds the weight's gradient
    into its buffer (buffer = buffer + grad, in f32, in the kernels' epilogue: no extra pass; bitwise the same for the
    same inputs and initial buffer; experts with no tokens leave their part untouched), only for weights that require
    grad; autograd's gradient of such a weight is None (its .grad is not created or changed, and hooks on its
    gradient accumulation do not run for this call); weights without a buffer, x and topk_weights get their usual
    gradients. Two backwards (two calls, or one graph backpropagated twice with recompute=True) add twice. The buffers
    are kept by reference, not saved for backward: in eager mode other backwards may add into them in between (several
    microbatches in flight). Under torch.compile the op declares the buffers mutated (megamoe::moe_backward_accumulate)
    and the compiled backward adds into them in place; the compiled graph saves them for its backward, so there each
    compiled forward's backward must run before another backward adds into the same buffers (forward, backward per
    microbatch). Zeroing the buffers between steps is the caller's (Megatron's zero_grad_buffer).

    precision: "bf16" (the default: the GEMMs in the dtype of x) or "fp8": DeepSeek-V3's blockwise FP8 (fp8.py): the
    up, down, dH and dX GEMMs read e4m3 operands, x, a, dy and dh scaled per 1 x 128 group (quantized by the
    kernels), the weights per 128 x 128 block; routing, combine, d topk_weights, y and dx as in "bf16", the weight
    gradients computed from the 16-bit operands as in "bf16" (in the weights' dtype). CUDA on a compute capability
    9.0 GPU, SwiGLU, no biases, H and I multiples of 128, the concatenated or separate layout (transposed or not; the
    FP8 copies are quantized from the weights brought into the default layout, a transient copy where they are stored
    otherwise): anything else (the interleaved layout) raises NotImplementedError naming it (never a silent bf16
    run); another precision string ValueError. The FP8 weights:
    fp8_experts, a megamoe.fp8.Fp8Experts the caller made (megamoe.fp8.quantize_experts(w13, w2), e.g. after each
    optimizer step), else megamoe.fp8.experts_for(w13, w2): quantized on the first call, cached while w13 and w2 are
    unchanged (their identity, memory and version counters), so one quantization serves every micro-batch of a step;
    under torch.compile, quantized in the graph on each call. The backward reads the FP8 weights its forward read
    (saved with the inputs). One-copy FP8 weights (quantize_experts(..., transposes=False), or the cache after
    megamoe.fp8.set_cached_transposes(False)) hold half the bytes; the backward transposes them in its workspace and
    gives the same bits.
    """
    try:
        inputs, experts = _replicated_weights("megamoe.moe", x, topk_ids, topk_weights, w13, w2,
                                              dict(w3=w3, b13=b13, b2=b2))
        call = OPS.forward_call(inputs, experts, recompute, layout, activation, main_grads, precision, fp8_experts)
    except ARGUMENT_ERRORS as error:
        return raise_argument_error(error, x)  # eager: raised now; traced: by the graph (argument_errors.py)
    return OPS.forward(call)


def moe_backward(dy, x, topk_ids, topk_weights, w13, w2, saved_h=None, wgrad_f32=False, *, w3=None, b13=None, b2=None,
                 layout=None, activation=None, grads=None, main_grads=None, precision="bf16", fp8_experts=None):
    """MoEGrads (dx, d topk_weights, dw13, dw2, dw3, db13, db2) of moe_forward's inputs given dy [T, H]; None for
    those not in `grads` (names of GRAD_NAMES; None: all) and for absent parameters. saved_h: moe_forward's h (keep-h
    mode; consumed: dh is written over it, so it serves one backward) or None (recompute h). wgrad_f32: the weight
    and bias gradients in f32 (main-grad style) instead of the parameters' dtype. layout / activation: as the
    forward's (layouts.py). Plain tensors only (a DTensor raises TypeError: pass its .to_local()).

    main_grads (Megatron's main_grad; main_grads.py): f32 buffers shaped as w13, w2 (, w3, b13, b2), as a tuple in that
    order or a dict by name; the backward adds each wanted weight gradient into its buffer in the kernels' epilogue
    (buffer = buffer + grad, deterministic), and MoEGrads holds that same buffer there. Wanted weight gradients without
    a buffer come back as with wgrad_f32.

    precision / fp8_experts: as the forward's (megamoe.moe): "fp8" reads the FP8 weights fp8_experts (pass the ones
    the forward read), else megamoe.fp8.experts_for(w13, w2)'s."""
    return OPS.backward("megamoe.moe_backward", dy, dict(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13,
                                                         w2=w2), saved_h, wgrad_f32, dict(w3=w3, b13=b13, b2=b2),
                        layout, activation, grads, main_grads, precision, fp8_experts)


def path_of(x, topk_ids, topk_weights, w13, w2, *, w3=None, b13=None, b2=None, layout=None, activation=None,
            backward=False, precision="bf16", fp8_experts=None):
    """Which implementation megamoe.moe's forward (backward=True: its backward) runs on these arguments: "reference"
    (CPU tensors), "cuda" (the portable CUDA kernels), "sm90" (the fused Hopper kernels), "sm90+cuda-weight-grads"
    (backward: sm_90a GEMMs, portable weight gradients) or "sm90-fp8" (precision="fp8"), as a str with `.reason`:
    what keeps a call the fused sm_90a kernels would otherwise run on the portable ones (e.g. "w3 not 16-byte
    aligned: ..."), else None. A call its path cannot run raises as the call would (precision="fp8" on the CPU or off
    sm_90: NotImplementedError). Reads no data (allocates one [T, H] output for the forward's query, and for
    precision="fp8" without fp8_experts uninitialised FP8 weights)."""
    inputs, experts = _replicated_weights("megamoe.path_of", x, topk_ids, topk_weights, w13, w2,
                                          dict(w3=w3, b13=b13, b2=b2))
    return OPS.path("megamoe.path_of", inputs, experts, layout, activation, backward, precision, fp8_experts)
