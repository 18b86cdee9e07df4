"""megamoe's own Python-side argument errors under torch.compile(fullgraph=True): the same exception type and message
as in eager mode (raised when the compiled graph runs, argument_errors.py), never Dynamo's "Unsupported". The
library's checks (inside the ops) come through alike."""

import pytest
import torch

import megamoe
from conftest import make_problem

T, H, I, E, TOPK = 6, 16, 8, 4, 2


@pytest.fixture
def args(gen):
    x, ids, s, w13, w2, _ = make_problem(T, H, I, E, TOPK, dtype=torch.float32, gen=gen)
    return {"x": x.detach(), "topk_ids": ids, "topk_weights": s.detach(), "w13": w13.detach(), "w2": w2.detach()}


def _moe(**changes):
    return lambda a: megamoe.moe(**dict(a, **changes))


# Built outside the compiled calls (Dynamo does not construct parameters).
EXPERTS_OTHER_HIDDEN, EXPERTS, BLOCK_OTHER_HIDDEN = (megamoe.MoEExperts(E, H + 4, I), megamoe.MoEExperts(E, H, I),
                                                     megamoe.MoEBlock(H + 1, I, E, TOPK))

CASES = [
    # (case id, call(args), the argument its message names)
    ("ids_uint8", lambda a: megamoe.moe(**dict(a, topk_ids=a["topk_ids"].to(torch.uint8))), "topk_ids"),
    ("layout_str", _moe(layout="gpt_oss"), "layout"),
    ("precision_unknown", _moe(precision="fp16"), "precision"),
    ("main_grads_str", _moe(main_grads="w13"), "main_grads"),
    ("recompute_str", _moe(recompute="yes"), "recompute"),
    ("fp8_on_cpu", _moe(precision="fp8"), "precision"),
    ("library_check", lambda a: megamoe.moe(**dict(a, topk_ids=a["topk_ids"][:-1])), "topk_ids"),
    ("grouped_counts_int16", lambda a: megamoe.grouped_moe(a["x"], torch.tensor([T, 0, 0, 0], dtype=torch.int16),
                                                           a["w13"], a["w2"]), "tokens_per_expert"),
    ("experts_hidden", lambda a: EXPERTS_OTHER_HIDDEN(a["x"], a["topk_ids"], a["topk_weights"]), "x"),
    ("experts_transposed_weights",
     lambda a: EXPERTS(a["x"], a["topk_ids"], a["topk_weights"].t().contiguous()), "topk_weights"),
    ("block_hidden", lambda a: BLOCK_OTHER_HIDDEN(a["x"]).y, "x"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_compiled_errors_keep_their_type_and_message(args, case):
    _, call, name = case
    with pytest.raises(Exception) as eager:
        call(args)
    assert isinstance(eager.value, (TypeError, ValueError, NotImplementedError)), repr(eager.value)
    assert name in str(eager.value), str(eager.value)
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True)
    with pytest.raises(type(eager.value)) as traced:
        compiled(args)
    assert type(traced.value) is type(eager.value)
    assert str(traced.value) == str(eager.value)


def test_compiled_good_calls_still_run(args):
    """The checks cost a compiled call nothing but the trace: a valid call gives the eager result."""
    torch._dynamo.reset()
    experts = megamoe.MoEExperts(E, H, I)
    eager = experts(args["x"], args["topk_ids"], args["topk_weights"])
    compiled = torch.compile(experts, fullgraph=True)(args["x"], args["topk_ids"], args["topk_weights"])
    assert torch.equal(eager, compiled)
