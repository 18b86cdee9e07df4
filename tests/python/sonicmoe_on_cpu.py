"""SonicMoE's own Python glue on the CPU through bench/peers.py's wrapper, against the fp64 reference (run by
test_bench.py where sonicmoe imports, with TRITON_INTERPRET=1): its routing-metadata and gather-sum Triton kernels
run in the Triton interpreter, its autograd functions as they are; only the QuACK CuTe-DSL GEMMs (GPU-only) are
replaced, by QuACK's reference GEMMs (gemm_ref, gemm_act_ref; the dgated one written out with the colvec scale /
reduce of its epilogue, quack/gemm_dact.py). Checks the layouts, the gradient mapping and dropped slots; exit 1: failed.
"""
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import peers  # noqa: E402
import workloads  # noqa: E402
from reference import FWD_KEYS, FWDBWD_KEYS, compare, path_outputs, reference_outputs  # noqa: E402

import quack.gemm_interface as qgi  # noqa: E402  (after TRITON_INTERPRET=1 is set by the caller)

DIMS = (48, 256, 32, 8, 2)  # T, H, I, E, topk (H >= 256: the gather-sum kernel's smallest tile)


def gemm(A, B, out=None, bias=None, alpha=1.0, out_dtype=None, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None,
         concat_layout=None, tuned=True, **_):
    assert tuned is False and concat_layout is None
    r = qgi.gemm_ref(A, B, bias=bias, alpha=alpha, cu_seqlens_m=cu_seqlens_m, cu_seqlens_k=cu_seqlens_k, A_idx=A_idx,
                     out_dtype=out_dtype)
    return r if out is None else out.copy_(r)


def gemm_gated(A, B, C=None, bias=None, activation=None, preact_out=None, postact_out=None, out_dtype=None,
               postact_dtype=None, cu_seqlens_m=None, A_idx=None, store_preact=True, tuned=True, **_):
    assert tuned is False
    pre, post = qgi.gemm_act_ref(A, B, C, bias, activation, cu_seqlens_m, A_idx, out_dtype, postact_dtype,
                                 store_preact)
    if preact_out is not None:
        preact_out.copy_(pre)
    return preact_out, postact_out.copy_(post)


def gemm_dgated(A, B, PreAct, activation=None, dx_out=None, postact_out=None, colvec_scale=None, colvec_reduce=False,
                cu_seqlens_m=None, A_idx=None, tuned=True, **_):
    """As gemm_dact_ref for SwiGLU (whose autograd cannot run inside a custom op), with the epilogue's colvec: D
    scaled before the SwiGLU backward, postact scaled, row sums of postact * the unscaled D."""
    assert tuned is False and activation == "swiglu" and colvec_scale is not None and colvec_reduce
    d = qgi.gemm_ref(A.float(), B.float(), cu_seqlens_m=cu_seqlens_m, A_idx=A_idx)  # [m, I] f32
    g, u = PreAct[..., ::2].float(), PreAct[..., 1::2].float()  # gate / up columns interleaved
    sig = torch.sigmoid(g)
    post = g * sig * u  # [m, I]
    scaled = d * colvec_scale[:, None].float()
    dg, du = scaled * u * sig * (1 + g * (1 - sig)), scaled * g * sig
    dx_out.copy_(torch.stack([dg, du], -1).reshape(PreAct.shape))
    postact_out.copy_(post * colvec_scale[:, None])
    return dx_out, postact_out, (post * d).sum(-1)


class Searchsorted:
    """_token_offset_searchsorted_kernel as torch.searchsorted (the interpreter rejects its `mask & (TK > 0)`)."""

    def __getitem__(self, grid):
        def run(sorted_T, offset, T, TK, BLOCK_SIZE, N_ITERS):
            t = torch.arange(T + 1, dtype=sorted_T.dtype)
            offset.copy_(torch.searchsorted(sorted_T, t, right=False).to(offset.dtype))
        return run


def install_stand_ins():
    """load_sonicmoe (its binding: tuned=False partials of QuACK's GEMMs), then our GEMMs in their place in that
    binding, which the wrapper binds into sonicmoe's modules before each call."""
    api = peers.load_sonicmoe()
    import sonicmoe.functional.backward as backward
    import sonicmoe.functional.forward as forward
    import sonicmoe.functional.triton_kernels as triton_kernels
    import triton.runtime.autotuner as autotuner
    for name, stand_in in (("gemm", gemm), ("gemm_gated", gemm_gated), ("gemm_dgated", gemm_dgated)):
        bound = api.bind.functions[name]
        assert isinstance(bound, functools.partial) and bound.keywords == {"tuned": False}, bound
        api.bind.functions[name] = functools.partial(stand_in, **bound.keywords)
    api.bind()
    assert forward.gemm_gated.func is gemm_gated and backward.gemm_dgated.func is gemm_dgated
    triton_kernels._token_offset_searchsorted_kernel = Searchsorted()
    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]  # no benchmarking here
    api.stream = lambda: 0
    return api


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    api = install_stand_ins()
    ok = True
    for dropped in (False, True):
        case = workloads.make_case("sonic-cpu", DIMS, "balanced", "cpu", seed=3)
        if dropped:
            case.ids[::5, 1] = -1
        sonic = peers.SonicMoE(api, case)
        tokens, experts = torch.arange(DIMS[0]), list(range(DIMS[3]))
        ref = reference_outputs(case, tokens, experts, torch.float64)
        floor = reference_outputs(case, tokens, experts, torch.bfloat16)
        for backward, keys in ((False, FWD_KEYS), (True, FWDBWD_KEYS)):
            errs = compare(path_outputs(sonic, case, tokens, experts, backward), floor, {k: ref[k] for k in keys},
                           label="sonicmoe")
            print(f"dropped={dropped} backward={backward}: "
                  + ", ".join(f"{k} {v['sonicmoe']:.1e}{'' if v['pass'] else ' FAIL'}" for k, v in errs.items()))
            ok &= all(v["pass"] for v in errs.values())
        grads = sonic.step(case, "fwdbwd")()
        if dropped and not bool((grads[1][::5, 1] == 0).all()):
            print("FAIL: a dropped slot has a non-zero d topk_weights")
            ok = False
    print("SonicMoE glue on the CPU: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
