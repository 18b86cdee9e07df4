"""The peers timed beside megamoe (DESIGN §4): SonicMoE (when `import sonicmoe` works), the torch path under
torch.compile, and torchao's FP8 grouped GEMM in that path (when `import torchao` works on an sm_90+ GPU). A peer has
`about` (what ran) or `missing` (why not), and for_case(case) gives its Impl for a case.

SonicMoE is called as ../shared/tools/peers/README.md says: moe_general_routing_inputs with token-major flat slot
lists, w1 [2I, H, E] (gate / up rows interleaved, stride order (2, 0, 1)) and w2 [H, I, E], its own weight leaves
built once per case. Two peers run it: `sonicmoe` with QuACK's default GEMM configs (tuned=False: no autotuning) and
`sonicmoe-tuned` with QuACK's autotuned GEMMs (tuned=True, SonicMoE's own default: each GEMM shape is autotuned on
its first call, minutes, and the choice cached under QUACK_CACHE_DIR). sonicmoe's modules call the GEMMs by the
names they imported from quack.gemm_interface (GemmBinding), so each variant binds its set of functions into those
modules right before each of its calls (SonicMoE._moe; the invariant is stated there).

torchao-fp8 is the torch `_grouped_mm` path of torch_moe_baseline.py with both grouped GEMMs replaced by torchao
0.18's differentiable rowwise FP8 grouped GEMM, `_to_fp8_rowwise_then_scaled_grouped_mm` (e4m3, power-of-two scales,
`torch._scaled_grouped_mm`): what torchao's FP8 MoE training conversion runs on Hopper. That GEMM needs every group's
row count to be a multiple of 16 (its own padding, pad_token_groups_for_grouped_mm=True, is refused by 0.18's forward),
so the routing permutation pads each expert's rows to a multiple of 16 with zero rows, on the device, timed with it.
"""
import functools
import importlib.metadata
import inspect
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from impls import FP8_TOLERANCE, CompiledTorchPath, Impl, fp8_device_missing
from timing import short

PEERS = ("sonicmoe", "sonicmoe-tuned", "torch_compiled", "torchao-fp8", "deepgemm-fp8")
# The peers a run takes unless told (--peers): all but sonicmoe-tuned, whose first call of a shape autotunes every GEMM
# for minutes (with a carried QUACK_CACHE_DIR: scripts/quack_cache.sh, docs/benchmark.md).
DEFAULT_PEERS = tuple(name for name in PEERS if name != "sonicmoe-tuned")
QUACK_GEMMS = ("gemm", "gemm_gated", "gemm_dgated")  # quack.gemm_interface names sonicmoe.functional imports
MUST_PATCH = ("sonicmoe.functional.forward.gemm", "sonicmoe.functional.forward.gemm_gated",
              "sonicmoe.functional.backward.gemm", "sonicmoe.functional.backward.gemm_dgated")


class PeerMissing(Exception):
    """A peer that cannot run here; the message says why."""


def _binds(fn, original):
    """Whether fn is `original` or our tuned=False partial of it (what a variant binds)."""
    return fn is original or (isinstance(fn, functools.partial) and fn.func is original and not fn.args
                              and fn.keywords == {"tuned": False})


class GemmBinding:
    """The QUACK_GEMMS names that sonicmoe's modules imported from quack.gemm_interface (`slots`: (module, name)),
    and the functions one variant binds there (`functions`: name -> QuACK's own function, tuned=True by default, or a
    tuned=False partial of it). Calling it binds them: sonicmoe's forward and backward look these names up as module
    globals when they run, so whatever is bound then is what runs."""

    def __init__(self, gemm_interface, modules, tuned):
        self.tuned, self.slots, self.functions = tuned, [], {}
        for name in QUACK_GEMMS:
            original = getattr(gemm_interface, name)
            self.functions[name] = original if tuned else functools.partial(original, tuned=False)
            self.slots += [(mod, name) for mod in modules if _binds(getattr(mod, name, None), original)]

    def names(self):
        """'module.name' of every slot."""
        return [f"{mod.__name__}.{name}" for mod, name in self.slots]

    def __call__(self):
        for mod, name in self.slots:
            setattr(mod, name, self.functions[name])


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def quack_cache_dir():
    """Where QuACK keeps its autotuning results: $QUACK_CACHE_DIR, else its default (~/.quack/cache)."""
    return os.environ.get("QUACK_CACHE_DIR", "").strip() or os.path.join(os.path.expanduser("~"), ".quack", "cache")


def load_sonicmoe(tuned=False):
    """SimpleNamespace(moe, swiglu, stream, bind, about) for SonicMoE with QuACK's default GEMM configs (tuned=False:
    no autotuning) or its autotuned ones (tuned=True); bind() puts that choice into sonicmoe's modules (done here once,
    and by SonicMoE before each call). PeerMissing if it cannot be imported or its GEMM names cannot be found."""
    try:
        from sonicmoe import moe_general_routing_inputs
        from sonicmoe.enums import ActivationType
        import quack.gemm_interface as gemm_interface
    except ImportError as ex:
        raise PeerMissing(f"not installed: {short(ex)}") from ex
    except Exception as ex:  # noqa: BLE001 - any failure to import is a reason, not a crash
        raise PeerMissing(f"import failed: {short(ex)}") from ex
    modules = [m for n, m in list(sys.modules.items()) if n == "sonicmoe" or n.startswith("sonicmoe.")]
    bind = GemmBinding(gemm_interface, modules, tuned)
    left = [n for n in MUST_PATCH if n not in bind.names()]
    if left:
        what = "use QuACK's autotuned GEMMs" if tuned else "switch off QuACK autotuning"
        raise PeerMissing(f"cannot {what}: {', '.join(left)} not imported from quack.gemm_interface (another"
                          " sonic-moe version?)")
    bind()
    about = (f"sonic-moe {_version('sonic-moe')} on quack-kernels {_version('quack-kernels')}, nvidia-cutlass-dsl"
             f" {_version('nvidia-cutlass-dsl')}; " +
             (f"QuACK's autotuned GEMM configs (tuned=True, SonicMoE's default: each GEMM shape autotuned on its first"
              f" call, before timing; cached under QUACK_CACHE_DIR={quack_cache_dir()})" if tuned else
              "QuACK default GEMM configs (tuned=False, no autotuning)"))
    return SimpleNamespace(moe=moe_general_routing_inputs, swiglu=ActivationType.SWIGLU,
                           stream=lambda: torch.cuda.current_stream().cuda_stream, bind=bind, about=about)


def load_sonicmoe_tuned():
    return load_sonicmoe(tuned=True)


def flat_routing(ids):
    """SonicMoE's routing from topk_ids [T, k]: (token_indices, expert_indices) int32 [S] sorted by token, and the
    flat slot positions kept (None when no slot is dropped; dropped slots, id -1, are left out)."""
    T, k = ids.shape
    experts = ids.reshape(-1)  # [T*k]
    tokens = torch.arange(T, device=ids.device, dtype=torch.int32).repeat_interleave(k)  # [T*k]
    kept = experts >= 0
    if bool(kept.all()):  # one host sync per case, outside any timed region
        return tokens, experts.to(torch.int32), None
    slots = kept.nonzero().squeeze(1)  # [S]
    return tokens[slots], experts[slots].to(torch.int32), slots


def interleave_gate_up(w13):
    """w13 [E, 2I, H] (gate rows, then up rows) -> w1 [2I, H, E], rows gate_0, up_0, gate_1, ..., stride order
    (2, 0, 1): SonicMoE's layout (a copy)."""
    E, I2, H = w13.shape
    return torch.stack([w13[:, :I2 // 2], w13[:, I2 // 2:]], 2).reshape(E, I2, H).permute(1, 2, 0)


def deinterleave_gate_up(dw1, experts):
    """Gradient of w1 [2I, H, E] -> dw13 [n, 2I, H] of the experts, in megamoe's gate-then-up row order."""
    g = dw1.permute(2, 0, 1)[experts]  # [n, 2I, H], rows interleaved
    n, I2, H = g.shape
    return g.reshape(n, I2 // 2, 2, H).transpose(1, 2).reshape(n, I2, H)


class SonicMoE(Impl):
    """SonicMoE on one case: its weight leaves w1 [2I, H, E] (a copy) and w2 [H, I, E] (a view of the case's w2),
    made once; the routing lists made once per topk_ids tensor. `name` is the peer's (sonicmoe or sonicmoe-tuned)."""

    def __init__(self, api, case, name="sonicmoe"):
        super().__init__(name, self._moe)
        self.api, self.w13, self.w2 = api, case.w13, case.w2
        with torch.no_grad():
            self.w1_sonic = interleave_gate_up(case.w13.detach()).requires_grad_()  # [2I, H, E]
            self.w2_sonic = case.w2.detach().permute(1, 2, 0).requires_grad_()  # [H, I, E]
        self.ids, self.routing = None, None

    def _moe(self, x, ids, topk_weights, w13, w2):
        """One call, with this variant's GEMMs bound into sonicmoe's modules first (api.bind). That covers its
        backward too, because every caller runs a call's backward before any other implementation's next call:
        bench.py and the profile scripts run each step to its end (a fwd+bwd step is the forward then
        torch.autograd.grad, whose backward runs while the calling thread waits; reference.path_outputs calls
        y.backward at once), and a CUDA-graph capture runs this Python once, inside the capture, with this binding,
        after which a replay launches the captured kernels without Python. Holding a graph across another variant's
        call and running its backward later would break this."""
        if w13 is not self.w13 or w2 is not self.w2:
            raise ValueError("this SonicMoE wrapper holds the weights of another case")
        if ids is not self.ids:
            self.ids, self.routing = ids, flat_routing(ids)
        tokens, experts, slots = self.routing
        scores = topk_weights.reshape(-1).float()  # [T*k] f32: its gradient is d topk_weights
        if slots is not None:
            scores = scores[slots]  # [S]
        bind = getattr(self.api, "bind", None)
        if bind is not None:
            bind()
        y, _ = self.api.moe(x, scores, tokens, experts, self.w1_sonic, None, self.w2_sonic, None, w2.shape[0],
                            self.api.stream(), self.api.swiglu, not torch.is_grad_enabled())
        return y  # [T, H]

    def leaves(self, case):
        return case.x, case.s, self.w1_sonic, self.w2_sonic

    def weight_grads(self, grad13, grad2, experts):
        return deinterleave_gate_up(grad13, experts), grad2.permute(2, 0, 1)[experts]

    def close(self):
        self.w1_sonic = self.w2_sonic = self.ids = self.routing = None


class SonicMoEPeer:
    """SonicMoE with QuACK's default GEMM configs (tuned=False)."""
    name = "sonicmoe"

    def __init__(self, loader=load_sonicmoe):
        try:
            self.api, self.missing = loader(), None
        except PeerMissing as ex:
            self.api, self.missing = None, str(ex)

    @property
    def about(self):
        return self.api.about if self.api else None

    def for_case(self, case):
        return SonicMoE(self.api, case, self.name)


class SonicMoETunedPeer(SonicMoEPeer):
    """SonicMoE as its users run it: QuACK's autotuned GEMMs (tuned=True). The bench's check calls of a shape (the full
    case, forward and, for fwd+bwd, backward) autotune every GEMM before anything is timed."""
    name = "sonicmoe-tuned"

    def __init__(self, loader=load_sonicmoe_tuned):
        super().__init__(loader)


# What a peer's first call of a shape does beyond compiling (bench.py logs it before the check that makes that call).
FIRST_CALL = {"sonicmoe-tuned": "QuACK autotunes each of its GEMMs (the forward's; in fwd+bwd the backward's too)"
                                " unless QUACK_CACHE_DIR holds that shape's tuning"}


class TorchCompiledPeer:
    name, missing = "torch_compiled", None

    def __init__(self, path=None):
        self.path = path or CompiledTorchPath()
        self.impl = Impl(self.name, self.path)

    @property
    def about(self):
        return self.path.about()

    def for_case(self, case):
        return self.impl


# ---------------------------------------------------------------------------------------------------- torchao FP8

TORCHAO_FP8_MM = "torchao.prototype.moe_training.fp8_grouped_mm._to_fp8_rowwise_then_scaled_grouped_mm"
GROUP_ALIGN = 16  # rows: torch._scaled_grouped_mm's FP8 groups


def load_torchao_fp8():
    """SimpleNamespace(mm, about): torchao's rowwise FP8 grouped GEMM as mm(A [M, K], B_t [E, K, N], offs [E] int32)
    -> [M, N] bf16 on groups already padded to GROUP_ALIGN rows; PeerMissing without an sm_90+ GPU or torchao."""
    missing = fp8_device_missing("cuda" if torch.cuda.is_available() else "cpu")
    if missing:
        raise PeerMissing(missing)
    module_name, fn_name = TORCHAO_FP8_MM.rsplit(".", 1)
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except ImportError as ex:
        raise PeerMissing(f"not installed: {short(ex)} (scripts/pack_torchao.sh)") from ex
    except AttributeError as ex:
        raise PeerMissing(f"torchao {_version('torchao')} has no {TORCHAO_FP8_MM}") from ex
    except Exception as ex:  # noqa: BLE001 - any failure to import is a reason, not a crash
        raise PeerMissing(f"import failed: {short(ex)}") from ex
    if "pad_token_groups_for_grouped_mm" not in inspect.signature(fn).parameters:
        raise PeerMissing(f"torchao {_version('torchao')}: {fn_name} has no pad_token_groups_for_grouped_mm"
                          " (another torchao version?)")
    about = (f"torchao {_version('torchao')}: {fn_name} (rowwise e4m3, power-of-two scales, torch._scaled_grouped_mm)"
             f" for both grouped GEMMs of the torch path, each expert's rows padded to {GROUP_ALIGN} in the routing")
    return SimpleNamespace(mm=padded_groups_mm(fn), about=about)


def padded_groups_mm(fn):
    """mm(A, B_t, offs) of torchao's FP8 grouped GEMM `fn` on groups the caller padded (its own padding off)."""
    def mm(a, b_t, offs):
        return fn(a, b_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
    return mm


def padded_routing(ids, E, align=GROUP_ALIGN):
    """The torch path's expert-sorted routing with every expert's rows padded with zero rows to a multiple of `align`
    (at least `align`: no empty group), on the device without a host synchronisation (counts by scatter_add_, not
    bincount; the padded row count M = S + align·E rounded up to `align`, a bound: the rows past the last group are
    in no group):
    (order [S] flat slot of each sorted row, pos [S] its row in the padded layout, src [M] the token each padded row
    reads (T for a padding row), offs [E] int32 end offsets of the padded groups). Slots with id -1 are not handled
    (as in torch_moe_baseline.moe_grouped)."""
    T, k = ids.shape
    S = T * k
    flat = ids.reshape(-1)  # [S]
    order = flat.argsort(stable=True)  # [S]
    expert = flat[order]  # [S] expert of each sorted row
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = ((counts + align - 1) // align * align).clamp_min(align)  # [E]
    ends = padded.cumsum(0)  # [E]
    first = counts.cumsum(0) - counts  # [E] first sorted row of each expert
    pos = (ends - padded)[expert] + torch.arange(S, device=ids.device) - first[expert]  # [S]
    M = (S + align * E + align - 1) // align * align  # S + align·E rows, rounded up to `align`
    src = torch.full((M,), T, dtype=torch.int64, device=ids.device)  # [M]
    src[pos] = order // k
    return order, pos, src, ends.to(torch.int32)


def moe_grouped_padded(x, ids, w, w13, w2, mm, align=GROUP_ALIGN):
    """torch_moe_baseline.moe_grouped with each expert's rows padded to `align` (padded_routing) and its two
    torch._grouped_mm calls replaced by mm(A [M, K], B_t [E, K, N], offs): the padding rows read a zero row appended
    to x (an embedding with padding_idx, so their gradient is dropped rather than summed into one row). The rows past
    the last group (the routing's bound on M) are in no group: the GEMMs leave them out and nothing reads them back."""
    T, H = x.shape
    E = w13.shape[0]
    I = w2.shape[2]
    order, pos, src, offs = padded_routing(ids, E, align)
    xs = F.embedding(src, torch.cat([x, x.new_zeros(1, H)]), padding_idx=T)  # [M, H]
    h = mm(xs, w13.transpose(1, 2), offs)  # [M, 2I]
    g, u = h[:, :I], h[:, I:]
    a = F.silu(g) * u  # [M, I]
    o = mm(a, w2.transpose(1, 2), offs)[pos]  # [S, H] in sorted order
    ws = w.flatten()[order].unsqueeze(1).to(o.dtype)  # [S, 1]
    return torch.zeros_like(x).index_add(0, order // ids.shape[1], o * ws)  # [T, H]


class PaddedFp8Peer:
    """An FP8 peer that is the torch path with both grouped GEMMs replaced by its loader's mm on expert rows padded to
    `align` (moe_grouped_padded), checked against FP8_TOLERANCE; `missing` says why its loader could not load."""
    name, align = None, GROUP_ALIGN

    def __init__(self, loader):
        try:
            self.api, self.missing = loader(), None
        except PeerMissing as ex:
            self.api, self.missing = None, str(ex)
        self.impl = self.api and Impl(self.name, functools.partial(moe_grouped_padded, mm=self.api.mm,
                                                                   align=self.align), tolerance=FP8_TOLERANCE)

    @property
    def about(self):
        return self.api.about if self.api else None

    def for_case(self, case):
        return self.impl


class TorchaoFp8Peer(PaddedFp8Peer):
    name = "torchao-fp8"

    def __init__(self, loader=load_torchao_fp8):
        super().__init__(loader)


FACTORIES = {"sonicmoe": SonicMoEPeer, "sonicmoe-tuned": SonicMoETunedPeer, "torch_compiled": TorchCompiledPeer,
             "torchao-fp8": TorchaoFp8Peer,
             "deepgemm-fp8": lambda: importlib.import_module("peer_deepgemm").DeepGemmFp8Peer()}  # imports peers


def load_peers(names):
    """The peers named (in PEERS order), each loaded or with the reason it is missing."""
    return [FACTORIES[n]() for n in PEERS if n in names]


def describe(peers):
    """{name: {"about": ...} or {"missing": ...}} for the results JSON."""
    return {p.name: {"missing": p.missing} if p.missing else {"about": p.about} for p in peers}
