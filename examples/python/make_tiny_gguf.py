"""A small random Qwen3-MoE model written as a llama.cpp GGUF file by gguf-py
(the tensor names and metadata llama.cpp's converter gives qwen3moe), for
the examples: no download.

    from make_tiny_gguf import make_tiny_qwen3_moe_gguf
    path = make_tiny_qwen3_moe_gguf("tiny.gguf", experts_type="Q8_0")
"""
import numpy as np
import torch


def tiny_qwen3_moe(hidden=256, experts=8, ffn=256, layers=2, vocab=512, top_k=2, tied=False, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, vocab_size=vocab, intermediate_size=ffn,
                               moe_intermediate_size=ffn, num_experts=experts, num_experts_per_tok=top_k,
                               norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.05)
    return model.eval()


def make_tiny_qwen3_moe_gguf(path, experts_type="Q8_0", model=None):
    """Writes `model` (default: tiny_qwen3_moe()) to `path`, the routed experts in ggml type `experts_type`
    (quantized by gguf-py), everything else in F32. Returns the model."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    model = model if model is not None else tiny_qwen3_moe()
    c = model.config
    arch = "qwen3moe"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if hasattr(c, "rope_parameters") else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")  # a byte-level vocabulary, so a loader that reads it finds one
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:  # a tied model's file has no output.weight (llama.cpp's converter)
        w.add_tensor("output.weight", sd["lm_head.weight"])
    f = c.moe_intermediate_size
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        for src, dst in (("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
                         ("self_attn.q_proj.weight", "attn_q.weight"), ("self_attn.k_proj.weight", "attn_k.weight"),
                         ("self_attn.v_proj.weight", "attn_v.weight"), ("self_attn.o_proj.weight", "attn_output.weight"),
                         ("self_attn.q_norm.weight", "attn_q_norm.weight"), ("self_attn.k_norm.weight", "attn_k_norm.weight"),
                         ("mlp.gate.weight", "ffn_gate_inp.weight")):
            w.add_tensor(b + dst, sd[p + src])
        gu, dn = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
        for dst, t in (("ffn_gate_exps.weight", gu[:, :f]), ("ffn_up_exps.weight", gu[:, f:]), ("ffn_down_exps.weight", dn)):
            t = np.ascontiguousarray(t)
            if experts_type == "F32":
                w.add_tensor(b + dst, t)
            else:
                q = quantize(t.reshape(-1, t.shape[-1]), Q[experts_type])
                w.add_tensor(b + dst, q.reshape(t.shape[0], t.shape[1], -1), raw_dtype=Q[experts_type])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
