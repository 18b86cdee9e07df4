"""The adapters on a GPU: each adapter's bf16 result on CUDA (the fused sm_90a kernels where they take the layout, else
the portable ones) against the same adapter in float64 on the CPU (itself checked against each framework's plain
PyTorch layout in test_adapters_*.py), forward and every gradient, on ragged routings, with sizes that suit the
sm_90a kernels (H, I multiples of 8) and sizes that do not. Skipped, with the reason, where no GPU is present."""

import warnings

import pytest
import torch

from adapter_cases import counts_of, grads, randn, routing
from conftest import rel_err
from megamoe.adapters import megatron, prime_rl, torchtitan
from test_adapters_megatron_lists import record_calls
from test_adapters_prime_rl import make_experts, prime_rl_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")

DEVICE = "cuda"
BF16_TOLERANCE = 2e-2  # as the other CUDA tests: a few bf16 roundings of the intermediates
# (name, T, H, I, E, topk, routing)
CASES = [("aligned", 150, 72, 40, 5, 2, "random"), ("ragged_sizes", 37, 30, 22, 4, 2, "half_empty"),
         ("one_expert_takes_all", 64, 64, 48, 3, 1, "one_expert")]
IDS = [c[0] for c in CASES]


def _bf16_cuda(tensors):
    """bf16 CUDA leaves of the same (rounded) values, and the float64 CPU leaves of those rounded values."""
    cuda = {k: v.detach().to(torch.bfloat16).to(DEVICE).requires_grad_(v.requires_grad) for k, v in tensors.items()}
    cpu = {k: v.detach().cpu().double().requires_grad_(v.requires_grad) for k, v in cuda.items()}
    return cuda, cpu


def _check(ours, want, what, plain_bf16=None):
    """ours (bf16 on the GPU) against want (float64 on the CPU): within BF16_TOLERANCE, or, where the framework's plain
    PyTorch computation in bf16 on the same device (plain_bf16) is itself further off, within 3x its error."""
    for name, value in want.items():
        got = ours[name]
        assert got is not None and got.device.type == DEVICE, f"{what}: {name}"
        assert torch.isfinite(got.float()).all(), f"{what}: {name} not finite"
        err = rel_err(got.detach().cpu().double(), value)
        bound = BF16_TOLERANCE
        if plain_bf16 is not None:
            bound = max(bound, 3 * rel_err(plain_bf16[name].detach().cpu().double(), value))
        assert err < bound, f"{what}: {name} error {err:.3e} (bound {bound:.3e})"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torchtitan_routed_experts_on_cuda(case, gen):
    _, T, H, I, E, topk, kind = case
    ids, scores = routing(T, E, topk, kind, gen)
    leaves = {"x": randn(gen, T, H), "topk_scores": scores.requires_grad_(), "w1": randn(gen, E, I, H, scale=0.3),
              "w2": randn(gen, E, H, I, scale=0.3), "w3": randn(gen, E, I, H, scale=0.3)}
    dy = torch.randn(T, H, generator=gen, dtype=torch.float64)
    results = []
    for values, device in zip(_bf16_cuda(leaves), (DEVICE, "cpu")):
        routed = torchtitan.RoutedExperts(H, I, E, dtype=values["w1"].dtype, device=device)
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                getattr(routed.inner_experts, name).copy_(values[name])
        params = {n: getattr(routed.inner_experts, n) for n in ("w1", "w2", "w3")}
        named = {"x": values["x"], "topk_scores": values["topk_scores"], **params}
        ids_d = ids.to(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-time path warning
            results.append(grads(lambda: routed(values["x"], values["topk_scores"], ids_d, counts_of(ids_d, E)),
                                 named, dy.to(values["x"].dtype).to(device)))
    _check(*results, f"torchtitan {case[0]}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("storage", ["w1w2w3", "gate_up_proj", "gate_up_proj_bias", "gpt_oss"])
def test_prime_rl_expert_compute_on_cuda(storage, case, gen):
    _, T, H, I, E, topk, kind = case
    experts64 = make_experts(storage, H, I, E, gen)
    if storage == "gpt_oss":
        # make_experts's gates (scale 3) are clamped almost everywhere, which leaves dx to the few entries whose
        # bf16 rounding lands on the other side of a clamp than float64's: noise, not a check of the wiring. At scale
        # 0.3 the clamps rarely engage; test_layouts_cuda checks them on the GPU against a reference that reads the
        # GPU forward's own pre-activations, and bench_gpt_oss.py against Hugging Face's eager gpt-oss experts.
        with torch.no_grad():
            experts64.gate_up_proj.mul_(0.1)
    ids, _ = routing(T, E, topk, kind, gen)
    counts = counts_of(ids, E)
    R = int(counts.sum()) + 2  # two padding rows
    x = randn(gen, R, H)
    dout = torch.randn(R, H, generator=gen, dtype=torch.float64)
    results = []
    for device, dtype, fn in ((DEVICE, torch.bfloat16, prime_rl.MegamoeExpertCompute()),
                              ("cpu", torch.float64, prime_rl.MegamoeExpertCompute()),
                              (DEVICE, torch.bfloat16, prime_rl_reference)):
        experts = make_experts(storage, H, I, E, gen)
        experts.load_state_dict({k: v.to(torch.bfloat16).to(dtype) for k, v in experts64.state_dict().items()})
        experts.to(device=device, dtype=dtype)  # load_state_dict keeps the parameters' float64
        xd = x.detach().to(torch.bfloat16).to(dtype).to(device).requires_grad_()
        leaves = {"x": xd, **dict(experts.named_parameters())}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results.append(grads(lambda: fn(experts, xd, counts.to(device)), leaves, dout.to(dtype).to(device)))
    # The bound is also 3x the error of prime-rl's plain per-expert loop in bf16 on the same device.
    _check(results[0], results[1], f"prime-rl {storage} {case[0]}", plain_bf16=results[2])
    assert results[0]["out"][-2:].abs().max() == 0


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_megatron_grouped_mlp_on_cuda(case, gen):
    _, T, H, I, E, topk, kind = case
    ids, _ = routing(T, E, topk, kind, gen)
    counts = counts_of(ids, E)
    R = int(counts.sum())
    leaves = {"x": randn(gen, R, H), "probs": (torch.rand(R, generator=gen, dtype=torch.float64) + 0.1),
              "weight1": randn(gen, H, E * 2 * I, scale=0.3), "weight2": randn(gen, E * I, H, scale=0.3)}
    leaves["probs"].requires_grad_()
    dout = torch.randn(R, H, generator=gen, dtype=torch.float64)
    results = []
    for values in _bf16_cuda(leaves):
        device = values["x"].device
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results.append(grads(lambda: megatron.grouped_mlp(values["x"], counts.to(device), values["probs"],
                                                              values["weight1"], values["weight2"], E), values,
                                 dout.to(values["x"].dtype).to(device)))
    _check(*results, f"megatron {case[0]}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_megatron_te_expert_lists_in_place_on_cuda(case, gen, monkeypatch):
    """TE's per-expert weights (weight0 ... weight{E-1}) as views of one block, read in place on the GPU: bitwise the
    result of the same values as single grouped tensors (the same kernels on the same bytes), each expert's gradient
    its slice of the grouped one, and no copy of the weights (megamoe receives weight0's storage)."""
    _, T, H, I, E, topk, kind = case
    ids, _ = routing(T, E, topk, kind, gen)
    counts = counts_of(ids, E).to(DEVICE)
    R = int(counts.sum())
    x = randn(gen, R, H).detach().to(torch.bfloat16).to(DEVICE).requires_grad_()
    probs = (torch.rand(R, generator=gen, dtype=torch.float64) + 0.1).to(DEVICE).requires_grad_()
    dout = torch.randn(R, H, generator=gen, dtype=torch.float64).to(torch.bfloat16).to(DEVICE)
    blocks = [randn(gen, E, 2 * I, H, scale=0.3), randn(gen, E, H, I, scale=0.3)]
    blocks = [b.detach().to(torch.bfloat16).to(DEVICE) for b in blocks]
    grouped = [b.clone().requires_grad_() for b in blocks]
    lists = [[torch.nn.Parameter(b[e]) for e in range(E)] for b in blocks]
    leaves = {"x": x, "probs": probs, **{f"fc{i + 1}_{e}": p for i, ps in enumerate(lists) for e, p in enumerate(ps)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time path warning
        want = grads(lambda: megatron.te_grouped_mlp(x, counts, probs, *grouped), {"x": x, "probs": probs,
                     "fc1": grouped[0], "fc2": grouped[1]}, dout)
        calls = record_calls(monkeypatch)
        warnings.filterwarnings("error", message=".*stacking \\(copying\\)")  # a copied list warns so
        got = grads(lambda: megatron.te_grouped_mlp(x, counts, probs, *lists), leaves, dout)
    assert torch.equal(got["out"], want["out"]) and torch.equal(got["x"], want["x"])
    assert torch.equal(got["probs"], want["probs"])
    for i in range(2):
        for e in range(E):
            assert torch.equal(got[f"fc{i + 1}_{e}"], want[f"fc{i + 1}"][e]), f"fc{i + 1} expert {e}"
    (args, _), = calls
    received = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    for block in blocks:
        assert block.untyped_storage().data_ptr() in received, "a per-expert list was copied"
