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

#include <cstddef>
#include <iterator>
#include <string>

#include "../core/errors.hpp"
#include "config.hpp"
#include "routing_config.hpp"
#include "../core/types.hpp"

namespace apex {

/// The MoE families whose FFN block MoEFFN computes exactly.
enum class MoEFamily { DeepSeekV3, Mixtral, Qwen2MoE, Qwen3MoE, OLMoE };

/// Every MoEFamily, in the order of the table below.
inline constexpr MoEFamily kAllFamilies[] = {MoEFamily::DeepSeekV3, MoEFamily::Mixtral, MoEFamily::Qwen2MoE,
                                             MoEFamily::Qwen3MoE, MoEFamily::OLMoE};

/// How a family's Hugging Face checkpoints name the tensors of one MoE block,
/// relative to the layer's prefix (e.g. "model.layers.3."). nullptr: the
/// family's block has no such tensor.
struct FamilyTensorNames {
  const char* block;         ///< "mlp." or "block_sparse_moe."; router `<block>gate.weight`, experts `<block>experts.e.`
  const char* gate_proj;     ///< the expert's gate projection, e.g. "gate_proj.weight" (Mixtral "w1.weight")
  const char* up_proj;       ///< up projection ("up_proj.weight", Mixtral "w3.weight")
  const char* down_proj;     ///< down projection ("down_proj.weight", Mixtral "w2.weight")
  const char* shared_block;  ///< the one shared MLP, e.g. "mlp.shared_experts."
  const char* shared_gate;   ///< the shared experts' sigmoid gate weight
  const char* bias;          ///< the selection bias, shape [E] (DeepSeek-V3's e_score_correction_bias)
  const char* file_kind;     ///< what detect_family reports for such a file (Qwen3-MoE and OLMoE share names)
};

/// Which shared experts a family's block holds.
enum class FamilySharedLayout {
  None,       ///< no shared experts
  OneMLP,     ///< at most one shared MLP of width d_shared_ffn, ungated (DeepSeek-V3)
  OneGated,   ///< exactly one shared expert behind a sigmoid gate (Qwen2-MoE)
};

/// One family: its name, routing, published layer shapes and tensor names.
/// Everything the library knows of a family is one row of family_table().
struct FamilyTraits {
  MoEFamily family;
  const char* model_type;  ///< Hugging Face `model_type`
  RoutingConfig routing;   ///< for any shapes
  MoEConfig preset;        ///< one MoE layer of the published configuration (table in this file's header)
  FamilySharedLayout shared_layout;
  FamilyTensorNames names;
};

namespace detail {
inline RoutingConfig softmax_routing(bool renormalize) {
  RoutingConfig r;
  r.scoring = Scoring::SoftmaxAll;
  r.renormalize = renormalize;
  return r;
}

/// DeepSeek-V3's Gate.forward: σ scores, + e_score_correction_bias for
/// selection, 8 groups scored by their top-2 sums, best 4 kept,
/// renormalised, × 2.5.
inline RoutingConfig deepseek_routing() {
  RoutingConfig r;
  r.scoring = Scoring::Sigmoid;
  r.n_groups = 8;
  r.topk_group = 4;
  r.group_score = GroupScore::Top2Sum;
  r.renormalize = true;
  r.routed_scale = 2.5;
  return r;
}

/// A published layer: d, f, E, K, S, the shared width and gate.
inline MoEConfig family_shapes(const RoutingConfig& routing, Index d_model, Index d_ffn, Index n_experts,
                               Index n_active, Index n_shared = 0, Index d_shared_ffn = 0, bool gate = false) {
  MoEConfig c;
  c.routing = routing;
  c.d_model = d_model, c.d_ffn = d_ffn, c.n_experts = n_experts, c.n_active = n_active;
  c.n_shared = n_shared, c.d_shared_ffn = d_shared_ffn, c.shared_expert_gate = gate;
  return c;
}

inline const FamilyTraits* family_rows() {
  constexpr FamilyTensorNames mlp_names{"mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                                        nullptr, nullptr, nullptr, "qwen3_moe or olmoe"};
  auto names_with = [&](const char* shared_block, const char* shared_gate, const char* bias, const char* kind) {
    FamilyTensorNames n = mlp_names;
    n.shared_block = shared_block, n.shared_gate = shared_gate, n.bias = bias, n.file_kind = kind;
    return n;
  };
  using L = FamilySharedLayout;
  const RoutingConfig renorm = softmax_routing(true), plain = softmax_routing(false), ds = deepseek_routing();
  // Mixtral and Qwen3-MoE: norm_topk_prob = true; Qwen2-MoE and OLMoE: false.
  static const FamilyTraits rows[] = {
      {MoEFamily::DeepSeekV3, "deepseek_v3", ds, family_shapes(ds, 7168, 2048, 256, 8, 1, 2048), L::OneMLP,
       names_with("mlp.shared_experts.", nullptr, "mlp.gate.e_score_correction_bias", "deepseek_v3")},
      {MoEFamily::Mixtral, "mixtral", renorm, family_shapes(renorm, 4096, 14336, 8, 2), L::None,
       {"block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", nullptr, nullptr, nullptr, "mixtral"}},
      {MoEFamily::Qwen2MoE, "qwen2_moe", plain, family_shapes(plain, 2048, 1408, 60, 4, 1, 5632, true), L::OneGated,
       names_with("mlp.shared_expert.", "mlp.shared_expert_gate.weight", nullptr, "qwen2_moe")},
      {MoEFamily::Qwen3MoE, "qwen3_moe", renorm, family_shapes(renorm, 2048, 768, 128, 8), L::None, mlp_names},
      {MoEFamily::OLMoE, "olmoe", plain, family_shapes(plain, 2048, 1024, 64, 8), L::None, mlp_names},
  };
  return rows;
}
}  // namespace detail

/// The row of `f`; ConfigError (naming `where`) unless `f` is one of the
/// enumerators: a value cast from an integer must not be read as some family.
inline const FamilyTraits& family_traits(MoEFamily f, const char* where = "family_traits") {
  for (std::size_t i = 0; i < std::size(kAllFamilies); ++i)
    if (f == kAllFamilies[i]) return detail::family_rows()[i];
  throw ConfigError(std::string(where) + ": family must be one of deepseek_v3, mixtral, qwen2_moe, qwen3_moe, olmoe, got " +
                    std::to_string(int(f)));
}

namespace detail {
inline void check_family(const char* where, MoEFamily f) { (void)family_traits(f, where); }
}  // namespace detail

/// "deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe" (Hugging Face `model_type`).
inline const char* family_name(MoEFamily f) {
  for (std::size_t i = 0; i < std::size(kAllFamilies); ++i)
    if (f == kAllFamilies[i]) return detail::family_rows()[i].model_type;
  return "?";
}

/// Family by its `model_type` name; ConfigError otherwise.
inline MoEFamily family_by_name(const std::string& name) {
  for (MoEFamily f : kAllFamilies)
    if (name == family_name(f)) return f;
  throw ConfigError("family_by_name: unknown MoE family '" + name +
                    "' (deepseek_v3, mixtral, qwen2_moe, qwen3_moe, olmoe)");
}

/// The routing of a family, for any shapes (used by the presets and by
/// callers that build a family's layer at other sizes).
inline RoutingConfig family_routing(MoEFamily f) { return family_traits(f, "family_routing").routing; }

/// One MoE layer of the family's published configuration (table above).
inline MoEConfig family_preset(MoEFamily f) { return family_traits(f, "family_preset").preset; }

inline MoEConfig deepseek_v3_moe() { return family_preset(MoEFamily::DeepSeekV3); }
inline MoEConfig mixtral_8x7b_moe() { return family_preset(MoEFamily::Mixtral); }
inline MoEConfig qwen2_moe_a2_7b_moe() { return family_preset(MoEFamily::Qwen2MoE); }
inline MoEConfig qwen3_moe_30b_a3b_moe() { return family_preset(MoEFamily::Qwen3MoE); }
inline MoEConfig olmoe_1b_7b_moe() { return family_preset(MoEFamily::OLMoE); }

}  // namespace apex
