#pragma once
/// \file moe/families.hpp
/// MoE layer configurations of the open MoE families (docs/routing.md), each
/// with the shapes of one published checkpoint's `config.json`:
///
///     family        published config           scoring       groups  K/E    renorm  scale  shared
///     DeepSeek-V3   deepseek-ai/DeepSeek-V3    sigmoid+bias  8 / 4   8/256  yes     2.5    1 (2048)
///     Mixtral       Mixtral-8x7B-v0.1          softmax all   —       2/8    yes     1      0
///     Qwen2-MoE     Qwen1.5-MoE-A2.7B          softmax all   —       4/60   no      1      1 (5632, gated)
///     Qwen3-MoE     Qwen3-30B-A3B              softmax all   —       8/128  yes     1      0
///     OLMoE         OLMoE-1B-7B-0924           softmax all   —       8/64   no      1      0
///
/// Only DeepSeek-V3 selects on a balancing bias (its `e_score_correction_bias`,
/// the LoadBalancer's bias here); the others' checkpoints have none and the
/// bias stays 0 unless the balancer is updated.

#include <string>

#include "../core/errors.hpp"
#include "config.hpp"
#include "routing_config.hpp"
#include "../core/types.hpp"

namespace apex {

/// The MoE families whose FFN block MoEFFN computes exactly.
enum class MoEFamily { DeepSeekV3, Mixtral, Qwen2MoE, Qwen3MoE, OLMoE };

/// "deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe" (Hugging Face `model_type`).
inline const char* family_name(MoEFamily f) {
  switch (f) {
    case MoEFamily::DeepSeekV3: return "deepseek_v3";
    case MoEFamily::Mixtral: return "mixtral";
    case MoEFamily::Qwen2MoE: return "qwen2_moe";
    case MoEFamily::Qwen3MoE: return "qwen3_moe";
    case MoEFamily::OLMoE: return "olmoe";
  }
  return "?";
}

/// Every MoEFamily.
inline constexpr MoEFamily kAllFamilies[] = {MoEFamily::DeepSeekV3, MoEFamily::Mixtral, MoEFamily::Qwen2MoE,
                                             MoEFamily::Qwen3MoE, MoEFamily::OLMoE};

namespace detail {
/// ConfigError unless `f` is one of the enumerators: a value cast from an
/// integer would otherwise be read as some family by the switches below.
inline void check_family(const char* where, MoEFamily f) {
  for (MoEFamily known : kAllFamilies)
    if (f == known) return;
  require_config(false, where,
                 "family must be one of deepseek_v3, mixtral, qwen2_moe, qwen3_moe, olmoe, got " +
                     std::to_string(int(f)));
}
}  // namespace detail

/// Family by its `model_type` name; ConfigError otherwise.
inline MoEFamily family_by_name(const std::string& name) {
  for (MoEFamily f : kAllFamilies)
    if (name == family_name(f)) return f;
  throw ConfigError("family_by_name: unknown MoE family '" + name +
                    "' (deepseek_v3, mixtral, qwen2_moe, qwen3_moe, olmoe)");
}

/// The routing of a family, for any shapes (used by the presets and by
/// callers that build a family's layer at other sizes).
inline RoutingConfig family_routing(MoEFamily f) {
  detail::check_family("family_routing", f);
  RoutingConfig r;
  switch (f) {
    case MoEFamily::DeepSeekV3:
      // Gate.forward: σ scores, + e_score_correction_bias for selection,
      // 8 groups scored by their top-2 sums, best 4 kept, renormalised, × 2.5.
      r.scoring = Scoring::Sigmoid;
      r.n_groups = 8;
      r.topk_group = 4;
      r.group_score = GroupScore::Top2Sum;
      r.renormalize = true;
      r.routed_scale = 2.5;
      break;
    case MoEFamily::Mixtral:   // softmax over 8, top-2, renormalised
    case MoEFamily::Qwen3MoE:  // norm_topk_prob = true
      r.scoring = Scoring::SoftmaxAll;
      r.renormalize = true;
      break;
    case MoEFamily::Qwen2MoE:  // norm_topk_prob = false
    case MoEFamily::OLMoE:     // norm_topk_prob = false
      r.scoring = Scoring::SoftmaxAll;
      r.renormalize = false;
      break;
  }
  return r;
}

/// One MoE layer of the family's published configuration (table above).
inline MoEConfig family_preset(MoEFamily f) {
  detail::check_family("family_preset", f);
  MoEConfig c;
  c.routing = family_routing(f);
  switch (f) {
    case MoEFamily::DeepSeekV3:  // hidden 7168, moe_intermediate 2048, 256 routed, 8 active, 1 shared
      c.d_model = 7168, c.d_ffn = 2048, c.n_experts = 256, c.n_active = 8, c.n_shared = 1, c.d_shared_ffn = 2048;
      break;
    case MoEFamily::Mixtral:  // hidden 4096, intermediate 14336, 8 local experts, 2 per token
      c.d_model = 4096, c.d_ffn = 14336, c.n_experts = 8, c.n_active = 2;
      break;
    case MoEFamily::Qwen2MoE:  // hidden 2048, moe_intermediate 1408, 60 experts, 4 per token, shared 5632
      c.d_model = 2048, c.d_ffn = 1408, c.n_experts = 60, c.n_active = 4, c.n_shared = 1, c.d_shared_ffn = 5632;
      c.shared_expert_gate = true;
      break;
    case MoEFamily::Qwen3MoE:  // hidden 2048, moe_intermediate 768, 128 experts, 8 per token
      c.d_model = 2048, c.d_ffn = 768, c.n_experts = 128, c.n_active = 8;
      break;
    case MoEFamily::OLMoE:  // hidden 2048, intermediate 1024, 64 experts, 8 per token
      c.d_model = 2048, c.d_ffn = 1024, c.n_experts = 64, c.n_active = 8;
      break;
  }
  return c;
}

inline MoEConfig deepseek_v3_moe() { return family_preset(MoEFamily::DeepSeekV3); }
inline MoEConfig mixtral_8x7b_moe() { return family_preset(MoEFamily::Mixtral); }
inline MoEConfig qwen2_moe_a2_7b_moe() { return family_preset(MoEFamily::Qwen2MoE); }
inline MoEConfig qwen3_moe_30b_a3b_moe() { return family_preset(MoEFamily::Qwen3MoE); }
inline MoEConfig olmoe_1b_7b_moe() { return family_preset(MoEFamily::OLMoE); }

}  // namespace apex
