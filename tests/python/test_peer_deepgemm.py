"""The peer deepgemm-fp8 (bench/peer_deepgemm.py) on the CPU: its MoE path with torchao's blockwise FP8 grouped GEMM
replaced by an emulation (megamoe.fp8_reference's 1 x 128 / 128 x 128 quantization, dequantized, straight-through
gradients) that checks the contract the DeepGEMM backend holds its callers to (row-major A, per-expert column-major
B_t, K and N multiples of 128, int32 group ends at multiples of 128) and fills the rows in no group with NaN (DeepGEMM
leaves them unwritten), against the float64 layer; the same path with a wrong grouping or a 16-row alignment caught;
the loader's reasons when deep_gemm is missing, cannot load, lacks a grouped kernel or has no sm_90 GPU; the shape
check; the registration in peers.py. What needs the GPU (DeepGEMM's kernels, torchao's Triton quantizers, the backend
selection) is checked by bench/bench.py against the fp32 reference before it is timed."""

import functools
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import grads_of, make_problem, rel_err, torch_moe
from megamoe import fp8_reference as fp8

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import peer_deepgemm as dg  # noqa: E402
import peers  # noqa: E402
from impls import FP8_TOLERANCE  # noqa: E402

BLOCK = dg.BLOCK


def straight_through(x, value):
    """value in the forward, x's gradient in the backward."""
    return x + (value.to(x.dtype) - x).detach()


def emulated_mm(a, b_t, offs, group_of=None):
    """torchao's blockwise FP8 grouped GEMM on its DeepGEMM backend, emulated: out[rows of group e] = A_q @ B_q[e]^T,
    A quantized per row per 128 channels, B (B_t [E, K, N] as [E, N, K]) per 128 x 128 block; the rows past the last
    group NaN. group_of(e): the expert group e multiplies with (a wrong grouping for the failing test)."""
    M, K = a.shape
    E, K_b, N = b_t.shape
    assert K == K_b and K % BLOCK == 0 and N % BLOCK == 0, (a.shape, b_t.shape)
    assert a.is_contiguous(), "A must be row-major"
    assert b_t.stride(-2) == 1, "B_t must be per-expert column-major (a transposed view of [E, N, K])"
    assert offs.dtype == torch.int32 and offs.shape == (E,)
    ends = offs.tolist()
    assert all(e % BLOCK == 0 for e in ends), f"group ends {ends} not at multiples of {BLOCK}"
    assert all(b >= a for a, b in zip([0] + ends, ends)) and ends[-1] <= M, (ends, M)
    qa, sa = fp8.quantize_groups(a)  # [M, K] e4m3, [M, K / 128]
    a_q = straight_through(a, qa.float() * sa.repeat_interleave(BLOCK, -1))
    b = b_t.transpose(-2, -1)  # [E, N, K]
    qb, sb = fp8.quantize_blocks(b)  # [E, N, K], [E, N / 128, K / 128]
    b_q = straight_through(b, qb.float() * sb.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1))
    chunks, start = [], 0
    for e, end in enumerate(ends):
        chunks.append(a_q[start:end] @ b_q[group_of(e) if group_of else e].transpose(0, 1))  # [rows, N]
        start = end
    chunks.append(a.new_full((M - start, N), float("nan")))  # rows in no group
    return torch.cat(chunks)  # [M, N]


def problem(gen, routing, T=150, H=2 * BLOCK, I=BLOCK, E=4, topk=2):
    return make_problem(T, H, I, E, topk, routing, dtype=torch.float64, gen=gen)


@pytest.mark.parametrize("routing", ["random", "half_empty", "one_expert"])
def test_layer_matches_float64_reference(gen, routing):
    """y and the four gradients within the FP8 bound (and not exact: the operands were quantized); no NaN from the
    rows in no group. one_expert: a group of more than 128 rows; half_empty: experts without a row (128 zero rows)."""
    x, ids, s, w13, w2, dy = problem(gen, routing)
    ref = grads_of(torch_moe, x, ids, s, w13, w2, dy)
    got = grads_of(functools.partial(dg.moe_deepgemm, mm=emulated_mm), x, ids, s, w13, w2, dy)
    for name, g, r in zip(("y", "dx", "ds", "dw13", "dw2"), got, ref):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, r) < FP8_TOLERANCE, (name, rel_err(g, r))
    assert rel_err(got[0], ref[0]) > 1e-4  # FP8, not a float GEMM


def test_wrong_grouping_fails(gen):
    """Every group multiplied with the next expert's weights: far outside the bound (the test above can fail)."""
    x, ids, s, w13, w2, dy = problem(gen, "random")
    wrong = functools.partial(emulated_mm, group_of=lambda e: (e + 1) % w13.shape[0])
    with torch.no_grad():
        y = dg.moe_deepgemm(x, ids, s, w13, w2, mm=wrong)
        assert rel_err(y, torch_moe(x, ids, s, w13, w2)) > 3 * FP8_TOLERANCE


def test_16_row_alignment_breaks_the_contract(gen):
    """The 128-row padding is what DeepGEMM's layouts need: torchao-fp8's 16 rows would not do."""
    x, ids, s, w13, w2, _ = problem(gen, "random")
    with torch.no_grad(), pytest.raises(AssertionError, match="multiples of 128"):
        dg.moe_deepgemm(x, ids, s, w13, w2, mm=emulated_mm, align=16)


def test_group_sizes_hold_each_experts_rows(gen):
    """Each group holds its expert's rows (at least 128), ends at multiples of 128, rows past the end: only in the
    routing's bound; the padding rows of x are zero."""
    x, ids, s, w13, w2, _ = problem(gen, "one_expert", E=5, topk=3)
    seen = []

    def recording(a, b_t, offs):
        seen.append((a.detach().clone(), offs.clone()))
        return emulated_mm(a, b_t, offs)

    with torch.no_grad():
        dg.moe_deepgemm(x, ids, s, w13, w2, mm=recording)
    (xs, offs), _ = seen
    sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    counts = torch.bincount(ids.flatten(), minlength=5)
    assert (offs % BLOCK == 0).all()
    assert torch.equal(sizes, ((counts + BLOCK - 1) // BLOCK * BLOCK).clamp(min=BLOCK))  # rounded up, none empty
    assert xs.shape[0] % BLOCK == 0 and xs.shape[0] >= offs[-1]
    assert int((xs.abs().sum(1) > 0).sum()) == ids.numel()  # one non-zero row per slot, the rest padding


def fake_deep_gemm(*names):
    module = SimpleNamespace(__version__="0.0-test", get_mk_alignment_for_contiguous_layout=lambda: BLOCK)
    for name in names:
        setattr(module, name, lambda *a, **k: None)
    return module


def importer(modules):
    """import_module over `modules` (name -> module, or an exception to raise)."""
    def import_module(name):
        found = modules.get(name, ModuleNotFoundError(f"No module named '{name}'"))
        if isinstance(found, Exception):
            raise found
        return found
    return import_module


def test_loader_without_deep_gemm():
    with pytest.raises(peers.PeerMissing, match=r"^deep_gemm not installed: ModuleNotFoundError: .*deep_gemm.*"
                       r"scripts/pack_deepgemm\.sh"):
        dg.load_deepgemm_fp8(importer({}), device="cuda")


def test_loader_when_deep_gemm_cannot_load():
    """A build against another torch: the undefined symbol is the reason (sgl-deep-gemm 0.2.5 on torch 2.11)."""
    error = OSError("_C.so: undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureC1Ev")
    with pytest.raises(peers.PeerMissing, match="deep_gemm import failed: OSError: .*undefined symbol"):
        dg.load_deepgemm_fp8(importer({"deep_gemm": error}), device="cuda")


def test_loader_without_k_grouped_kernel():
    module = fake_deep_gemm("m_grouped_fp8_fp4_gemm_nt_contiguous")
    with pytest.raises(peers.PeerMissing, match="has no k_grouped_fp8_gemm_nt_contiguous"):
        dg.load_deepgemm_fp8(importer({"deep_gemm": module}), device="cuda")
    assert dg.missing_deepgemm_api(fake_deep_gemm("k_grouped_fp8_gemm_nt_contiguous")) == [
        "m_grouped_fp8_gemm_nt_contiguous or m_grouped_fp8_fp4_gemm_nt_contiguous"]


def test_loader_without_sm90_gpu():
    module = fake_deep_gemm("m_grouped_fp8_gemm_nt_contiguous", "k_grouped_fp8_gemm_nt_contiguous")
    with pytest.raises(peers.PeerMissing, match="sm_90 kernels: needs a compute capability 9.0 CUDA GPU"):
        dg.load_deepgemm_fp8(importer({"deep_gemm": module}), device="cpu")


def test_distribution_name(monkeypatch):
    monkeypatch.setattr(dg, "_version", lambda d: "0.1.5.post1" if d == "sgl-deep-gemm" else "unknown")
    assert dg.deepgemm_distribution(fake_deep_gemm()) == "sgl-deep-gemm 0.1.5.post1"
    monkeypatch.setattr(dg, "_version", lambda d: "unknown")
    assert dg.deepgemm_distribution(fake_deep_gemm()) == "deep_gemm 0.0-test"


def test_registered_and_reports_why_it_is_missing():
    """peers.py knows the peer; here (no deep_gemm, or no sm_90 GPU) it says why and is not built."""
    (peer,) = peers.load_peers(["deepgemm-fp8"])
    assert peer.name == "deepgemm-fp8" and "deepgemm-fp8" in peers.PEERS
    assert (peer.missing is None) != (peer.about is None)
    if not torch.cuda.is_available():
        assert peer.missing and not peer.impl
        assert peers.describe([peer]) == {"deepgemm-fp8": {"missing": peer.missing}}


def test_for_case_checks_the_shape():
    peer = dg.DeepGemmFp8Peer(loader=lambda: SimpleNamespace(mm=emulated_mm, about="emulated"))
    assert peer.missing is None and peer.about == "emulated"
    impl = peer.for_case(SimpleNamespace(w2=torch.empty(2, 2 * BLOCK, BLOCK)))
    assert impl.name == "deepgemm-fp8" and impl.tolerance == FP8_TOLERANCE
    with pytest.raises(ValueError, match=r"^H=2880, I=2880: blockwise FP8 wants H and I multiples of 128$"):
        peer.for_case(SimpleNamespace(w2=torch.empty(2, 2880, 2880)))  # gpt-oss: H = I = 2880
    with pytest.raises(ValueError, match=r"^I=192: "):
        peer.for_case(SimpleNamespace(w2=torch.empty(2, BLOCK, 192)))


def test_pack_script_parses():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "pack_deepgemm.sh")], check=True)
