"""The peer deepgemm-fp8: DeepGEMM's blockwise FP8 grouped GEMMs (DeepSeek-V3's recipe: e4m3, activations scaled per
token per 128 channels, weights per 128 x 128 block, fp32 scales) in the torch `_grouped_mm` path of
torch_moe_baseline.py, called through torchao's blockwise FP8 grouped GEMM op.

What runs: torchao 0.18's differentiable `_to_fp8_blockwise_then_scaled_grouped_mm` for both grouped GEMMs of the torch
path, on its DeepGEMM backend (the one it picks on an sm_90 GPU when `import deep_gemm` works and exposes both grouped
kernels; the loader makes sure of that instead of letting it fall back to its emulated GEMM):
  - forward and the backward's dX / dH: DeepGEMM's M-grouped contiguous GEMM (`m_grouped_fp8_gemm_nt_contiguous`,
    its sm_90 1D2D kernel), A quantized 1 x 128 and B 128 x 128 by torchao's Triton kernels, bf16 out;
  - weight gradients: DeepGEMM's K-grouped contiguous GEMM (`k_grouped_fp8_gemm_nt_contiguous`, sm_90 1D1D kernel, both
    operands 1 x 128 along the tokens, fp32 out cast to bf16).
DeepGEMM's grouped layouts need every expert's rows to start at a multiple of 128 (its M alignment on sm_90 and the
quantization block along the tokens of the weight gradients), so the routing permutation pads each expert's rows to a
multiple of 128 with zero rows on the device (peers.padded_routing with align=128), timed with it; torchao's own
padding (pad_token_groups_for_grouped_mm=True) is left off: without its sm_100-only CUDA kernels it copies group by
group from the host. DeepGEMM compiles its kernels at run time (NVCC, or NVRTC with DG_JIT_USE_NVRTC=1) from the
CUTLASS / CuTe headers in its wheel: a shape's first call takes seconds, then they are cached (DG_JIT_CACHE_DIR).
The K-grouped API takes the group sizes as a host list, so every layer call reads them back (one host sync).

The DeepGEMM build that loads with torch 2.11 + CUDA 13 is sgl-deep-gemm 0.1.5.post1 (docs/log/
2026-12-06-deepgemm-peer.md says why that one); scripts/pack_deepgemm.sh carries it, its apache-tvm-ffi and torchao.
"""
import importlib
import os
from types import SimpleNamespace

import torch

from impls import fp8_device_missing
from peers import PaddedFp8Peer, PeerMissing, _version, moe_grouped_padded
from timing import short

NAME = "deepgemm-fp8"
BLOCK = 128  # DeepGEMM's quantization block and, on sm_90, its M alignment of the grouped layouts
# The DeepGEMM API the peer needs, each as its accepted names (newer DeepGEMM names the M-grouped one fp8_fp4).
DEEPGEMM_API = (("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_contiguous"),
                ("k_grouped_fp8_gemm_nt_contiguous",))
DEEPGEMM_DISTRIBUTIONS = ("sgl-deep-gemm", "deep-gemm", "deepinfer-gemm", "deep_gemm")
BLOCKWISE_MODULE = "torchao.prototype.moe_training.blockwise_fp8.grouped_mm"
BLOCKWISE_MM = "_to_fp8_blockwise_then_scaled_grouped_mm"
BACKEND_MODULE = "torchao.prototype.moe_training.blockwise_fp8.grouped_mm_backend"
BACKEND_SELECT = "_select_fp8_blockwise_grouped_mm_backend"
PACK_HINT = "scripts/pack_deepgemm.sh"


def _import(import_module, name, what):
    try:
        return import_module(name)
    except ImportError as ex:
        raise PeerMissing(f"{what} not installed: {short(ex)} ({PACK_HINT})") from ex
    except Exception as ex:  # noqa: BLE001 - a compiled extension that cannot load is a reason, not a crash
        raise PeerMissing(f"{what} import failed: {short(ex)}") from ex


def deepgemm_distribution(module):
    """'name version' of the installed distribution that provides the deep_gemm module."""
    for dist in DEEPGEMM_DISTRIBUTIONS:
        version = _version(dist)
        if version != "unknown":
            return f"{dist} {version}"
    return f"deep_gemm {getattr(module, '__version__', 'unknown')}"


def missing_deepgemm_api(module):
    """The DEEPGEMM_API entries `module` has under none of their names ('a or b' each)."""
    return [" or ".join(names) for names in DEEPGEMM_API if not any(hasattr(module, n) for n in names)]


def _backend_kind(import_module):
    """The backend torchao's blockwise grouped GEMM picks on this GPU for 128-row groups ('deepgemm' or 'emulated')."""
    select = getattr(import_module(BACKEND_MODULE), BACKEND_SELECT)
    preference = import_module("torchao.quantization.quantize_.common").KernelPreference.AUTO
    a = torch.zeros(BLOCK, BLOCK, device="cuda", dtype=torch.bfloat16)  # [128, 128]
    offs = torch.tensor([BLOCK], device="cuda", dtype=torch.int32)  # [1]
    kind = select(preference, a, torch.bfloat16, BLOCK, offs, num_rows=BLOCK).kind
    return getattr(kind, "value", str(kind))


def load_deepgemm_fp8(import_module=importlib.import_module, device=None):
    """SimpleNamespace(mm, about): mm(A [M, K], B_t [E, K, N], offs [E] int32) -> [M, N] bf16, torchao's blockwise FP8
    grouped GEMM on its DeepGEMM backend, for groups the caller padded to BLOCK rows. PeerMissing (with the reason) when
    deep_gemm does not import or lacks the grouped kernels, without a compute capability 9.0 GPU (`device`: 'cuda' or
    'cpu', default where torch sees a GPU), or when torchao's blockwise op or its DeepGEMM backend is not there."""
    dg = _import(import_module, "deep_gemm", "deep_gemm")
    dist = deepgemm_distribution(dg)
    gaps = missing_deepgemm_api(dg)
    if gaps:
        raise PeerMissing(f"{dist} has no {', '.join(gaps)} (another DeepGEMM version?)")
    missing = fp8_device_missing(device or ("cuda" if torch.cuda.is_available() else "cpu"), exact=True)
    if missing:
        raise PeerMissing(f"DeepGEMM's sm_90 kernels: {missing}")
    try:
        alignment = int(dg.get_mk_alignment_for_contiguous_layout())
    except Exception as ex:  # noqa: BLE001
        raise PeerMissing(f"{dist}: get_mk_alignment_for_contiguous_layout failed: {short(ex)}") from ex
    if BLOCK % alignment:
        raise PeerMissing(f"{dist} wants expert rows aligned to {alignment}, not a divisor of {BLOCK}")
    fn = getattr(_import(import_module, BLOCKWISE_MODULE, f"torchao's {BLOCKWISE_MM}"), BLOCKWISE_MM, None)
    if fn is None:
        raise PeerMissing(f"torchao {_version('torchao')} has no {BLOCKWISE_MODULE}.{BLOCKWISE_MM}")
    try:
        kind = _backend_kind(import_module)
    except Exception as ex:  # noqa: BLE001
        raise PeerMissing(f"torchao {_version('torchao')}: no DeepGEMM backend to select ({short(ex)})") from ex
    if kind != "deepgemm":
        raise PeerMissing(f"torchao {_version('torchao')} picks its {kind} backend, not DeepGEMM ({dist})")
    jit = "NVRTC" if os.environ.get("DG_JIT_USE_NVRTC", "0") not in ("", "0") else "NVCC"
    about = (f"{dist} (JIT by {jit}) through torchao {_version('torchao')}'s {BLOCKWISE_MM} (DeepGEMM backend): e4m3,"
             f" activations 1x{BLOCK}, weights {BLOCK}x{BLOCK} (fp32 scales, torchao's Triton quantizers);"
             f" {DEEPGEMM_API[0][0]} for forward and dX / dH, {DEEPGEMM_API[1][0]} (fp32) for the weight gradients;"
             f" each expert's rows padded to {BLOCK} in the routing")
    return SimpleNamespace(mm=blockwise_mm(fn), about=about)


def blockwise_mm(fn):
    """mm(A, B_t, offs) of torchao's blockwise FP8 grouped GEMM `fn` on groups the caller padded (its padding off)."""
    def mm(a, b_t, offs):
        return fn(a, b_t, offs, out_dtype=torch.bfloat16, block_size=BLOCK, pad_token_groups_for_grouped_mm=False)
    return mm


def shape_missing(H, I):
    """Why the blockwise path cannot take hidden size H and expert intermediate size I (torchao's DeepGEMM path wants
    both GEMMs' K and N multiples of 128), or None."""
    bad = [f"{n}={v}" for n, v in (("H", H), ("I", I)) if v % BLOCK]
    return f"{', '.join(bad)}: blockwise FP8 wants H and I multiples of {BLOCK}" if bad else None


def moe_deepgemm(x, ids, w, w13, w2, mm, align=BLOCK):
    """peers.moe_grouped_padded with each expert's rows padded to DeepGEMM's `align` (BLOCK) and mm the blockwise
    grouped GEMM."""
    return moe_grouped_padded(x, ids, w, w13, w2, mm, align)


class DeepGemmFp8Peer(PaddedFp8Peer):
    name, align = NAME, BLOCK

    def __init__(self, loader=load_deepgemm_fp8):
        super().__init__(loader)

    def for_case(self, case):
        why = shape_missing(case.w2.shape[1], case.w2.shape[2])
        if why:
            raise ValueError(why)
        return self.impl
