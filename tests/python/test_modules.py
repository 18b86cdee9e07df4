"""megamoe.MoEExperts / megamoe.MoEBlock (CPU reference; CUDA where present): against a plain-PyTorch block built
on conftest's `torch_moe`, in float64, with every gradient; and 50 training steps against the plain-PyTorch block in
bf16 and fp32 (both memory modes)."""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import megamoe
from conftest import make_ids, rel_err, torch_moe


def torch_block(x, router_weight, w13, w2, topk, norm_topk_prob):
    """The block in plain PyTorch: fp64-or-fp32 router -> softmax -> top-k -> renorm -> experts.

    x [..., H] -> (y [..., H], router_logits [..., E])."""
    H, E = x.shape[-1], router_weight.shape[0]
    x2 = x.reshape(-1, H)  # [T, H]
    dtype = torch.promote_types(x.dtype, torch.float32)
    logits = x2.to(dtype) @ router_weight.to(dtype).t()  # [T, E]
    probs = logits.softmax(dim=-1)  # [T, E]
    weights, ids = probs.topk(topk, dim=-1)  # [T, topk]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    y = torch_moe(x2, ids, weights, w13, w2)  # [T, H]
    return y.reshape(x.shape), logits.reshape(*x.shape[:-1], E)


def block_grads(fn, x, params, dy, dlogits):
    """y, router_logits and the gradients of <dy, y> + <dlogits, router_logits> w.r.t. x and params."""
    y, logits = fn(x)
    inputs = [x] + list(params)
    grads = torch.autograd.grad((y * dy).sum() + (logits * dlogits).sum(), inputs)
    return [y.detach(), logits.detach()] + [g.detach() for g in grads]


@pytest.mark.parametrize("shape", [(3, 5), (13,)], ids=["BSH", "TH"])
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renorm", "no_renorm"])
def test_block_matches_torch_float64(shape, norm_topk_prob, gen):
    H, I, E, topk = 24, 16, 6, 2
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    block = megamoe.MoEBlock(H, I, E, topk, norm_topk_prob=norm_topk_prob, dtype=torch.float64, init_std=0.2)
    x = torch.randn(*shape, H, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(*shape, H, generator=gen, dtype=torch.float64)
    dlogits = torch.randn(*shape, E, generator=gen, dtype=torch.float64)
    params = (block.router.weight, block.experts.w13, block.experts.w2)

    ours = block_grads(block, x, params, dy, dlogits)
    theirs = block_grads(lambda x: torch_block(x, *params, topk, norm_topk_prob), x, params, dy, dlogits)
    names = ("y", "router_logits", "dx", "drouter", "dw13", "dw2")
    for name, a, b in zip(names, ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.3e}"
    assert ours[0].shape == x.shape and ours[1].shape == (*shape, E)


def test_block_output_is_a_named_pair(gen):
    block = megamoe.MoEBlock(16, 8, 4, 2)
    x = torch.randn(2, 3, 16, generator=gen)
    out = block(x)
    y, logits = out
    assert out.y is y and out.router_logits is logits
    assert y.shape == x.shape and logits.shape == (2, 3, 4)


def test_block_bf16_routes_in_fp32(gen):
    block = megamoe.MoEBlock(32, 16, 8, 2, dtype=torch.bfloat16)
    x = torch.randn(7, 32, generator=gen).to(torch.bfloat16).requires_grad_(True)
    y, logits = block(x)
    assert y.dtype == torch.bfloat16 and logits.dtype == torch.float32
    y.float().square().sum().backward()
    for p in (x, block.router.weight, block.experts.w13, block.experts.w2):
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad.float()).all()


def test_block_init_like_hf():
    block = megamoe.MoEBlock(256, 128, 16, 4, init_std=0.02)
    for p in (block.router.weight, block.experts.w13, block.experts.w2):
        assert abs(p.std().item() - 0.02) < 2e-3 and abs(p.mean().item()) < 2e-3


def test_block_rejects_bad_topk():
    with pytest.raises(ValueError, match="topk"):
        megamoe.MoEBlock(8, 4, 4, 5)


def test_experts_leading_dims_and_dropped_slots(gen):
    H, I, E, topk = 12, 8, 5, 3
    experts = megamoe.MoEExperts(E, H, I, dtype=torch.float64, init_std=0.3)
    x = torch.randn(2, 4, H, generator=gen, dtype=torch.float64)
    ids = make_ids(8, E, topk, "dropped", gen).reshape(2, 4, topk)
    s = torch.rand(2, 4, topk, generator=gen, dtype=torch.float64)
    y = experts(x, ids, s)
    expected = torch_moe(x.reshape(8, H), ids.reshape(8, topk), s.reshape(8, topk), experts.w13, experts.w2)
    assert y.shape == x.shape and rel_err(y, expected.reshape(x.shape)) < 1e-12


def test_experts_hf_names(gen):
    experts = megamoe.MoEExperts(4, 8, 6)
    assert experts.gate_up_proj is experts.w13 and experts.down_proj is experts.w2
    assert experts.w13.shape == (4, 12, 8) and experts.w2.shape == (4, 8, 6)
    hf_state = {"gate_up_proj": torch.randn(4, 12, 8, generator=gen), "down_proj": torch.randn(4, 8, 6, generator=gen)}
    experts.load_state_dict(hf_state)
    assert torch.equal(experts.w13, hf_state["gate_up_proj"]) and torch.equal(experts.w2, hf_state["down_proj"])
    assert sorted(experts.state_dict()) == ["w13", "w2"]


def test_load_balancing_loss(gen):
    E, topk = 6, 2
    logits = [torch.randn(10, E, generator=gen, requires_grad=True), torch.randn(2, 5, E, generator=gen)]
    flat = torch.cat([logits[0], logits[1].reshape(-1, E)])
    probs = flat.softmax(-1)
    counts = F.one_hot(probs.topk(topk, dim=-1).indices, E).sum(dim=(0, 1)).float()  # [E]
    expected = E * (counts / flat.shape[0] * probs.mean(0)).sum()
    loss = megamoe.load_balancing_loss(logits, topk)
    assert torch.allclose(loss, expected, rtol=1e-6)
    loss.backward()
    assert logits[0].grad is not None


def test_import_does_not_import_transformers():
    code = "import sys, megamoe; assert 'transformers' not in sys.modules, 'megamoe imported transformers'"
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_block_cuda_bf16(gen):
    H, I, E, topk = 64, 48, 8, 2
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    block = megamoe.MoEBlock(H, I, E, topk, dtype=torch.bfloat16, device="cuda", init_std=0.1)
    x = torch.randn(3, 37, H, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    y, logits = block(x)
    ids, weights = megamoe.modules.route(logits.reshape(-1, E), topk)
    f32 = (x.detach().float().reshape(-1, H), block.experts.w13.detach().float(), block.experts.w2.detach().float())
    expected = torch_moe(f32[0], ids, weights, f32[1], f32[2]).reshape(x.shape)
    assert y.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert rel_err(y, expected) < 2e-2, rel_err(y, expected)
    y.float().square().sum().backward()
    for p in (x, block.router.weight, block.experts.w13, block.experts.w2):
        assert p.grad is not None and torch.isfinite(p.grad.float()).all()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def train_block(initial, data, targets, dtype, use_megamoe, recompute=False, lr=1e-2):
    """Per-step losses of AdamW training of a copy of `initial` (router + experts) in `dtype`: a regression loss on
    the block's output plus the load-balancing loss on its router logits. use_megamoe: the block as is; else the same
    parameters through `torch_block` (plain PyTorch)."""
    block = copy.deepcopy(initial).to(dtype)
    block.experts.recompute = recompute
    params = [block.router.weight, block.experts.w13, block.experts.w2]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for x, target in zip(data, targets):
        x = x.to(dtype)
        if use_megamoe:
            y, logits = block(x)
        else:
            y, logits = torch_block(x, *params, block.topk, block.norm_topk_prob)
        loss = (y.float() - target).square().mean() + 0.01 * megamoe.load_balancing_loss(logits.float(), block.topk)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True], ids=["keep_h", "recompute"])
def test_block_training_tracks_torch_path(device, recompute, gen):
    """50 AdamW steps of a router + experts block from the same init on the same data: bf16 megamoe (either memory
    mode), bf16 plain PyTorch and an fp32 plain-PyTorch reference. megamoe must drift from the reference no more than
    the bf16 PyTorch block does (1.5x + 1% of the initial loss on the mean), and the two bf16 curves must be no
    further apart than bf16 is from fp32 (or 5% of the initial loss)."""
    H, I, E, topk, T, steps = 64, 96, 8, 2, 256, 50
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    initial = megamoe.MoEBlock(H, I, E, topk, dtype=torch.float32, device=device, init_std=0.1)
    teacher = torch.randn(H, H, generator=gen).to(device) / H**0.5
    data = [torch.randn(T, H, generator=gen).to(device) for _ in range(steps)]
    targets = [torch.tanh(x @ teacher) for x in data]
    reference = train_block(initial, data, targets, torch.float32, use_megamoe=False)
    plain = train_block(initial, data, targets, torch.bfloat16, use_megamoe=False)
    ours = train_block(initial, data, targets, torch.bfloat16, use_megamoe=True, recompute=recompute)

    assert torch.isfinite(ours).all()
    assert reference[-10:].mean() < 0.8 * reference[0], "the loss should fall (else the comparison says little)"
    drift_ours, drift_plain = (ours - reference).abs(), (plain - reference).abs()
    scale = reference[0].item()
    assert drift_ours.mean() <= 1.5 * drift_plain.mean() + 0.01 * scale, (drift_ours.mean(), drift_plain.mean())
    gap = (ours - plain).abs().max()
    assert gap <= max(0.05 * scale, drift_plain.max()), (gap, drift_plain.max())
