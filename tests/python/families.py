"""Tiny random models of the MoE families transformers runs through its
experts interface, for the Python tests (no download: built from configs)."""
import torch

BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            vocab_size=64, intermediate_size=48, max_position_embeddings=64)

FAMILIES = {
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                      shared_expert_intermediate_size=24),
    "olmoe": dict(intermediate_size=16, num_experts=6, num_experts_per_tok=3),
    "mixtral": dict(intermediate_size=16, num_local_experts=6, num_experts_per_tok=2),
    "deepseek_v3": dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
                        n_group=4, topk_group=2, first_k_dense_replace=0, routed_scaling_factor=2.5,
                        norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, head_dim=8),
    "gpt_oss": dict(intermediate_size=16, num_local_experts=6, num_experts_per_tok=2,
                    layer_types=["full_attention"] * 2),
}


def tiny_model(family, seed=0, dtype=torch.float32, experts_implementation="eager"):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, **{**BASE, **FAMILIES[family]})
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation=experts_implementation, dtype=dtype)
    with torch.no_grad():  # random expert weights (some families initialise them to zero or constants)
        for name, p in model.named_parameters():
            if "experts" in name or "router" in name or name.endswith("gate.weight"):
                p.normal_(0.0, 0.2)
    return model.eval()


def experts_modules(model):
    return [(n, m) for n, m in model.named_modules() if n.endswith("mlp.experts")]
