"""The implementations the benchmark runs side by side on one case's inputs, each as an Impl: megamoe in both memory
modes, the torch `_grouped_mm` path eager and under torch.compile; SonicMoE is in peers.py.

An Impl is y = fn(x, topk_ids, topk_weights, w13, w2) with autograd to four leaves (x, topk_weights and the two
weights, which a peer may keep in its own layout), and maps its weight gradients back to megamoe's layout for the
correctness check.
"""
import torch

from reference import expert_rows
from timing import short
from torch_moe_baseline import moe_grouped


class Impl:
    """One implementation: fn on the case's tensors; `passes` it runs in."""

    def __init__(self, name, fn, passes=("fwd", "fwdbwd")):
        self.name, self.fn, self.passes = name, fn, passes

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

