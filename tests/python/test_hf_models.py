"""megamoe.hf on the experts of other Hugging Face models, each a tiny config with random weights (no download): gpt-oss
(interleaved, transposed, biased experts with the clamped SwiGLU, limit 7.0, alpha 1.702) and DeepSeek-V3 (the
default layout, sigmoid-routed with shared experts), megamoe vs HF's eager experts in float64 on the CPU (logits and
every parameter gradient), the experts read in place (the Parameters themselves reach megamoe.moe), torch.compile
(fullgraph=True), and the error when a CUDA path cannot run a layout yet."""

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="5.0", reason="transformers 5.x not installed (pip install 'transformers>=5,<6')"
)

import megamoe  # noqa: E402
import megamoe.hf  # noqa: E402
from conftest import rel_err  # noqa: E402
from test_hf import assert_compiled_forward_matches_eager, inputs, logits_and_grads, make_model  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def gpt_oss_config():
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss model (GptOssConfig)")
    return transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        tie_word_embeddings=False,
    )


def deepseek_v3_config():
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V3 model (DeepseekV3Config)")
    return transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, tie_word_embeddings=False,
    )


def experts_modules(model):
    return [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def randomize_experts(model, seed=7):
    """Expert weights and biases large enough that gpt-oss's clamps (|gate|, |up| > 7) are reached."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for experts in experts_modules(model):
            for name, p in experts.named_parameters():
                scale = 1.5 if name == "gate_up_proj" else 0.3
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale)


MODELS = {"gpt_oss": gpt_oss_config, "deepseek_v3": deepseek_v3_config}


@pytest.mark.parametrize("name", MODELS)
def test_cpu_matches_eager(name, monkeypatch):
    cfg = MODELS[name]()
    model = make_model(cfg, torch.float64, experts="eager")
    randomize_experts(model)
    ids, dlogits = inputs(cfg, 2, 20, "cpu")
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    ref_logits, ref_grads = logits_and_grads(model, ids, dlogits)

    received = []

    def recording_moe(x, topk_ids, topk_weights, w13, w2, **kwargs):
        received.append((w13, w2, kwargs.get("b13"), kwargs.get("b2")))
        return megamoe.moe(x, topk_ids, topk_weights, w13, w2, **kwargs)

    monkeypatch.setattr(megamoe.hf, "moe", recording_moe)
    model.set_experts_implementation("megamoe")
    logits, grads = logits_and_grads(model, ids, dlogits)

    experts = experts_modules(model)
    assert len(received) == len(experts)
    for (w13, w2, b13, b2), module in zip(received, experts):  # the Parameters themselves: nothing copied
        assert w13 is module.gate_up_proj and w2 is module.down_proj
        assert (b13, b2) == ((module.gate_up_proj_bias, module.down_proj_bias) if module.has_bias else (None, None))
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage
    assert rel_err(logits, ref_logits) < 1e-12, rel_err(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and any("experts.gate_up_proj" in n for n in grads)
    for n, grad in grads.items():
        assert rel_err(grad, ref_grads[n]) < 1e-11, f"{n}: {rel_err(grad, ref_grads[n]):.3e}"


def test_gpt_oss_clamp_is_reached():
    """The comparison above means something for the clamped SwiGLU only if some gate / up values pass the limit."""
    cfg = gpt_oss_config()
    model = make_model(cfg, torch.float64, experts="eager")
    randomize_experts(model)
    experts = experts_modules(model)[0]
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]  # [40, 2I]
    assert (gate_up[:, 0::2] > experts.limit).any() and (gate_up[:, 1::2].abs() > experts.limit).any()
    args = megamoe.hf.experts_arguments(experts)
    assert args.layout == megamoe.GPT_OSS and args.activation == megamoe.clamped_swiglu(7.0, 1.702)


def test_gpt_oss_torch_compile_fullgraph():
    cfg = gpt_oss_config()
    model = make_model(cfg, torch.float64, experts="megamoe")
    randomize_experts(model)
    ids, dlogits = inputs(cfg, 2, 12, "cpu")
    assert_compiled_forward_matches_eager(model, ids, dlogits, 1e-12)


def test_unsupported_on_device_names_the_module(monkeypatch):
    """Where megamoe's CUDA path cannot run a layout yet it raises NotImplementedError naming the option; megamoe.hf
    re-raises it naming the experts module and its storage (simulated here on the CPU)."""
    cfg = gpt_oss_config()
    model = make_model(cfg, torch.float32, experts="megamoe")

    def cuda_like(*args, **kwargs):
        raise NotImplementedError("megamoe: layout.gate_up: interleaved gate / up rows are not supported on CUDA yet")

    monkeypatch.setattr(megamoe.hf, "moe", cuda_like)
    ids, _ = inputs(cfg, 1, 4, "cpu")
    with pytest.raises(NotImplementedError, match=r"GptOssExperts stores its experts as layout interleaved, "
                                                  r"transposed; biases; activation clamped_swiglu.*layout.gate_up"):
        model(input_ids=ids)


@CUDA
def test_gpt_oss_on_cuda_matches_eager():
    """On a GPU: megamoe's CUDA path runs gpt-oss's experts (interleaved, transposed, biased, clamped SwiGLU) in place,
    as the CPU eager model does within bf16 noise."""
    cfg = gpt_oss_config()
    model = make_model(cfg, torch.bfloat16, device="cuda", experts="megamoe")
    ids, _ = inputs(cfg, 2, 16, "cuda")
    logits = model(input_ids=ids).logits
    reference = make_model(cfg, torch.float32, device="cpu", experts="eager")
    reference.load_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()})
    assert rel_err(logits.float().cpu(), reference(input_ids=ids.cpu()).logits) < 3e-2
