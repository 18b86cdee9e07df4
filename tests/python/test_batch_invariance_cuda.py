"""Batch invariance on a GPU: a token's y, and given its dy its dx and d topk_weights, are bitwise the same whatever
other tokens share the call. RL frameworks need this so that the sampler's and the trainer's log-probabilities agree.
Subsets of one batch (T = 1, 7, 128 and the whole batch, each shuffled) against the whole batch, on the fused sm_90a
kernels and on the portable ones, in both memory modes. Skipped, with the reason, where no GPU is present (or, for the sm_90a cases, no Hopper
GPU)."""

import pytest
import torch

import megamoe
from conftest import make_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests need one")

T, H, I, E, TOPK = 4096, 264, 200, 16, 4  # H, I off every tile; a few hundred rows per expert
SUBSET_SIZES = (1, 7, 128, T)
PATHS = {  # name: environment of the call, expected path
    "sm90": ({"MEGAMOE_DISABLE_SM90": "0"}, "sm90"),
    "portable": ({"MEGAMOE_DISABLE_SM90": "1"}, "cuda"),
}


@pytest.fixture
def environment(request, monkeypatch):
    settings, expected = PATHS[request.param]
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    return expected


def per_token_outputs(x, ids, s, w13, w2, dy, keep_h):
    """(y [n, H], dx [n, H], d topk_weights [n, topk]) of one forward and backward of these tokens."""
    y, h = torch.ops.megamoe.moe_forward(x, ids, s, w13, w2, keep_h)
    grads = megamoe.moe_backward(dy, x, ids, s, w13, w2, h if keep_h else None, grads=("dx", "dtopk_weights"))
    return y, grads[0], grads[1]


@pytest.mark.parametrize("keep_h", [True, False], ids=["keep-h", "recompute"])
@pytest.mark.parametrize("environment", list(PATHS), indirect=True)
def test_a_tokens_outputs_do_not_depend_on_the_batch(environment, keep_h, gen):
    x, ids, s, w13, w2, dy = [t.detach().cuda() for t in make_problem(T, H, I, E, TOPK, "dropped",
                                                                      dtype=torch.bfloat16, gen=gen)]
    path = megamoe.path_of(x, ids, s, w13, w2, backward=True)
    if environment == "sm90" and not path.startswith("sm90"):
        pytest.skip(f"the sm_90a kernels do not run here ({path}: {path.reason})")
    assert path.startswith(environment), f"path {path} ({path.reason}), expected {environment}"
    whole = per_token_outputs(x, ids, s, w13, w2, dy, keep_h)
    for size in SUBSET_SIZES:
        tokens = torch.randperm(T, generator=gen)[:size].cuda()  # shuffled: the subset's own order
        part = per_token_outputs(*[t[tokens].contiguous() for t in (x, ids, s)], w13, w2, dy[tokens].contiguous(),
                                 keep_h)
        for name, got, want in zip(("y", "dx", "dtopk_weights"), part, whole):
            assert torch.equal(got, want[tokens]), (
                f"{name} of {size} tokens differs from theirs in the whole batch of {T}")
