"""The profile scripts' kernel labels and tables (CPU). scripts/profile_forward.py: which grouped GEMM a kernel name is,
so the printed TFLOP/s uses that GEMM's FLOPs (the up GEMM's policy was renamed GatedEpilogue and read as 'down').
scripts/profile_peer_kernels.py: the GEMM labels of each implementation and the summary table's medians."""
import importlib.util
import os
import sys

import pytest
import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
_SCRIPT = os.path.join(_ROOT, "scripts", "profile_forward.py")
sys.path.insert(0, os.path.join(_ROOT, "bench"))  # the script's workloads and timing


@pytest.fixture(scope="module")
def profile_forward():
    spec = importlib.util.spec_from_file_location("profile_forward", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SM90 = "void megamoe::sm90::(anonymous namespace)::m_grouped_gemm_sm90_kernel<__nv_bfloat16, megamoe::sm90::m_grouped::"


@pytest.mark.parametrize("name, kind", [
    (SM90 + "GatedEpilogue<megamoe::sm90::m_grouped::GatedOptions<(bool)0>>, (megamoe::cuda::BLayout)0>", "up"),
    (SM90 + "SwiGLUEpilogue, (megamoe::cuda::BLayout)0>", "up"),
    (SM90 + "StoreEpilogueOf<(bool)0>, (megamoe::cuda::BLayout)0>", "down"),
    ("void megamoe::cuda::m_grouped_gemm_kernel<__nv_bfloat16, (megamoe::cuda::Epilogue)2>", "up"),
    ("void megamoe::cuda::m_grouped_gemm_kernel<__nv_bfloat16, (megamoe::cuda::Epilogue)0>", "down"),
    ("void megamoe::cuda::scatter_kernel", None),
])
def test_gemm_kind_names_the_forward_gemm(profile_forward, name, kind):
    assert profile_forward.gemm_kind(name) == kind


@pytest.fixture(scope="module")
def profile_peer_kernels():
    sys.path.insert(0, os.path.join(_ROOT, "scripts"))  # its imports of profile_backward
    spec = importlib.util.spec_from_file_location("profile_peer_kernels",
                                                  os.path.join(_ROOT, "scripts", "profile_peer_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peer_kernels_label_each_implementations_gemms(profile_peer_kernels):
    rows = [("void megamoe::sm90::m_grouped_gemm_sm90_kernel<...>", 2.0), ("gather_sum_kernel", 0.5),
            ("void megamoe::sm90::m_grouped_gemm_sm90_kernel<...>", 1.0)]
    assert [r[0] for r in profile_peer_kernels.label_rows("megamoe", "fwd", rows)] == ["up", None, "down"]
    torch_rows = [("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", 1.0), ("triton_poi_fused_index_mul_silu_0", 0.2)]
    assert [r[0] for r in profile_peer_kernels.label_rows("torch_compiled", "fwd", torch_rows)] == ["gemm", None]


def test_peer_kernels_summary_takes_medians_of_gemms_and_the_rest(profile_peer_kernels):
    def result(round_idx, event_ms, gemm_ms, other_ms):
        return {"shape": "s", "impl": "sonicmoe", "pass": "fwd", "round": round_idx, "event_ms": event_ms,
                "kernels": [{"label": "Gemm", "name": "g", "ms": gemm_ms},
                            {"label": None, "name": "o", "ms": other_ms}]}

    results = [result(0, 2.0, 1.0, 0.5), result(1, 4.0, 3.0, 0.25), result(2, 3.0, 2.0, 1.0)]
    table = profile_peer_kernels.summary(results)
    assert table.splitlines()[2] == "| s | fwd | sonicmoe | 3.000 | 3.000 | 2.000 | 0.500 | 3 |"


@pytest.fixture(scope="module")
def profile_train():
    spec = importlib.util.spec_from_file_location("profile_train", os.path.join(_ROOT, "scripts", "profile_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _MoEBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)
        self.experts = torch.nn.Linear(8, 8)

    def forward(self, x):  # the routing (softmax) in the block itself, as Hugging Face's sparse MoE blocks do it
        return self.experts(x) * self.gate(x).softmax(-1).sum(-1, keepdim=True)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(8)
        self.self_attn = torch.nn.Linear(8, 8)
        self.mlp = _MoEBlock()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(x)


class _TinyLM(torch.nn.Module):
    """The module names of a Hugging Face causal LM (model.embed_tokens, model.layers.N..., lm_head)."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(16, 8)
        self.model.layers = torch.nn.ModuleList([_Block()])
        self.lm_head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model.layers[0](self.model.embed_tokens(ids)))


def test_by_module_charges_forward_and_backward_ops_to_their_part(profile_train):
    from torch.profiler import ProfilerActivity, profile

    model = _TinyLM()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(16, (2, 5))
    handles = profile_train.scope_modules(model)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    events = prof.events()
    parts = profile_train.part_of_events(events)
    found = {}
    for evt in events:
        if evt.name in ("aten::mm", "aten::addmm", "aten::embedding_dense_backward", "aten::native_layer_norm",
                        "aten::native_layer_norm_backward", "aten::_softmax", "aten::_log_softmax", "aten::add"):
            found.setdefault(evt.name, set()).add(parts[evt.id])
    assert ("LM head", "fwd") in found["aten::mm"]  # lm_head has no bias: its forward is an mm
    assert {("LM head", "bwd"), ("attention", "bwd"), ("router", "bwd"), ("experts", "bwd")} <= found["aten::mm"]
    assert {("attention", "fwd"), ("router", "fwd"), ("experts", "fwd")} <= found["aten::addmm"]
    assert found["aten::native_layer_norm"] == {("norms", "fwd")}
    assert found["aten::native_layer_norm_backward"] == {("norms", "bwd")}
    assert found["aten::embedding_dense_backward"] == {("embedding", "bwd")}
    assert found["aten::_softmax"] == {("router", "fwd")}
    assert found["aten::_log_softmax"] == {(profile_train.OUTSIDE, "")}  # the loss, outside the model
    assert ("decoder layers, other", "fwd") in found["aten::add"]  # the residual adds
    assert any(part == ("optimizer", "") for part in parts.values())
    assert not [h for h in handles if h.id in model.lm_head._forward_hooks]  # the scopes are gone
