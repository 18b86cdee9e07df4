"""megamoe.adapters.megatron.te_grouped_mlp on TE's per-expert weight lists (weight0 ... weight{E-1}), in float64 on
the CPU, against the plain-PyTorch TEGroupedMLP of test_adapters_megatron: each memory layout of a list (one
contiguous block in expert order: read in place, no copy; descending addresses, gaps, scattered, not contiguous:
stacked, warned once) gives the same forward and gradients; the in-place block is what megamoe receives (its storage,
no new one); an optimizer's in-place update is seen by the next call; main_grad fusion adds into every expert's
main_grad exactly and sets grad_added_to_main_grad; pack_expert_parameters; errors naming the argument;
torch.compile (the copy path)."""

import warnings

import pytest
import torch

from adapter_cases import ROUTINGS, assert_close, grads, randn
from conftest import rel_err
from megamoe.adapters import megatron
from test_adapters_megatron import rows_problem, te_grouped_mlp as reference

LAYOUTS = ["ascending", "descending", "gaps", "scattered", "not_contiguous"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Every test sees the once-per-argument fallback warning afresh."""
    monkeypatch.setattr(megatron, "_warned", set())


def expert_list(gen, E, shape, layout, scale=0.3):
    """E leaf Parameters of `shape` laid out in memory as `layout` (the values random either way)."""
    numel = torch.Size(shape).numel()
    if layout == "scattered":
        return [torch.nn.Parameter(randn(gen, *shape, scale=scale).detach()) for _ in range(E)]
    if layout == "not_contiguous":
        block = randn(gen, E, *reversed(shape), scale=scale).detach()
        return [torch.nn.Parameter(block[e].t()) for e in range(E)]
    width = numel + (3 if layout == "gaps" else 0)
    block = randn(gen, E, width, scale=scale).detach()
    order = range(E - 1, -1, -1) if layout == "descending" else range(E)
    return [torch.nn.Parameter(block[e, :numel].view(shape)) for e in order]


def problem(gen, layout="ascending", case=ROUTINGS[0], biases=True):
    x, counts, probs, dout, (H, I, E) = rows_problem(case, gen)
    shapes = [(2 * I, H), (H, I)] + ([(2 * I,), (H,)] if biases else [])
    lists = [expert_list(gen, E, shape, layout) for shape in shapes]
    return x, counts, probs, dout, lists


def leaves_of(x, probs, lists):
    return {"x": x, "probs": probs, **{f"p{i}_{e}": t for i, ts in enumerate(lists) for e, t in enumerate(ts)}}


def record_calls(monkeypatch):
    """The arguments megamoe.grouped_moe receives from the adapter, per call."""
    calls = []
    original = megatron.grouped_moe

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(megatron, "grouped_moe", recording)
    return calls


def is_alias_of(tensor, first):
    return (tensor.data_ptr() == first.data_ptr()
            and tensor.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ROUTINGS[:3], ids=[c[0] for c in ROUTINGS[:3]])
def test_every_layout_matches_megatron_and_the_stacked_copy(layout, case, gen):
    x, counts, probs, dout, lists = problem(gen, layout, case)
    leaves = leaves_of(x, probs, lists)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = grads(lambda: megatron.te_grouped_mlp(x, counts, probs, *lists), leaves, dout)
        stacked = grads(lambda: megatron.te_grouped_mlp(x, counts, probs, *(torch.stack(ts) for ts in lists)),
                        leaves, dout)
    theirs = grads(lambda: reference(x, counts, probs, *(torch.stack(ts) for ts in lists)), leaves, dout)
    assert_close(ours, theirs)
    assert_close(ours, stacked)


def test_one_block_is_read_in_place_without_a_warning(gen, monkeypatch):
    """The [E, ...] tensors megamoe receives alias weight0's storage (no new storage: zero copy), no warning; each
    weight's .grad is its expert's slice of the gradient."""
    x, counts, probs, dout, lists = problem(gen)
    calls = record_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = megatron.te_grouped_mlp(x, counts, probs, *lists)
    (args, kwargs), = calls
    received = [args[2], args[3], kwargs["b13"], kwargs["b2"]]
    for tensor, ts in zip(received, lists):
        assert is_alias_of(tensor, ts[0]) and tensor.is_contiguous() and tensor.shape == (len(ts), *ts[0].shape)
    out.backward(dout)
    stacked = [torch.stack(ts).detach().requires_grad_() for ts in lists]
    expected = torch.autograd.grad(reference(x.detach(), counts, probs.detach(), *stacked), stacked, dout)
    for ts, grad in zip(lists, expected):
        for e, t in enumerate(ts):
            assert rel_err(t.grad, grad[e]) < 1e-12


def test_other_layouts_are_copied(gen, monkeypatch):
    calls = record_calls(monkeypatch)
    for layout in LAYOUTS[1:]:
        x, counts, probs, _, lists = problem(gen, layout, biases=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            megatron.te_grouped_mlp(x, counts, probs, *lists)
        w13 = calls[-1][0][2]
        assert all(w13.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in lists[0]), layout


def test_an_optimizer_step_is_seen_by_the_next_call(gen):
    x, counts, probs, dout, lists = problem(gen)
    params = [t for ts in lists for t in ts]
    optimizer = torch.optim.SGD(params, lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        out, _ = megatron.te_grouped_mlp(x, counts, probs, *lists)
        expected = reference(x, counts, probs, *(torch.stack(ts) for ts in lists))
        assert rel_err(out, expected) < 1e-12
        out.backward(dout)
        optimizer.step()  # in place on each weight_e, i.e. on the shared block
    with torch.no_grad():
        lists[1][2].mul_(-2.0)  # one expert's weight alone
    out, _ = megatron.te_grouped_mlp(x, counts, probs, *lists)
    assert rel_err(out, reference(x, counts, probs, *(torch.stack(ts) for ts in lists))) < 1e-12


def test_an_inplace_update_before_the_backward_raises(gen):
    """The [E, ...] alias is a view of weight0 (autograd refuses a backward through it after weight0 changed in
    place); the other experts' versions are checked by the list's backward."""
    x, counts, probs, dout, lists = problem(gen, biases=False)
    for expert in (0, 2):
        out, _ = megatron.te_grouped_mlp(x, counts, probs, *lists)
        with torch.no_grad():
            lists[0][expert].add_(1.0)
        with pytest.raises(RuntimeError, match="inplace"):
            out.backward(dout)


def main_grad_block(gen, ts, layout="ascending", ddp=True):
    """main_grads of the weights `ts`: f32 views of one block (already holding values), Megatron DDP's flags."""
    E, shape = len(ts), ts[0].shape
    block = torch.randn(E, *shape, generator=gen, dtype=torch.float32)
    if layout == "scattered":
        views = [block[e].clone() for e in range(E)]
    else:
        views = [block[E - 1 - e] if layout == "descending" else block[e] for e in range(E)]
    for e, t in enumerate(ts):
        t.main_grad = views[e]
        if ddp:
            t.grad_added_to_main_grad = False
            t.zero_out_wgrad = e % 2 == 0
    return block


@pytest.mark.parametrize("weights", ["ascending", "scattered"])
@pytest.mark.parametrize("ddp", [True, False])
def test_main_grad_fusion_adds_into_every_expert(weights, ddp, gen, monkeypatch):
    """gradient_accumulation_fusion with lists: megamoe adds into the main_grads' block (twice: two backwards);
    DDP params get grad_added_to_main_grad and a placeholder gradient (zeros where zero_out_wgrad), their hooks
    run; without the attribute .grad stays None. Scattered weights (copied) still fuse into a block of main_grads."""
    x, counts, probs, dout, lists = problem(gen, weights)
    blocks = [main_grad_block(gen, ts, ddp=ddp) for ts in lists]
    initial = [[t.main_grad.clone() for t in ts] for ts in lists]
    hooked = []
    for ts in lists:
        for t in ts:
            t.register_post_accumulate_grad_hook(lambda p: hooked.append(p))
    stacked = [torch.stack(ts).detach().requires_grad_() for ts in lists]
    expected = torch.autograd.grad(reference(x.detach(), counts, probs.detach(), *stacked), stacked, dout)
    calls = record_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2):
            out, _ = megatron.te_grouped_mlp(x, counts, probs, *lists, gradient_accumulation_fusion=True)
            out.backward(dout)
    buffers = calls[0][1]["main_grads"]
    for key, block in zip(("w13", "w2", "b13", "b2"), blocks):
        assert buffers[key].data_ptr() == block.data_ptr() and buffers[key].shape == block.shape
    for ts, start, grad in zip(lists, initial, expected):
        for e, t in enumerate(ts):
            assert rel_err(t.main_grad.double() - start[e].double(), 2 * grad[e]) < 1e-6
            if ddp:
                assert t.grad_added_to_main_grad and t.grad is not None and t.grad.shape == t.shape
                if t.zero_out_wgrad:
                    assert t.grad.abs().max() == 0
            else:
                assert t.grad is None
    if ddp:  # every expert's gradient hook ran on each backward
        assert len(hooked) == 2 * sum(len(ts) for ts in lists)
    assert x.grad is not None and probs.grad is not None


@pytest.mark.parametrize("layout", ["descending", "scattered"])
def test_main_grads_not_one_block_raise(layout, gen):
    x, counts, probs, _, lists = problem(gen, biases=False)
    main_grad_block(gen, lists[0], layout)
    main_grad_block(gen, lists[1])
    with pytest.raises(ValueError, match=r"main_grads of fc1_weight\[0 \.\.\. 3\].*pack_expert_parameters"):
        megatron.te_grouped_mlp(x, counts, probs, *lists, gradient_accumulation_fusion=True)


@pytest.mark.parametrize("layout, why", [("descending", "descending address order"), ("gaps", "gaps"),
                                         ("scattered", "not views of one storage"),
                                         ("not_contiguous", "not contiguous")])
def test_a_copied_list_warns_once(layout, why, gen):
    x, counts, probs, dout, lists = problem(gen, "ascending", biases=False)
    lists[0] = expert_list(gen, len(lists[0]), lists[0][0].shape, layout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            out, _ = megatron.te_grouped_mlp(x, counts, probs, *lists)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    for part in ("te_grouped_mlp", "fc1_weight", "pack_expert_parameters", why):
        assert part in message, message
    assert caught[0].filename == __file__  # attributed to the caller of te_grouped_mlp
    assert rel_err(out, reference(x, counts, probs, *(torch.stack(ts) for ts in lists))) < 1e-12


class GroupedLinear(torch.nn.Module):
    """TE GroupedLinear's per-expert parameters: weight0 ... weight{E-1}, bias0 ... bias{E-1}."""

    def __init__(self, gen, E, out_features, in_features):
        super().__init__()
        for e in range(E):
            self.register_parameter(f"weight{e}", torch.nn.Parameter(randn(gen, out_features, in_features).detach()))
            self.register_parameter(f"bias{e}", torch.nn.Parameter(randn(gen, out_features).detach()))

    def lists(self, E):
        return [getattr(self, f"weight{e}") for e in range(E)], [getattr(self, f"bias{e}") for e in range(E)]


def test_pack_expert_parameters_makes_a_module_read_in_place(gen, monkeypatch):
    x, counts, probs, dout, (H, I, E) = rows_problem(ROUTINGS[0], gen)
    fc1, fc2 = GroupedLinear(gen, E, 2 * I, H), GroupedLinear(gen, E, H, I)
    experts = torch.nn.ModuleDict(dict(fc1=fc1, fc2=fc2))
    for p in experts.parameters():
        p.main_grad = torch.randn(p.shape, generator=gen, dtype=torch.float32)
    params = list(experts.parameters())
    values = [p.detach().clone() for p in params]
    main_grads = [p.main_grad.clone() for p in params]
    blocks = megatron.pack_expert_parameters(experts)
    assert len(blocks) == 4 and list(experts.parameters()) == params  # the same Parameter objects
    for p, value, main_grad in zip(params, values, main_grads):
        assert torch.equal(p, value) and torch.equal(p.main_grad, main_grad)
    (w1, b1), (w2, b2) = fc1.lists(E), fc2.lists(E)
    for ts in (w1, b1, w2, b2):
        assert megatron._in_place(ts)[0] and megatron._in_place([t.main_grad for t in ts])[0]
    calls = record_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = megatron.te_grouped_mlp(x, counts, probs, w1, w2, b1, b2)
    assert is_alias_of(calls[0][0][2], w1[0]) and is_alias_of(calls[0][0][3], w2[0])
    expected = reference(x, counts, probs, *(torch.stack(ts) for ts in (w1, w2, b1, b2)))
    assert rel_err(out, expected) < 1e-12
    again = megatron.pack_expert_parameters(experts)  # already packed: nothing moves
    assert [b.data_ptr() for b in again] == [b.data_ptr() for b in blocks]


def test_pack_expert_parameters_on_lists(gen):
    """A list (descending here, as Megatron DDP's buffers) or a list of lists; main_grad=False leaves them."""
    E = 4
    down = expert_list(gen, E, (6, 5), "descending")
    scattered = expert_list(gen, E, (5, 3), "scattered")
    for t in down:
        t.main_grad = torch.zeros(t.shape, dtype=torch.float32)
    before = [t.main_grad.data_ptr() for t in down]
    values = [t.detach().clone() for t in down + scattered]
    megatron.pack_expert_parameters([down, scattered], main_grad=False)
    assert megatron._in_place(down)[0] and megatron._in_place(scattered)[0]
    assert all(torch.equal(t, v) for t, v in zip(down + scattered, values))
    assert [t.main_grad.data_ptr() for t in down] == before
    single = expert_list(gen, E, (3,), "gaps")
    megatron.pack_expert_parameters(single)
    assert megatron._in_place(single)[0]
    with pytest.raises(TypeError, match="module_or_params"):
        megatron.pack_expert_parameters(torch.zeros(3))
    fresh = expert_list(gen, E, (6, 5), "scattered")
    pointers = [t.data_ptr() for t in fresh]
    with pytest.raises(ValueError, match=r"module_or_params\[1\]\[2\] has shape"):
        megatron.pack_expert_parameters([fresh, scattered[:2] + [down[0]]])
    assert [t.data_ptr() for t in fresh] == pointers  # checked before anything moved
    mixed = GroupedLinear(gen, E, 6, 5)
    mixed.weight2 = torch.nn.Parameter(torch.zeros(5, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"inner.weight\{e\}\[2\] has shape"):
        megatron.pack_expert_parameters(torch.nn.ModuleDict(dict(inner=mixed)))


def test_bad_lists_name_the_argument(gen):
    x, counts, probs, _, (H, I, E) = rows_problem(ROUTINGS[0], gen)
    fc1, fc2 = expert_list(gen, E, (2 * I, H), "ascending"), expert_list(gen, E, (H, I), "ascending")
    with pytest.raises(ValueError, match=r"fc1_weight\[2\] has shape"):
        megatron.te_grouped_mlp(x, counts, probs, fc1[:2] + [fc1[2][:-2]] + fc1[3:], fc2)
    with pytest.raises(ValueError, match=r"fc2_weight\[1\] has dtype"):
        megatron.te_grouped_mlp(x, counts, probs, fc1, [fc2[0], fc2[1].float()] + fc2[2:])
    with pytest.raises(ValueError, match=r"fc2_weight\[3\] has device"):
        meta = torch.empty(H, I, dtype=torch.float64, device="meta")
        megatron.te_grouped_mlp(x, counts, probs, fc1, fc2[:3] + [meta])
    with pytest.raises(ValueError, match=r"fc2_weight has 3 experts, fc1_weight 4"):
        megatron.te_grouped_mlp(x, counts, probs, fc1, fc2[:3])
    with pytest.raises(ValueError, match=r"fc2_bias has 3 experts"):
        megatron.te_grouped_mlp(x, counts, probs, fc1, fc2, None, [torch.zeros(H, dtype=torch.float64)] * 3)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        megatron.te_grouped_mlp(x, counts, probs, fc1[:3], fc2[:3])
    with pytest.raises(ValueError, match="fc1_weight is an empty list"):
        megatron.te_grouped_mlp(x, counts, probs, [], fc2)
    with pytest.raises(ValueError, match=r"fc1_weight\[0\]\.main_grad"):
        megatron.te_grouped_mlp(x, counts, probs, fc1, fc2, gradient_accumulation_fusion=True)
    fc1[1].requires_grad_(False)
    with pytest.raises(ValueError, match="fc1_weight mixes experts"):
        megatron.te_grouped_mlp(x, counts, probs, fc1, fc2, gradient_accumulation_fusion=True)


def test_torch_compile_stacks_the_lists(gen):
    """Under torch.compile the lists are stacked (a traced copy: their addresses are not read), fullgraph."""
    x, counts, probs, dout, lists = problem(gen)
    leaves = leaves_of(x, probs, lists)

    def block(x, counts, probs, fc1, fc2, b1, b2):
        return megatron.te_grouped_mlp(x, counts, probs, fc1, fc2, b1, b2)[0]

    compiled = torch.compile(block, fullgraph=True)
    ours = grads(lambda: compiled(x, counts, probs, *lists), leaves, dout)
    theirs = grads(lambda: block(x, counts, probs, *lists), leaves, dout)
    assert_close(ours, theirs)
