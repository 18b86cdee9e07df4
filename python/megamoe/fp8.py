"""Blockwise FP8 expert weights for `precision="fp8"` (megamoe.moe, grouped_moe and their backwards; DeepSeek-V3's
recipe, DESIGN.md section 7): the e4m3 copies of w13 and w2 the FP8 GEMMs read, one f32 scale per 128 x 128 block,
made from the 16-bit weights by the library (megamoe_quantize_experts) once per optimizer step.

Two ways to provide them:

    # explicit: a framework that knows when its weights change quantizes after its optimizer step
    fp8 = megamoe.fp8.quantize_experts(w13, w2)                      # Fp8Experts, on the current stream
    y = megamoe.moe(x, ids, weights, w13, w2, precision="fp8", fp8_experts=fp8)   # every micro-batch of the step

    # the cache: megamoe quantizes on the first call and reuses the copies while the weights are unchanged
    y = megamoe.moe(x, ids, weights, w13, w2, precision="fp8")       # fp8_experts=None: experts_for(w13, w2)

The cache (experts_for) keeps one Fp8Experts per pair of weights, keyed on the weights' identity (the tensors, or the
base of a view such as DTensor.to_local()'s), their data pointers, shapes, strides, dtypes, devices and version
counters (`_version`, which in-place updates through torch ops bump: `w.add_(...)`, `w.copy_(...)` under no_grad, the
foreach optimizers), and on a step generation that every torch.optim optimizer's step bumps (a global step post-hook,
registered when this module is imported): the fused optimizers (`AdamW(fused=True)`, the default of many trainers)
update weights without bumping their version counters, so the version alone would keep serving the previous step's
copies. So one quantization serves every micro-batch of an optimizer step, the forwards and the backwards, and the
next step makes the next call quantize again. An entry lives as long as both weights do (it holds them weakly and is
dropped with them) or until clear_cache(); a stale one is replaced at the next call for its weights. What the cache
cannot see: writes outside torch.optim that bypass the version counter (through `w.data`, by another library into the
weights' memory, FSDP all-gathering into the same buffer each step) with no optimizer step in between. Frameworks that
update weights so pass fp8_experts themselves (or call weights_changed() after each update). Tensors made anew on every call (`w.detach()`,
`torch.stack` of per-expert weights) miss the cache each time: quantized on each call, correctly, at that cost.

The transposed copies (w13_t, w2_t): by default every Fp8Experts holds them, 2 bytes per weight element.
quantize_experts(w13, w2, transposes=False) makes one-copy Fp8Experts (w13_t and w2_t None, 1 byte per weight
element): each backward then transposes w2 and w13 into its workspace (one buffer of E * 2I * H bytes, freed with it;
a copy-rate pass over 2 bytes per weight element per backward) and gives bitwise the same gradients.
set_cached_transposes(False) makes experts_for (the cache, and its quantization under torch.compile) one-copy too.

Under torch.compile (torch.compiler.is_compiling()) and while a CUDA graph is being captured, experts_for does not
use the cache: it calls quantize_experts, which is the custom op megamoe::quantize_experts (with a fake kernel), so
the quantization is part of the graph and runs on each of its calls; to quantize once per step there, call
quantize_experts outside the compiled / captured region and pass fp8_experts.

The backward reads the FP8 weights its forward was given (autograd saves them): quantizing again (a new Fp8Experts,
as quantize_experts and the cache always make) never changes what a pending backward reads.
"""

import weakref
from typing import NamedTuple, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _lib
from . import fp8_reference
from .dtensor import refuse_dtensors
from .layouts import is_default_layout

BLOCK = 128  # the weights' scale blocks: 128 x 128


class Fp8Experts(NamedTuple):
    """The expert weights in blockwise FP8, as the C API's megamoe_fp8_experts_t (the same order), contiguous:

        w13         [E, 2I, H]               float8_e4m3fn   w13 in 128 x 128 blocks (rows [0, I) gate, [I, 2I) up)
        w13_t       [E, H, 2I]               float8_e4m3fn   its transpose (the dX GEMM reads it K-major), or None
        w13_scales  [E, 2I / 128, H / 128]   float32         one per block (w13_t's blocks: the same, transposed)
        w2          [E, H, I]                float8_e4m3fn
        w2_t        [E, I, H]                float8_e4m3fn   its transpose (the dH GEMM), or None
        w2_scales   [E, H / 128, I / 128]    float32

    q = e4m3(v * (448 / amax)) rounded to nearest even, scale = amax / 448 of the block in f32 (a block of zeros:
    scale 1; one holding a NaN or an infinity: NaN; megamoe.fp8_reference has every rule). Memory, in two forms:
    with the transposed copies (quantize_experts' default), one byte per weight element twice, as much as the 16-bit
    weights themselves; one-copy (transposes=False: w13_t and w2_t None; an empty [0] tensor counts as None too), one
    byte per weight element, and each backward transposes w2 and w13 into its workspace (E * 2I * H bytes while it
    runs). Either plus 4 bytes of scale per 16384 elements. The cache keeps one such set per pair of weights (per
    layer) for as long as the weights live, in the form set_cached_transposes chose.
    """

    w13: torch.Tensor
    w13_t: Optional[torch.Tensor]
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_t: Optional[torch.Tensor]
    w2_scales: torch.Tensor


assert Fp8Experts._fields == _lib.FP8_FIELDS  # the C struct's order


def _blocks(extent):
    return (extent + BLOCK - 1) // BLOCK


def _check_weights(w13, w2):
    for name, tensor in (("w13", w13), ("w2", w2)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            raise ValueError(f"megamoe.fp8.quantize_experts: {name} must be a 3-dimensional tensor (w13 [E, 2I, H], "
                             f"w2 [E, H, I]), got {getattr(tensor, 'shape', type(tensor).__name__)}")


_TRANSPOSED = ("w13_t", "w2_t")  # the fields a one-copy Fp8Experts leaves None


def empty_experts(w13, w2, transposes=True):
    """Uninitialised Fp8Experts for w13 [E, 2I, H] and w2 [E, H, I], on their device (what quantize_experts fills);
    transposes=False: w13_t and w2_t None."""
    _check_weights(w13, w2)
    E, two_i, H = w13.shape
    H2, I = w2.shape[1], w2.shape[2]
    e4m3 = torch.float8_e4m3fn
    return Fp8Experts(
        w13=w13.new_empty((E, two_i, H), dtype=e4m3),  # [E, 2I, H]
        w13_t=w13.new_empty((E, H, two_i), dtype=e4m3) if transposes else None,  # [E, H, 2I]
        w13_scales=w13.new_empty((E, _blocks(two_i), _blocks(H)), dtype=torch.float32),  # [E, 2I / 128, H / 128]
        w2=w2.new_empty((w2.shape[0], H2, I), dtype=e4m3),  # [E, H, I]
        w2_t=w2.new_empty((w2.shape[0], I, H2), dtype=e4m3) if transposes else None,  # [E, I, H]
        w2_scales=w2.new_empty((w2.shape[0], _blocks(H2), _blocks(I)), dtype=torch.float32))  # [E, H / 128, I / 128]


def _reference_blocks(w, transposes):
    """(q, q transposed or None, scales) of w [E, N, K] by fp8_reference (the recipe's specification, bitwise the
    kernels')."""
    q, scales = fp8_reference.quantize_blocks(w)
    return q, q.transpose(1, 2).contiguous() if transposes else None, scales


def _op_outputs(experts, like):
    """The op's six tensors of `experts`: an absent transposed copy as an empty [0] e4m3 tensor (a custom op returns
    tensors only)."""
    return tuple(like.new_empty((0,), dtype=torch.float8_e4m3fn) if t is None else t for t in experts)


@torch.library.custom_op("megamoe::quantize_experts", mutates_args=())
def _quantize_op(w13: torch.Tensor, w2: torch.Tensor, transposes: bool = True) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if not w13.is_cuda:  # CPU: the reference (the C API quantizes CUDA tensors only; the FP8 layer runs on CUDA)
        return _op_outputs((*_reference_blocks(w13, transposes), *_reference_blocks(w2, transposes)), w13)
    out = empty_experts(w13, w2, transposes)
    _lib.quantize_experts_into(w13.contiguous(), w2.contiguous(), out)  # None: absent, not written
    return _op_outputs(out, w13)


@_quantize_op.register_fake
def _quantize_fake(w13, w2, transposes=True):
    return _op_outputs(empty_experts(w13, w2, transposes), w13)


def quantize_experts(w13, w2, transposes=True):
    """Fp8Experts of w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] (bf16, f16 or f32; the default layout):
    every 128 x 128 block of each weight quantized to e4m3 with its f32 scale, and (transposes=True, the default) the
    transposed copies, written by the library on the current CUDA stream (asynchronously; CPU tensors:
    fp8_reference's quantize_blocks, the same bytes). transposes=False: w13_t and w2_t None, half the memory, each
    backward transposing in its workspace instead (Fp8Experts). New tensors on every call; no gradient flows through
    them. The torch custom op megamoe::quantize_experts(w13, w2, transposes) underneath (with a fake kernel), so
    torch.compile traces it; the op returns an empty [0] tensor for each absent copy, which this function turns into
    None. H and I multiples of 128 (else the library's NotImplementedError names them); other errors as the library
    reports them (ValueError); transposes not a bool: TypeError."""
    _check_weights(w13, w2)
    if not isinstance(transposes, bool):
        raise TypeError(f"megamoe.fp8.quantize_experts: transposes must be True or False, got "
                        f"{type(transposes).__name__}")
    tensors = torch.ops.megamoe.quantize_experts(w13.detach(), w2.detach(), transposes)
    return _experts_of(tensors)


# ---- the cache

class _Entry:
    """One pair of weights' Fp8Experts and the state of the weights it was made from."""

    def __init__(self, key, roots, state, experts):
        self.state, self.experts = state, experts
        self.refs = tuple(weakref.ref(root, _dropper(key)) for root in roots)

    def holds(self, roots, state):
        return all(ref() is root for ref, root in zip(self.refs, roots)) and self.state == state


_CACHE = {}  # (id of w13's root, id of w2's root) -> _Entry
_cached_transposes = True  # set_cached_transposes: the form of experts_for's Fp8Experts


def set_cached_transposes(enabled):
    """Sets the form of the Fp8Experts experts_for makes after this call (the cache's, and those it quantizes in a
    compiled or captured graph): True (the default) with the transposed copies, False one-copy (w13_t and w2_t None:
    1 byte per weight element held between steps instead of 2, each backward transposing in its workspace;
    Fp8Experts). An entry of the other form is replaced at its weights' next call. TypeError for a non-bool."""
    global _cached_transposes
    if not isinstance(enabled, bool):
        raise TypeError(f"megamoe.fp8.set_cached_transposes: enabled must be True or False, got "
                        f"{type(enabled).__name__}")
    _cached_transposes = enabled


def cached_transposes():
    """Whether experts_for's Fp8Experts hold the transposed copies (set_cached_transposes)."""
    return _cached_transposes


def _dropper(key):
    """The weakref callback dropping the entry under `key` when one of its weights dies (not a newer entry under a
    reused id; it refers to no entry, so a dropped one is freed at once, not by the cycle collector)."""

    def drop(ref):
        entry = _CACHE.get(key)
        if entry is not None and any(own is ref for own in entry.refs):
            del _CACHE[key]

    return drop


def _root(tensor):
    """The tensor whose identity stands for `tensor`: a view's base (DTensor.to_local() and w.view(...) make a new
    view on each call; they share the base's memory and version counter), else itself."""
    return tensor._base if tensor._base is not None else tensor


_step_generation = 0  # bumped by every torch.optim optimizer step (and weights_changed): part of every cache state


def weights_changed():
    """Tell the cache that weights may have changed in ways it cannot see (writes through `w.data` or raw memory with
    no torch.optim step after them): every call after this quantizes its weights again."""
    global _step_generation
    _step_generation += 1


def _after_optimizer_step(optimizer, args, kwargs):  # torch.optim's global step post-hook
    weights_changed()


_STEP_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


def _state(tensor):
    """What must be unchanged for a quantization of `tensor` to stand: where and how it lies, its version, and no
    optimizer step since (fused optimizers do not bump versions)."""
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device, tensor._version,
            _step_generation)


def _bypasses_cache(w13):
    if torch.compiler.is_compiling():
        return True
    return w13.is_cuda and torch.cuda.is_current_stream_capturing()


def default_layout_weights(w13, w2, w3=None, options=None):
    """(w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I]): the weights as the FP8 copies are quantized from. The
    default layout as it is; the separate layout's gate w13 and up w3 concatenated, transposed storage transposed
    back (options: layouts.op_options'; a copy of the weight for the length of the quantization). The interleaved
    layout raises NotImplementedError (the FP8 layer does not take it: DESIGN §7)."""
    if options is None or is_default_layout(options):
        return w13, w2
    if options["gate_up"] == "interleaved":
        raise NotImplementedError("megamoe: precision 'fp8' does not take the interleaved gate / up layout (its dSwiGLU "
                                  "epilogue writes dh in w13's row order, the FP8 dX reads it concatenated); the "
                                  "concatenated and separate layouts, transposed or not, run")
    def stored(w):  # [E, rows, H] from the stored [E, rows, H] or, transposed, [E, H, rows]
        return w.transpose(1, 2) if options["w13_transposed"] else w

    if options["gate_up"] == "separate":
        if w3 is None:
            raise ValueError("megamoe: the separate layout needs w3 (the up projection)")
        w13 = torch.cat([stored(w13), stored(w3)], dim=1)  # [E, 2I, H]
    else:
        w13 = stored(w13).contiguous()
    return w13, (w2.transpose(1, 2).contiguous() if options["w2_transposed"] else w2)


def experts_for(w13, w2, w3=None, options=None):
    """The Fp8Experts of w13 and w2 (and w3 in the separate layout; options: layouts.op_options', None: the default
    layout) from the cache (see the module docstring), quantizing them (default_layout_weights, then
    quantize_experts) where the cache has none for their current state, with the transposed copies or not as
    set_cached_transposes chose. Under torch.compile and CUDA graph capture: quantized anew, in the graph (no
    cache)."""
    transposes = _cached_transposes

    def quantize():
        return quantize_experts(*default_layout_weights(w13, w2, w3, options), transposes=transposes)

    if _bypasses_cache(w13):
        return quantize()
    weights = (w13, w2) if w3 is None else (w13, w2, w3)
    for tensor in weights:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            _check_weights(w13, w2)  # names the argument
    try:
        state = (*(_state(w) for w in weights), transposes)
    except RuntimeError:  # inference tensors have no version counter: nothing to key on
        return quantize()
    roots = tuple(_root(w) for w in weights)
    key = tuple(id(root) for root in roots)
    entry = _CACHE.get(key)
    if entry is not None and entry.holds(roots, state):
        return entry.experts
    experts = quantize()
    _CACHE[key] = _Entry(key, roots, state, experts)
    return experts


def clear_cache():
    """Drop every cached Fp8Experts (the memory goes back once no pending backward holds them)."""
    _CACHE.clear()


def cache_size():
    """The number of cached Fp8Experts (pairs of weights)."""
    return len(_CACHE)


# ---- the ops' FP8 arguments

def _absent(tensor):
    """An absent transposed copy: None, or an empty [0] tensor (the quantize op's stand-in)."""
    return tensor is None or (tensor.dim() == 1 and tensor.shape[0] == 0)


def _experts_of(tensors):
    """Fp8Experts of six tensors, an absent transposed copy (None or the op's empty stand-in) as None."""
    return Fp8Experts(*(None if name in _TRANSPOSED and _absent(t) else t
                        for name, t in zip(Fp8Experts._fields, tensors)))


def as_experts(entry, fp8_experts):
    """fp8_experts as an Fp8Experts of six tensors, w13_t and w2_t possibly None (an empty [0] one taken as None;
    TypeError naming the argument otherwise; DTensors refused: the FP8 weights are this rank's, quantized from the
    local weights)."""
    if not isinstance(fp8_experts, (tuple, list)) or len(fp8_experts) != len(Fp8Experts._fields) or not all(
            isinstance(t, torch.Tensor) or (t is None and name in _TRANSPOSED)
            for name, t in zip(Fp8Experts._fields, fp8_experts)):
        raise TypeError(f"{entry}: fp8_experts must be a megamoe.fp8.Fp8Experts (megamoe.fp8.quantize_experts(w13, "
                        f"w2)), got {type(fp8_experts).__name__}")
    experts = _experts_of(fp8_experts)
    refuse_dtensors(entry, "the FP8 weights are plain tensors",
                    **{f"fp8_experts.{name}": t for name, t in zip(Fp8Experts._fields, experts) if t is not None})
    return experts


def op_arguments(entry, options, w13, w2, fp8_experts, *, quantize=True, w3=None):
    """The FP8 op arguments {fp8_w13: ..., ...} (_lib.FP8_ARGS) of a call with op_options() `options`: none in
    precision "bf16" (fp8_experts given there: ValueError); in "fp8" the tensors of fp8_experts (always in the default
    layout: w13 [E, 2I, H], w2 [E, H, I]; a one-copy one's fp8_w13_t and fp8_w2_t None: absent in the C API), else the
    cache's for w13, w2 (and w3) in their layout (quantize=False: uninitialised ones, for a path query that reads no
    data). The interleaved layout raises NotImplementedError."""
    if options["precision"] != "fp8":
        if fp8_experts is not None:
            raise ValueError(f"{entry}: fp8_experts: given, but precision is {options['precision']!r} (the FP8 weights "
                             "are read with precision='fp8' only)")
        return {}
    if options["gate_up"] == "interleaved":
        raise NotImplementedError(
            f"{entry}: precision 'fp8' does not take the interleaved gate / up layout (gpt-oss's): its dSwiGLU epilogue "
            "writes dh in w13's row order and the FP8 dX reads it concatenated; the concatenated and separate layouts, "
            "transposed or not, run")
    if fp8_experts is not None:
        experts = as_experts(entry, fp8_experts)
    elif quantize:
        experts = experts_for(w13, w2, w3, options)
    else:
        experts = empty_experts(*_default_layout_shapes(w13, w2, w3, options))
    return dict(zip(_lib.FP8_ARGS, experts))


def _default_layout_shapes(w13, w2, w3, options):
    """Tensors shaped as default_layout_weights' results, on the weights' device, holding no memory (expanded from
    one element: empty_experts reads only their shapes, dtype and device)."""
    E = w13.shape[0]
    H, I = (w2.shape[2], w2.shape[1]) if options["w2_transposed"] else (w2.shape[1], w2.shape[2])
    return w13.new_empty(1).expand(E, 2 * I, H), w2.new_empty(1).expand(E, H, I)
