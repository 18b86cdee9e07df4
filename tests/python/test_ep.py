"""megamoe.ep on CPU: 2 and 4 gloo processes (torch.multiprocessing spawn, rendezvous through a file) against
megamoe.moe with the full weights, in float64 through the CPU reference (the cases are in ep_cases.py); and what
needs no process group. One spawn per group size runs every case, so the processes start once."""

import json
import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

import megamoe
from ep_cases import CASES, run_cases

SPAWN_DEADLINE_S = 240  # the whole run of one group size; the gloo timeout (60 s) ends a stuck collective before


def spawn_cases(world, names, seed, backend="gloo", registry="ep_cases"):
    """Run the named cases of the module `registry` in `world` processes of a `backend` group; returns
    {case: [None | "SKIP: reason" | failure, per rank]}."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        context = mp.start_processes(run_cases, args=(world, init_file, seed, tmp, names, backend, registry),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + SPAWN_DEADLINE_S
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                pytest.fail(f"{world} ranks did not finish within {SPAWN_DEADLINE_S} s (a hang?)")
        per_rank = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    return {name: [results.get(name, "not run") for results in per_rank] for name in names}


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def group_results(request):
    seed = int(os.environ.get("MEGAMOE_SEED", torch.seed() % 2**31))
    print(f"seed={seed}")
    return request.param, seed, spawn_cases(request.param, list(CASES), seed)


def check_case(world, seed, results, case):
    """Skip with the case's reason, or fail with every rank's failure."""
    skips = [text for text in results[case] if text is not None and text.startswith("SKIP: ")]
    if skips:
        pytest.skip(skips[0][len("SKIP: "):])
    failures = [f"rank {rank}:\n{text}" for rank, text in enumerate(results[case]) if text is not None]
    assert not failures, f"{case} on {world} ranks (seed={seed}):\n" + "\n".join(failures)


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel(group_results, case):
    check_case(*group_results, case)


def test_needs_an_initialized_process_group():
    x = torch.zeros(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        megamoe.ep.moe(x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1, dtype=torch.float64),
                       torch.zeros(1, 6, 4, dtype=torch.float64), torch.zeros(1, 4, 3, dtype=torch.float64))


def test_chunk_bounds():
    from megamoe.ep_routing import _chunk_of_token, chunk_bounds

    for T, C in [(10, 3), (2, 5), (0, 2), (9, 1), (7, 7)]:
        bounds = chunk_bounds(T, C)
        assert bounds[0] == 0 and bounds[-1] == T and all(a <= b for a, b in zip(bounds, bounds[1:]))
        assert max(b - a for a, b in zip(bounds, bounds[1:])) - min(b - a for a, b in zip(bounds, bounds[1:])) <= 1
        want = torch.tensor([c for c in range(C) for _ in range(bounds[c + 1] - bounds[c])], dtype=torch.int64)
        assert torch.equal(_chunk_of_token(T, C, "cpu"), want)


def test_grouped_permutation():
    from megamoe.ep_routing import _grouped_permutation

    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # rows from rank s for local expert e
    recv_of_grouped, grouped_of_recv = _grouped_permutation(counts, 7)
    # received: s0e0 s0e0 s0e2 s1e0 s1e1 s1e1 s1e1; grouped: e0 (s0 s0 s1), e1 (s1 s1 s1), e2 (s0)
    assert recv_of_grouped.tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert torch.equal(grouped_of_recv[recv_of_grouped], torch.arange(7))
