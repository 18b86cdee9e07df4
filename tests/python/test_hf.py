"""Hugging Face transformers integration (`megamoe.hf`): a tiny Qwen3-MoE built from a config with random weights
(no download), megamoe vs eager on the CPU in fp32/fp64 (logits and every parameter gradient), megamoe vs
grouped_mm in bf16 within bf16 noise, 50-step training loss curves, and a smoke run of the example script."""

import copy
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

transformers = pytest.importorskip(
    "transformers", minversion="5.0", reason="transformers 5.x not installed (pip install 'transformers>=5,<6')"
)

import megamoe  # noqa: E402
import megamoe.hf  # noqa: E402
from conftest import rel_err  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def tiny_config(**overrides):
    """A tiny Qwen3-MoE: 2 layers, hidden 64, 8 experts of intermediate 32, top-2, vocabulary 128."""
    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


def make_model(cfg, dtype, device="cpu", experts="eager", seed=0):
    """A causal LM with random weights (seeded), in eval mode, on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, attn_implementation="eager", experts_implementation=experts
        )
    return model.eval()


def logits_and_grads(model, input_ids, dlogits):
    """logits and every parameter's gradient of <dlogits, logits>."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    (logits.float() * dlogits).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def assert_compiled_forward_matches_eager(model, input_ids, dlogits, bound):
    """model.forward under torch.compile(fullgraph=True, aot_eager) gives the eager logits and every parameter's
    gradient within `bound` (relative)."""
    expected_logits, expected_grads = logits_and_grads(model, input_ids, dlogits)
    model.forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    logits, grads = logits_and_grads(model, input_ids, dlogits)
    assert rel_err(logits, expected_logits) < bound
    for name, grad in grads.items():
        assert rel_err(grad, expected_grads[name]) < bound, name


def inputs(cfg, batch, seq, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    dlogits = torch.randn(batch, seq, cfg.vocab_size, generator=gen)
    return ids.to(device), dlogits.to(device)


def test_registered():
    assert "megamoe" in ALL_EXPERTS_FUNCTIONS
    assert megamoe.hf.register() == "megamoe" and ALL_EXPERTS_FUNCTIONS["megamoe"] is megamoe.hf.megamoe_experts_forward


def test_from_config_runs_megamoe(monkeypatch):
    cfg = tiny_config()
    model = make_model(cfg, torch.float32, experts="megamoe")
    assert model.config._experts_implementation == "megamoe"
    calls = []

    def counting_moe(*args, **kwargs):
        calls.append(args[0].shape)
        return megamoe.moe(*args, **kwargs)

    monkeypatch.setattr(megamoe.hf, "moe", counting_moe)
    ids, _ = inputs(cfg, 2, 5, "cpu")
    model(input_ids=ids)
    assert calls == [(10, cfg.hidden_size)] * cfg.num_hidden_layers


def test_from_pretrained_runs_megamoe(tmp_path):
    """A saved checkpoint loads straight into the megamoe implementation and gives the eager logits."""
    cfg = tiny_config()
    model = make_model(cfg, torch.float32, experts="eager")
    ids, _ = inputs(cfg, 2, 12, "cpu")
    expected = model(input_ids=ids).logits.detach()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="megamoe", attn_implementation="eager")
    assert loaded.config._experts_implementation == "megamoe"
    assert rel_err(loaded(input_ids=ids).logits.detach(), expected) < 1e-5


@pytest.mark.parametrize(
    "dtype,norm_topk_prob,bound",
    [(torch.float32, True, 2e-5), (torch.float64, True, 1e-12), (torch.float64, False, 1e-12)],
    ids=["fp32", "fp64", "fp64_no_renorm"],
)
def test_cpu_matches_eager(dtype, norm_topk_prob, bound):
    cfg = tiny_config(norm_topk_prob=norm_topk_prob)
    model = make_model(cfg, dtype, experts="eager")
    ids, dlogits = inputs(cfg, 2, 24, "cpu")
    storage = {name: p.data_ptr() for name, p in model.named_parameters()}

    ref_logits, ref_grads = logits_and_grads(model, ids, dlogits)
    model.set_experts_implementation("megamoe")
    assert model.config._experts_implementation == "megamoe"
    logits, grads = logits_and_grads(model, ids, dlogits)

    assert {name: p.data_ptr() for name, p in model.named_parameters()} == storage  # switched, not copied
    assert logits.dtype == dtype and rel_err(logits, ref_logits) < bound, rel_err(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and any("experts.gate_up_proj" in name for name in grads)
    for name, grad in grads.items():
        err = rel_err(grad, ref_grads[name])
        assert grad.dtype == dtype and err < bound, f"{name}: {err:.3e}"


def test_torch_compile_fullgraph():
    """The megamoe experts forward traces inside a whole Hugging Face model with fullgraph=True (no graph break)."""
    cfg = tiny_config()
    model = make_model(cfg, torch.float32, experts="megamoe")
    ids, dlogits = inputs(cfg, 2, 16, "cpu")
    assert_compiled_forward_matches_eager(model, ids, dlogits, 1e-6)


def custom_experts_class(**flags):
    """A Qwen3-style experts module decorated with `use_experts_implementation(**flags)` (for layouts Qwen3
    does not use); `is_transposed` stores gate_up_proj [E, H, 2I] and down_proj [E, I, H]."""

    @use_experts_implementation(**flags)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
            transposed = flags.get("is_transposed", False)
            self.num_experts = E
            self.gate_up_proj = nn.Parameter(torch.randn((E, H, 2 * I) if transposed else (E, 2 * I, H)) * 0.2)
            self.down_proj = nn.Parameter(torch.randn((E, I, H) if transposed else (E, H, I)) * 0.2)
            if flags.get("has_bias"):
                self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
                self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
            self.act_fn = ACT2FN["silu"]

    return Experts


def run_experts(experts, impl, x, ids, weights):
    """y and every parameter's gradient of sum(y^2) under experts implementation `impl`."""
    experts.config._experts_implementation = impl
    for p in experts.parameters():
        p.grad = None
    y = experts(x, ids, weights)
    y.square().sum().backward()
    return [y.detach()] + [p.grad.clone() for p in experts.parameters()]


@pytest.mark.parametrize("flags", [dict(is_transposed=True), dict(is_transposed=True, has_bias=True), dict(has_bias=True)],
                         ids=["transposed", "transposed_bias", "bias"])
def test_stored_layouts_match_batched_mm(flags, recwarn):
    """Experts stored transposed or with biases: read in place (no copy, no warning), every gradient (biases too) as
    batched_mm's. (Interleaved experts: gpt-oss, test_hf_models.py.)"""
    config = types.SimpleNamespace(num_experts=4, hidden_size=12, moe_intermediate_size=6, _experts_implementation=None)
    experts = custom_experts_class(**flags)(config).double()
    if flags.get("has_bias"):
        with torch.no_grad():
            experts.gate_up_proj_bias.normal_()
            experts.down_proj_bias.normal_()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 12, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])  # [T, 2]
    weights = torch.rand(9, 2, generator=gen, dtype=torch.float64)
    expected = run_experts(experts, "batched_mm", x, ids, weights)
    got = run_experts(experts, "megamoe", x, ids, weights)
    assert not [w for w in recwarn if "megamoe" in str(w.message)]
    for a, b in zip(got, expected):
        assert rel_err(a, b) < 1e-12


def test_unsupported_experts_raise():
    config = types.SimpleNamespace(num_experts=2, hidden_size=4, moe_intermediate_size=3)
    config._experts_implementation = "megamoe"
    experts = custom_experts_class()(config)
    experts.act_fn = ACT2FN["gelu"]
    with pytest.raises(NotImplementedError, match="activation GELU"):
        experts(torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1))
    assert megamoe.hf.unsupported_reason(experts) is not None
    mislabelled = custom_experts_class(is_concatenated=False)(config)  # the default gate splits by chunk
    with pytest.raises(NotImplementedError, match="is_concatenated=False"):
        mislabelled(torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1))


def test_load_balancing_loss_matches_hf():
    gen = torch.Generator().manual_seed(5)
    logits = tuple(torch.randn(20, 8, generator=gen) for _ in range(3))
    ours = megamoe.load_balancing_loss(logits, topk=2)
    theirs = modeling_qwen3_moe.load_balancing_loss_func(logits, num_experts=8, top_k=2)
    assert torch.allclose(ours, theirs, rtol=1e-6), (ours, theirs)


def bf16_noise_check(name, ours, theirs, reference, floor):
    """`ours` (megamoe, bf16) is as close to the fp32 reference as `theirs` (grouped_mm, bf16), up to 1.5x + floor."""
    err_ours, err_theirs = rel_err(ours, reference), rel_err(theirs, reference)
    assert err_ours <= 1.5 * err_theirs + floor, f"{name}: megamoe {err_ours:.3e}, grouped_mm {err_theirs:.3e}"


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_matches_grouped_mm(device):
    """bf16 logits and gradients of megamoe and grouped_mm, each against an fp32 eager copy of the same weights.

    The one MoE layer sits between dense layers (mlp_only_layers): its input, and so its top-k routing, is then
    bitwise the same under both implementations. A router after it would see inputs differing by bf16 noise, and
    the tokens whose top-k choice flips would dominate the difference of the gradients.
    """
    cfg = tiny_config(num_hidden_layers=3, mlp_only_layers=[0, 2])
    reference = make_model(cfg, torch.float32, device=device, experts="eager")
    model = copy.deepcopy(reference).to(torch.bfloat16)
    model.set_experts_implementation("grouped_mm")
    ids, dlogits = inputs(cfg, 4, 64, device)

    ref_logits, ref_grads = logits_and_grads(reference, ids, dlogits)
    gm_logits, gm_grads = logits_and_grads(model, ids, dlogits)
    model.set_experts_implementation("megamoe")
    mm_logits, mm_grads = logits_and_grads(model, ids, dlogits)

    assert mm_logits.dtype == torch.bfloat16
    assert rel_err(mm_logits, gm_logits) < 2e-2, rel_err(mm_logits, gm_logits)
    bf16_noise_check("logits", mm_logits, gm_logits, ref_logits, 4e-3)
    for name, ref in ref_grads.items():
        assert mm_grads[name].dtype == torch.bfloat16 and torch.isfinite(mm_grads[name].float()).all(), name
        assert rel_err(mm_grads[name], gm_grads[name]) < 4e-2, f"{name}: {rel_err(mm_grads[name], gm_grads[name])}"
        bf16_noise_check(name, mm_grads[name], gm_grads[name], ref, 1e-2)


def load_example():
    """examples/train_qwen3_moe.py as a module (for its synthetic data)."""
    spec = importlib.util.spec_from_file_location("train_qwen3_moe", EXAMPLES / "train_qwen3_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_losses(initial, data, experts, dtype, lr=3e-3):
    """Per-step losses of AdamW training of a copy of `initial` in `dtype` on `data` [steps, batch, seq]."""
    model = copy.deepcopy(initial).to(dtype).train()
    model.set_experts_implementation(experts)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for batch in data:
        batch = batch.to(device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_training_loss_curves_agree(device):
    """50 AdamW steps from the same init on the same data: bf16 megamoe, bf16 grouped_mm and an fp32 eager
    reference. megamoe must drift from the reference no more than grouped_mm does (1.5x + 0.01 on the mean), and
    the two bf16 curves must be no further apart than bf16 is from fp32."""
    steps = 50
    cfg = tiny_config()
    data = load_example().synthetic_batches(cfg.vocab_size, steps, batch=4, seq=64, seed=0)
    initial = make_model(cfg, torch.float32, device=device, experts="eager")
    reference = train_losses(initial, data, "eager", torch.float32)
    grouped = train_losses(initial, data, "grouped_mm", torch.bfloat16)
    ours = train_losses(initial, data, "megamoe", torch.bfloat16)
    print("reference", reference.tolist(), "\ngrouped_mm", grouped.tolist(), "\nmegamoe", ours.tolist())

    assert torch.isfinite(ours).all()
    assert reference[-10:].mean() < reference[0] - 0.3, "the loss should fall (else the comparison says little)"
    drift_ours, drift_grouped = (ours - reference).abs(), (grouped - reference).abs()
    assert drift_ours.mean() <= 1.5 * drift_grouped.mean() + 0.01, (drift_ours.mean(), drift_grouped.mean())
    gap = (ours - grouped).abs().max()
    assert gap <= max(0.1, drift_grouped.max()), (gap, drift_grouped.max())  # no further apart than bf16 from fp32


def test_example_script_smoke(tmp_path):
    log = tmp_path / "megamoe.json"
    cmd = [sys.executable, str(EXAMPLES / "train_qwen3_moe.py"), "--tiny", "--device", "cpu", "--layers", "2"]
    cmd += ["--steps", "3", "--warmup", "1", "--experts-impl", "megamoe", "--log-json", str(log)]
    done = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tokens/s" in done.stdout and "median step" in done.stdout
    record = json.loads(log.read_text())
    assert record["experts_impl"] == "megamoe" and len(record["losses"]) == 3
    assert all(math.isfinite(x) for x in record["losses"]) and record["tokens_per_s"] > 0

    pytest.importorskip("matplotlib")
    png = tmp_path / "losses.png"
    cmd = [sys.executable, str(EXAMPLES / "compare_losses.py"), str(log), str(log), "--out", str(png)]
    done = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and png.stat().st_size > 0, done.stdout + done.stderr


def test_example_micro_batches_accumulate_the_joined_batch():
    """--micro-batches: one step over 2 micro-batches of 2 sequences gives the loss and the update of one step over
    the 4 sequences joined (fp64 weights; the model's loss is computed in f32, hence the tolerances). SGD with lr 1 makes
    the update the gradient itself, so a wrong accumulation (no division by the count, a micro-batch dropped) fails."""
    example = load_example()
    cfg = tiny_config()
    ids = example.synthetic_batches(cfg.vocab_size, 2, batch=2, seq=16, seed=3)  # [2 micro-batches, 2, 16]
    compute_loss = example.loss_function("hf")
    initial = [p.detach().clone() for p in make_model(cfg, torch.float64, experts="eager").parameters()]
    results = []
    for micro_batches in (ids, ids.reshape(1, 4, 16)):
        model = make_model(cfg, torch.float64, experts="eager").train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        loss = example.train_step(model, optimizer, compute_loss, micro_batches, clip=0.0)
        results.append((loss, [p.detach() - start for p, start in zip(model.parameters(), initial)]))
    (loss_micro, update_micro), (loss_joined, update_joined) = results
    assert loss_micro == pytest.approx(loss_joined, rel=1e-6)
    for got, want in zip(update_micro, update_joined):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    assert sum(float(u.abs().sum()) for u in update_joined) > 1e-3, "the step must move the weights"


def test_example_loss_matches_model_loss():
    """The example's --loss compiled function is the model's own loss (next-token cross-entropy, mean over the
    predicted positions) on the same logits: checked eagerly in fp64 (torch.compile only fuses its kernels)."""
    example = load_example()
    cfg = tiny_config()
    model = make_model(cfg, torch.float64, device="cpu", experts="eager")
    ids = example.synthetic_batches(cfg.vocab_size, 1, batch=3, seq=17, seed=1)[0]  # [3, 17]
    out = model(input_ids=ids, labels=ids, use_cache=False)
    ours = example.causal_lm_cross_entropy(out.logits, ids)
    assert torch.allclose(ours, out.loss, rtol=1e-12, atol=1e-12), (ours.item(), out.loss.item())
    assert ours.item() > 0.5 * math.log(cfg.vocab_size)  # random weights: near ln(vocab), a real loss
