#pragma once
/// \file moe/families.hpp
/// The open MoE families (docs/routing.md), one row each: what the library
/// knows of a family is its row, and every reader of families looks it up
/// there — the presets and routing below, the Hugging Face tensor names
/// (io/family_names.hpp, io/name_maps.hpp, the packed loaders, peft's
/// adapter names), the config.json keys (io/hf_config.hpp), the llama.cpp
/// architecture (io/gguf_architectures.hpp and the GGUF savers) and the
/// expert kind of its blocks. A new family is one enumerator and one row.
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
#include "../core/types.hpp"
#include "config.hpp"
#include "family_traits.hpp"
#include "routing_config.hpp"

namespace apex {

/// Every MoEFamily, in the order of the table above.
inline constexpr MoEFamily kAllFamilies[] = {MoEFamily::DeepSeekV3, MoEFamily::Mixtral, MoEFamily::Qwen2MoE,
                                             MoEFamily::Qwen3MoE, MoEFamily::OLMoE};

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

/// The names of transformers' `mlp` blocks (gate_proj, up_proj, down_proj),
/// with the shared experts and bias of `FamilyTensorNames`' fields.
inline FamilyTensorNames mlp_names(const char* shared_block, const char* shared_gate, const char* bias,
                                   const char* file_kind) {
  return {"mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", shared_block, shared_gate, bias, file_kind};
}

/// Qwen2-MoE's and Qwen3-MoE's config.json keys (Qwen2-MoE adds its shared width).
inline FamilyConfigKeys qwen_keys() {
  FamilyConfigKeys k;
  k.d_ffn = "moe_intermediate_size";
  k.n_experts = "num_experts", k.n_experts_alt = "num_local_experts";  // transformers 5 saves the latter
  k.renormalize = "norm_topk_prob", k.renormalize_default = false;
  k.moe_every = "decoder_sparse_step", k.dense_layers = "mlp_only_layers";
  return k;
}

inline FamilyTraits deepseek_v3_row() {
  const RoutingConfig r = deepseek_routing();
  FamilyTraits f{MoEFamily::DeepSeekV3, "deepseek_v3", "DeepSeek-V3", r, family_shapes(r, 7168, 2048, 256, 8, 1, 2048),
                 FamilySharedLayout::OneMLP,
                 mlp_names("mlp.shared_experts.", nullptr, "mlp.gate.e_score_correction_bias", "deepseek_v3"),
                 {}, "deepseek2", kSwiGLUExperts};
  FamilyConfigKeys& k = f.config;
  k.d_ffn = "moe_intermediate_size", k.n_experts = "n_routed_experts";
  k.shared_count = "n_shared_experts";  // held as one MLP of the summed width
  k.groups = true;
  k.renormalize = "norm_topk_prob", k.renormalize_default = true;
  k.fixed[0] = {"scoring_func", "sigmoid", "DeepSeek-V3's router"};
  k.fixed[1] = {"topk_method", "noaux_tc", "bias-based selection"};
  k.first_moe_layer = "first_k_dense_replace";
  k.moe_every = "moe_layer_freq", k.moe_every_from_zero = true;
  f.detection_rank = 2;
  return f;
}
inline FamilyTraits mixtral_row() {
  const RoutingConfig r = softmax_routing(true);  // always renormalised
  FamilyTraits f{MoEFamily::Mixtral, "mixtral", "Mixtral", r, family_shapes(r, 4096, 14336, 8, 2),
                 FamilySharedLayout::None,
                 {"block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", nullptr, nullptr, nullptr, "mixtral"},
                 {}, "llama", kSwiGLUExperts};
  f.config.d_ffn = "intermediate_size", f.config.n_experts = "num_local_experts";
  f.detection_rank = 0;  // its block's own name first
  return f;
}
inline FamilyTraits qwen2_moe_row() {
  const RoutingConfig r = softmax_routing(false);  // norm_topk_prob = false
  FamilyTraits f{MoEFamily::Qwen2MoE, "qwen2_moe", "Qwen2-MoE", r, family_shapes(r, 2048, 1408, 60, 4, 1, 5632, true),
                 FamilySharedLayout::OneGated,
                 mlp_names("mlp.shared_expert.", "mlp.shared_expert_gate.weight", nullptr, "qwen2_moe"), qwen_keys(),
                 "qwen2moe", kSwiGLUExperts};
  f.config.shared_width = "shared_expert_intermediate_size";
  f.detection_rank = 1;
  return f;
}
inline FamilyTraits qwen3_moe_row() {
  const RoutingConfig r = softmax_routing(true);  // norm_topk_prob = true
  return {MoEFamily::Qwen3MoE, "qwen3_moe", "Qwen3-MoE", r, family_shapes(r, 2048, 768, 128, 8),
          FamilySharedLayout::None, mlp_names(nullptr, nullptr, nullptr, "qwen3_moe or olmoe"), qwen_keys(),
          "qwen3moe", kSwiGLUExperts, 3};
}
inline FamilyTraits olmoe_row() {
  const RoutingConfig r = softmax_routing(false);  // norm_topk_prob = false
  FamilyTraits f{MoEFamily::OLMoE, "olmoe", "OLMoE", r, family_shapes(r, 2048, 1024, 64, 8), FamilySharedLayout::None,
                 mlp_names(nullptr, nullptr, nullptr, "qwen3_moe or olmoe"), {}, "olmoe", kSwiGLUExperts};
  f.config.d_ffn = "intermediate_size", f.config.n_experts = "num_experts";
  f.config.renormalize = "norm_topk_prob", f.config.renormalize_default = false;
  f.detection_rank = 4;
  return f;
}

/// The rows, in kAllFamilies order.
inline const FamilyTraits* family_rows() {
  static const FamilyTraits rows[] = {deepseek_v3_row(), mixtral_row(), qwen2_moe_row(), qwen3_moe_row(), olmoe_row()};
  static_assert(std::size(rows) == std::size(kAllFamilies), "one row per MoEFamily");
  return rows;
}

/// The row of `f`, or nullptr if `f` is not one of the enumerators.
inline const FamilyTraits* find_family(MoEFamily f) {
  for (std::size_t i = 0; i < std::size(kAllFamilies); ++i)
    if (f == kAllFamilies[i]) return &family_rows()[i];
  return nullptr;
}

/// "deepseek_v3, mixtral, qwen2_moe, qwen3_moe, olmoe": the model_types, for messages.
inline std::string family_names_list() {
  std::string s;
  for (MoEFamily f : kAllFamilies) s += (s.empty() ? "" : ", ") + std::string(find_family(f)->model_type);
  return s;
}
}  // namespace detail

/// The row of `f`; ConfigError (naming `where`) unless `f` is one of the
/// enumerators: a value cast from an integer must not be read as some family.
inline const FamilyTraits& family_traits(MoEFamily f, const char* where = "family_traits") {
  if (const FamilyTraits* row = detail::find_family(f)) return *row;
  throw ConfigError(std::string(where) + ": family must be one of " + detail::family_names_list() + ", got " +
                    std::to_string(int(f)));
}

namespace detail {
inline void check_family(const char* where, MoEFamily f) { (void)family_traits(f, where); }
}  // namespace detail

/// "deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe" (Hugging Face
/// `model_type`); "?" for a value that is no family (for messages).
inline const char* family_name(MoEFamily f) {
  const FamilyTraits* row = detail::find_family(f);
  return row ? row->model_type : "?";
}

/// Family by its `model_type` name; ConfigError otherwise.
inline MoEFamily family_by_name(const std::string& name) {
  for (MoEFamily f : kAllFamilies)
    if (name == family_name(f)) return f;
  throw ConfigError("family_by_name: unknown MoE family '" + name + "' (" + detail::family_names_list() + ")");
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
