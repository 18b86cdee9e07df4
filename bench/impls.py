"""The implementations the benchmark runs side by side on one case's inputs, each as an Impl: megamoe in both memory
modes and its FP8 variants, the torch `_grouped_mm` path eager and under torch.compile; SonicMoE and torchao's FP8 path
are in peers.py.

An Impl is y = fn(x, topk_ids, topk_weights, w13, w2) with autograd to four leaves (x, topk_weights and the two
weights, which a peer may keep in its own layout), and maps its weight gradients back to megamoe's layout for the
correctness check.
"""
import importlib
import inspect

import torch

from reference import expert_rows
from timing import short
from torch_moe_baseline import moe_grouped


FP8 = ("megamoe-fp8", "megamoe-fp8+wq")  # megamoe's FP8 variants (bench.py: a failed check fails the case)
# The correctness bound of the FP8 implementations (megamoe's and torchao's): relative error against the fp32
# reference, instead of 5x the bf16 torch path's. Quantizing both operands of every GEMM to e4m3 (3 mantissa bits)
# leaves 3-8 % in each output (megamoe's FP8 reference: 5-8 % from the unquantized layer, tests/python/
# test_fp8_reference.py bounds it by 12 %; torchao's rowwise recipe emulated on the CPU: 6-7 % on the tiny shape);
# a wrong row, scale or group gives tens of percent or more.
FP8_TOLERANCE = 0.15


class Impl:
    """One implementation: fn on the case's tensors; `passes` it runs in; `tolerance`: its correctness bound (relative
    error against the fp32 reference), None for the bf16 rule (reference.passes)."""

    def __init__(self, name, fn, passes=("fwd", "fwdbwd"), tolerance=None):
        self.name, self.fn, self.passes, self.tolerance = name, fn, passes, tolerance

    def __call__(self, case):
        return self.fn(case.x, case.ids, case.s, case.w13, case.w2)  # [T, H]

    def leaves(self, case):
        """(x, topk_weights, w13-like, w2-like): the tensors a backward fills."""
        return case.leaves()

    def weight_grads(self, grad13, grad2, experts):
        """(dw13 [n, 2I, H], dw2 [n, H, I]) of the experts, from the gradients of the two weight leaves."""
        return expert_rows(grad13, grad2, experts)

    def step(self, case, pass_name):
        """A no-argument closure running one pass and returning its outputs: y under no_grad (fwd), or the four
        gradients by torch.autograd.grad (fwd+bwd: nothing accumulates into .grad, so a CUDA graph can replay it)."""
        if pass_name == "fwd":
            def run():
                with torch.no_grad():
                    return self(case)
            return run
        leaves = self.leaves(case)

        def run():
            return torch.autograd.grad(self(case), leaves, case.dy)
        return run

    def close(self):
        """Frees what the Impl holds for its case."""


def megamoe_impls(megamoe):
    """megamoe in its default memory mode (keeps h) and in recompute mode (fwd+bwd only: same forward)."""
    return [Impl("megamoe", megamoe.moe),
            Impl("megamoe_recompute", lambda *a: megamoe.moe(*a, recompute=True), passes=("fwdbwd",))]


def fp8_device_missing(device, exact=False):
    """Why FP8 grouped GEMMs cannot run on `device` ('cuda' or 'cpu'), or None on a CUDA GPU of sm_90 or newer (exact:
    of compute capability 9.0, which megamoe's sm_90a FP8 kernels need)."""
    want = "a compute capability 9.0" if exact else "an sm_90+"
    if device != "cuda":
        return f"needs {want} CUDA GPU " + (f"(this run is on the {device})" if torch.cuda.is_available() else
                                            "(none here)")
    major, minor = torch.cuda.get_device_capability()
    ok = (major, minor) == (9, 0) if exact else major >= 9
    return None if ok else f"needs {want} GPU (this one is sm_{major}{minor})"


def _takes(fn, keyword):
    """Whether fn accepts `keyword` (True where its signature cannot be read: the call will tell)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return keyword in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class MegamoeFp8(Impl):
    """megamoe.moe(..., precision="fp8") on one case. cached=True: the weights' FP8 copies from megamoe.fp8's cache
    (experts_for: quantized on the first call, reused while the weights are unchanged, as between two optimizer steps;
    what megamoe.moe does without fp8_experts), except while a CUDA graph is captured, where megamoe bypasses its cache
    and would quantize in the graph: the capture reads the copies of the last eager call instead, as megamoe.fp8 says
    a captured region should. cached=False: megamoe.fp8.quantize_experts(w13, w2) in every call (what an optimizer
    step adds)."""

    def __init__(self, megamoe, name, cached):
        super().__init__(name, self._moe, tolerance=FP8_TOLERANCE)
        self.megamoe, self.cached, self.experts = megamoe, cached, None

    def _moe(self, x, ids, s, w13, w2):
        fp8 = self.megamoe.fp8
        if not self.cached:
            experts = fp8.quantize_experts(w13, w2)
        elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() and self.experts is not None:
            experts = self.experts
        else:
            experts = self.experts = fp8.experts_for(w13, w2)
        return self.megamoe.moe(x, ids, s, w13, w2, precision="fp8", fp8_experts=experts)  # [T, H]

    def close(self):
        self.experts = None


class Fp8Variant:
    """One of megamoe's FP8 variants as bench.py runs it: name, about (what runs) or missing (why not), and
    for_case(case), its Impl for a case (closed after the case: the FP8 weights it holds go with it)."""

    def __init__(self, megamoe, name, cached, about, missing=None):
        self.megamoe, self.name, self.cached, self.about, self.missing = megamoe, name, cached, about, missing

    def for_case(self, case):
        return MegamoeFp8(self.megamoe, self.name, self.cached)


def megamoe_fp8_variants(megamoe, device):
    """megamoe's FP8 variants (MegamoeFp8), each with the reason it cannot run here, if any: megamoe-fp8, the weights
    quantized once (a loop without optimizer steps: weight quantization not timed), and megamoe-fp8+wq, quantized in
    every call."""
    missing = fp8_device_missing(device, exact=True)
    if missing is None and not (_takes(megamoe.moe, "precision") and _takes(megamoe.moe, "fp8_experts")):
        missing = "megamoe.moe takes no precision= / fp8_experts= keyword (this megamoe predates its FP8 path)"
    if missing is None:
        try:
            fp8 = importlib.import_module("megamoe.fp8")
            lacks = [n for n in ("experts_for", "quantize_experts") if not callable(getattr(fp8, n, None))]
            missing = f"megamoe.fp8 has no {', '.join(lacks)}" if lacks else None
        except Exception as ex:  # noqa: BLE001 - any failure to import is a reason, not a crash
            missing = f"import megamoe.fp8 failed: {short(ex)}"
    return [Fp8Variant(megamoe, "megamoe-fp8", True, "megamoe.moe(..., precision='fp8') on the FP8 weights of"
                       " megamoe.fp8's cache, quantized on the first call (no optimizer step between calls: weight"
                       " quantization not timed; a CUDA graph replays on the cached copies)", missing),
            Fp8Variant(megamoe, "megamoe-fp8+wq", False, "megamoe.moe(..., precision='fp8', fp8_experts="
                       "megamoe.fp8.quantize_experts(w13, w2)): the weights quantized in every call (their FP8 copies count in its"
                       " extra peak memory)", missing)]


def torch_eager():
    return Impl("torch", moe_grouped)


def raise_recompile_limit(at_least=64):
    """Room for every (shape, grad mode) of a run in dynamo's per-function cache (past the limit it runs eager)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, max(getattr(config, name), at_least))


class CompiledTorchPath:
    """moe_grouped under torch.compile (default mode, dynamic=False), one compiled function per process; fullgraph=True
    unless a call fails with it, then fullgraph=False from there on (the reason is kept in `about`)."""

    def __init__(self, compile_fn=torch.compile):
        raise_recompile_limit()
        self.compile_fn = compile_fn
        self.fullgraph, self.fallback = True, None
        self.fn = compile_fn(moe_grouped, fullgraph=True, dynamic=False)

    def __call__(self, *args):
        if self.fullgraph:
            try:
                return self.fn(*args)
            except Exception as ex:  # noqa: BLE001 - a graph break or an unsupported op; retried without fullgraph
                self.fullgraph, self.fallback = False, short(ex)
                self.fn = self.compile_fn(moe_grouped, fullgraph=False, dynamic=False)
        return self.fn(*args)

    def about(self):
        fallback = f" (fullgraph=True failed: {self.fallback})" if self.fallback else ""
        return (f"torch.compile(moe_grouped, fullgraph={self.fullgraph}, dynamic=False), default mode, torch"
                f" {torch.__version__}{fallback}")

