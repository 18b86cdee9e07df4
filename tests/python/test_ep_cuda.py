"""megamoe.ep on one GPU: a process group of size 1 over NCCL equals megamoe.moe (the cases are in
ep_cuda_cases.py). Skipped, with the reason, where no GPU (or no NCCL) is present. Several GPUs: bench/bench_ep.py
checks EP = 2, 4, 8 against a group of size 1 before it times them."""

import os

import pytest
import torch
import torch.distributed as dist

from ep_cuda_cases import CASES
from test_ep import check_case, spawn_cases

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(), reason="torch without NCCL"),
]


@pytest.fixture(scope="module")
def nccl_results():
    seed = int(os.environ.get("MEGAMOE_SEED", torch.seed() % 2**31))
    print(f"seed={seed}")
    return 1, seed, spawn_cases(1, list(CASES), seed, backend="nccl", registry="ep_cuda_cases")


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_one_gpu(nccl_results, case):
    check_case(*nccl_results, case)
