"""The forward profile's kernel labels (scripts/profile_forward.py): which grouped GEMM a kernel name is, so the
printed TFLOP/s uses that GEMM's FLOPs (the up GEMM's policy was renamed GatedEpilogue and read as 'down')."""
import importlib.util
import os
import sys

import pytest

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
