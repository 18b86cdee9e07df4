"""DTensor weights on CPU: 2 gloo processes (test_ep.py's spawn harness, the cases in dtensor_cases.py) running
megamoe.ep.moe / ep.MoEExperts on expert-sharded DTensors, megamoe.grouped_moe on the local experts, megamoe.moe and
MoEExperts on replicated ones, the placements each refuses, and FSDP2's fully_shard around the modules. One spawn runs
every case."""

import os

import pytest
import torch

from dtensor_cases import CASES
from test_ep import check_case, spawn_cases

WORLD = 2


@pytest.fixture(scope="module")
def results():
    seed = int(os.environ.get("MEGAMOE_SEED", torch.seed() % 2**31))
    print(f"seed={seed}")
    return WORLD, seed, spawn_cases(WORLD, list(CASES), seed, registry="dtensor_cases")


@pytest.mark.parametrize("case", list(CASES))
def test_dtensor_weights(results, case):
    check_case(*results, case)
