"""torchtitan 0.3.0's FSDP2, tensor-parallel and expert-parallel layouts with megamoe's converter, on CPU gloo
ranks (test_ep.py's spawn harness; the cases, and what they cover, in titan_parallel_cases.py): 2 ranks run every
case, 4 ranks the layouts that need them (EP 2 with FSDP2 2 on the experts, TP 2 with FSDP2 2)."""

import os

import pytest
import torch

from framework_cases import load_release

VERSION = load_release("torchtitan", "torchtitan")
from titan_models import skip_unless_importable  # noqa: E402

try:
    from torchtitan.protocols.model import ModelConfigConverter  # noqa: F401
except ImportError:
    pytest.skip(f"torchtitan {VERSION} has no model-config converters (0.3); its layouts are not tested here",
                allow_module_level=True)
skip_unless_importable(VERSION)  # its trainer module (which its model configs import) and its models

from test_ep import check_case, spawn_cases  # noqa: E402
from titan_parallel_cases import CASES, FOUR_RANK_CASES  # noqa: E402

WORLDS = {2: list(CASES), 4: FOUR_RANK_CASES}


@pytest.fixture(scope="module", params=list(WORLDS), ids=[f"P{world}" for world in WORLDS])
def group_results(request):
    seed = int(os.environ.get("MEGAMOE_SEED", torch.seed() % 2**31))
    print(f"seed={seed}")
    return request.param, seed, spawn_cases(request.param, WORLDS[request.param], seed,
                                            registry="titan_parallel_cases")


@pytest.mark.parametrize("case", list(CASES))
def test_torchtitan_layout(group_results, case):
    world = group_results[0]
    if case not in WORLDS[world]:
        pytest.skip(f"runs on {', '.join(str(w) for w, cases in WORLDS.items() if case in cases)} ranks")
    check_case(*group_results, case)
