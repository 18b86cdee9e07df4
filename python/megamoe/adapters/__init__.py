"""Adapters: megamoe behind the experts interfaces of training frameworks, each reading the framework's own weight
storage in place (none of the frameworks is imported; each module mirrors its published layout and call).

    from megamoe.adapters import torchtitan, prime_rl, megatron
    torchtitan.GroupedExperts / RoutedExperts     w1, w3 [E, I, H], w2 [E, H, I]; (x_sorted, counts) or
                                                  (x, topk_scores, topk_expert_ids, counts)
    prime_rl.MegamoeExpertCompute / expert_compute  prime-rl's ExpertCompute on grouped rows (w1/w2/w3, gate_up_proj,
                                                  gate_proj + up_proj, gpt-oss experts with biases)
    megatron.grouped_mlp / te_grouped_mlp         permuted rows, tokens_per_expert, permuted_probs; fp32 main_grad
                                                  accumulation (gradient_accumulation_fusion); TE's per-expert
                                                  weight lists in place (megatron.pack_expert_parameters)

Hugging Face transformers is megamoe.adapters.hf (also megamoe.hf; an experts implementation registered in
transformers' ExpertsInterface on import, so it is not imported here: transformers stays optional).
"""

from . import megatron, prime_rl, torchtitan

__all__ = ["megatron", "prime_rl", "torchtitan"]
