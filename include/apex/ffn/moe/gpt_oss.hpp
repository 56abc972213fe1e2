#pragma once
/// \file moe/gpt_oss.hpp
/// The gpt-oss family's MoE block (docs/routing.md#gpt-oss): MoEFFN over
/// clamped-SwiGLU experts with biases (layers/clamped_swiglu.hpp) and a router
/// with a trained logit bias:
///
///     ℓ = X·W_routerᵀ + b_r                    (N × E)
///     (e_1..e_K) = top-K(ℓ),  g = softmax(ℓ_{e_1..e_K})
///     MoE(X) = Σ_k g_k · ClampedSwiGLU_{e_k}(X),   no shared experts
///
/// That routing is the library's default router (softmax over the K selected
/// logits) with `router_bias` on; the balancer's bias stays 0 unless it is
/// updated (gpt-oss checkpoints have none). Nothing here is a branch of the
/// MoE pipeline: the family is a configuration and an expert type.
///
///     published config       d      f      E    K   α      L
///     openai/gpt-oss-20b     2880   2880   32   4   1.702  7
///     openai/gpt-oss-120b    2880   2880   128  4   1.702  7

#include "../layers/clamped_swiglu.hpp"
#include "config.hpp"
#include "moe_ffn.hpp"

namespace apex {

/// gpt-oss's routed expert.
template <class T>
using GptOssExpert = ClampedSwiGLU<T>;

/// A gpt-oss MoE block.
template <class T>
using GptOssMoE = MoEFFN<T, GptOssExpert<T>>;

/// A gpt-oss MoE layer of any shape: the default routing, the router's bias, no shared experts.
inline MoEConfig gpt_oss_moe(Index d_model, Index d_ffn, Index n_experts, Index n_active) {
  MoEConfig c;
  c.d_model = d_model, c.d_ffn = d_ffn, c.n_experts = n_experts, c.n_active = n_active;
  c.router_bias = true;
  return c;
}

/// One MoE layer of openai/gpt-oss-20b's config.json.
inline MoEConfig gpt_oss_20b_moe() { return gpt_oss_moe(2880, 2880, 32, 4); }
/// One MoE layer of openai/gpt-oss-120b's config.json.
inline MoEConfig gpt_oss_120b_moe() { return gpt_oss_moe(2880, 2880, 128, 4); }

}  // namespace apex
