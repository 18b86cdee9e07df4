"""How the experts' weights are stored and which activation runs between the projections (the C API's
megamoe_layout_t and megamoe_activation_t), as the ops and the modules take them.

    Layout(gate_up, w13_transposed, w2_transposed)
        gate_up "concatenated"  w13 [E, 2I, H]: rows [0, I) gate, [I, 2I) up (HF gate_up_proj; the default)
                "interleaved"   w13 [E, 2I, H]: row 2i gate i, row 2i + 1 up i (gpt-oss, torchtitan's fused w13)
                "separate"      w13 [E, I, H] the gate (torchtitan / prime-rl w1), w3 [E, I, H] the up projection
        w13_transposed          w13 (and w3) stored [E, H, 2I] ([E, H, I])  (HF is_transposed, gpt-oss gate_up_proj)
        w2_transposed           w2 stored [E, I, H]                          (HF is_transposed, gpt-oss down_proj)
    Activation(kind, limit, alpha)
        "swiglu"          silu(g) * u (limit and alpha 0)
        "clamped_swiglu"  gpt-oss: g' = min(g, limit), u' = clamp(u, -limit, limit), g' sigmoid(alpha g') (u' + 1)

The weights are read where they are, and their gradients come back in the same layout (dw13 shaped as w13).
Biases (b13 [E, 2I] in w13's gate/up arrangement, concatenated for "separate"; b2 [E, H]) are arguments of the ops.

The GEMMs' precision (the C API's megamoe_precision_t) is the third option of the ops:
    "bf16"  the default: the GEMMs read their operands in the dtype of x (bf16 in training; f16, and f32 / f64 on the
            CPU, alike)
    "fp8"   DeepSeek-V3's blockwise FP8 (fp8.py): e4m3 operands, activations scaled per 1 x 128 group, weights per
            128 x 128 block; CUDA on a compute capability 9.0 GPU, SwiGLU, no biases, H and I multiples of 128, the
            concatenated or separate layout, transposed or not (the interleaved one and anything else raise
            NotImplementedError naming it)
"""

from dataclasses import dataclass

import torch

from ._lib import ACTIVATION_CODES, GATE_UP_CODES, precision_code


@dataclass(frozen=True)
class Layout:
    """The storage of w13 (w3) and w2; see the module docstring."""

    gate_up: str = "concatenated"
    w13_transposed: bool = False
    w2_transposed: bool = False

    def __post_init__(self):
        if self.gate_up not in GATE_UP_CODES:
            raise ValueError(f"megamoe: layout.gate_up: unknown arrangement {self.gate_up!r} (one of "
                             f"{', '.join(GATE_UP_CODES)})")

    @property
    def separate(self):
        return self.gate_up == "separate"

    def intermediate(self, w2):
        """I, read off w2 ([E, H, I], or [E, I, H] transposed)."""
        return w2.shape[1] if self.w2_transposed else w2.shape[2]


@dataclass(frozen=True)
class Activation:
    """The activation between the projections; see the module docstring."""

    kind: str = "swiglu"
    limit: float = 0.0
    alpha: float = 0.0

    def __post_init__(self):
        if self.kind not in ACTIVATION_CODES:
            raise ValueError(f"megamoe: activation.kind: unknown activation {self.kind!r} (one of "
                             f"{', '.join(ACTIVATION_CODES)})")
        for name in ("limit", "alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"megamoe: activation.{name} must be a number, got {type(value).__name__}")


def clamped_swiglu(limit=7.0, alpha=1.702):
    """gpt-oss's activation: min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1)."""
    for name, value in (("limit", limit), ("alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"megamoe: clamped_swiglu: {name} must be a number, got {type(value).__name__}")
    return Activation("clamped_swiglu", float(limit), float(alpha))


CONCATENATED = Layout()  # Qwen3-MoE / HF gate_up_proj [E, 2I, H], down_proj [E, H, I]
INTERLEAVED = Layout("interleaved")  # torchtitan's fused w13 [E, 2I, H] with gate / up rows alternating
SEPARATE = Layout("separate")  # torchtitan / prime-rl: w1, w3 [E, I, H], w2 [E, H, I]
HF_TRANSPOSED = Layout("concatenated", True, True)  # HF is_transposed: gate_up_proj [E, H, 2I], down_proj [E, I, H]
GPT_OSS = Layout("interleaved", True, True)  # gpt-oss: gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H]
SWIGLU = Activation()
GPT_OSS_ACTIVATION = clamped_swiglu()


def op_options(layout=None, activation=None, precision="bf16"):
    """The keyword arguments of the custom ops (and of _lib.set_options) for a Layout, an Activation (None: the
    defaults) and a precision ("bf16" or "fp8"; another raises ValueError naming `precision`)."""
    layout = CONCATENATED if layout is None else layout
    activation = SWIGLU if activation is None else activation
    if not isinstance(layout, Layout):
        raise TypeError(f"megamoe: layout must be a megamoe.Layout, got {type(layout).__name__}")
    if not isinstance(activation, Activation):
        raise TypeError(f"megamoe: activation must be a megamoe.Activation, got {type(activation).__name__}")
    precision_code(precision)
    return dict(gate_up=layout.gate_up, w13_transposed=bool(layout.w13_transposed),
                w2_transposed=bool(layout.w2_transposed), activation=activation.kind, limit=float(activation.limit),
                alpha=float(activation.alpha), precision=precision)


def is_default_layout(options):
    """Whether op_options' dict has the default layout (w13 [E, 2I, H] concatenated, w2 [E, H, I]): the one the FP8
    weights are quantized from."""
    return options["gate_up"] == "concatenated" and not options["w13_transposed"] and not options["w2_transposed"]


def options_of(gate_up, w13_transposed, w2_transposed, activation, limit, alpha, precision="bf16"):
    """The inverse of op_options: the ops' arguments as the options dict."""
    return dict(gate_up=gate_up, w13_transposed=w13_transposed, w2_transposed=w2_transposed, activation=activation,
                limit=limit, alpha=alpha, precision=precision)


def arrange_weights(w13, w2, b13=None, layout=None):
    """Canonical expert weights (w13 [E, 2I, H]: gate rows, then up rows; w2 [E, H, I]; b13 [E, 2I] gate, then up, or
    None) stored as `layout` stores them (a copy, contiguous): dict of w13, w3 (None unless separate), w2, b13. For
    converting checkpoints and for tests and benchmarks; the ops read each layout in place. Arguments of other types
    or shapes raise TypeError / ValueError naming them."""
    layout = CONCATENATED if layout is None else layout
    if not isinstance(layout, Layout):
        raise TypeError(f"megamoe: layout must be a megamoe.Layout (e.g. megamoe.SEPARATE), got "
                        f"{type(layout).__name__}")
    for name, tensor in (("w13", w13), ("w2", w2), ("b13", b13)):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"megamoe: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"megamoe: w13: expected shape [E, 2I, H] (the canonical layout), got {list(w13.shape)}")
    E, two_i, H = w13.shape
    I = two_i // 2
    if list(w2.shape) != [E, H, I]:
        raise ValueError(f"megamoe: w2: expected shape [E, H, I] = {[E, H, I]} (from w13), got {list(w2.shape)}")
    if b13 is not None and list(b13.shape) != [E, 2 * I]:
        raise ValueError(f"megamoe: b13: expected shape [E, 2I] = {[E, 2 * I]} (from w13), got {list(b13.shape)}")
    gate, up = w13[:, :I], w13[:, I:]
    w3 = None
    if layout.gate_up == "interleaved":
        w13 = torch.stack((gate, up), dim=2).reshape(E, 2 * I, H)  # rows g0, u0, g1, u1, ...
        if b13 is not None:
            b13 = torch.stack((b13[:, :I], b13[:, I:]), dim=2).reshape(E, 2 * I)
    elif layout.gate_up == "separate":
        w13, w3 = gate, up
    if layout.w13_transposed:
        w13 = w13.transpose(1, 2)
        w3 = w3.transpose(1, 2) if w3 is not None else None
    if layout.w2_transposed:
        w2 = w2.transpose(1, 2)
    contiguous = [t.contiguous() if t is not None else None for t in (w13, w3, w2, b13)]
    return dict(zip(("w13", "w3", "w2", "b13"), contiguous))
