#pragma once
/// \file io/gguf_architectures.hpp
/// The llama.cpp architectures whose MoE layers the library reads from and
/// writes to GGUF files (docs/model_files.md#moe-layers-from-gguf-files): one
/// row per architecture, so supporting another is one more row. A family's
/// row (moe/families.hpp) names its architecture; an architecture names the
/// expert kind of its blocks (`experts`, the kind's ExpertKind<E>::kName).
///
///     general.architecture  family       width key                   shared                    routing
///     qwen3moe              Qwen3-MoE    expert_feed_forward_length  —                         softmax, renorm
///     qwen2moe              Qwen2-MoE    expert_feed_forward_length  one, σ-gated              softmax, no renorm
///     olmoe                 OLMoE        feed_forward_length         —                         softmax, no renorm
///     llama (with experts)  Mixtral      feed_forward_length (array) —                         softmax, renorm
///     deepseek2             DeepSeek-V3  expert_feed_forward_length  count × width, ungated    read from the keys
///     gpt-oss               gpt-oss      expert_feed_forward_length  —                         top-K of ℓ + b_r, softmax over the K
///
/// gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE) is the one row whose experts are
/// not plain SwiGLU: they are clamped SwiGLU with gate, up and down biases
/// (`expert_kind`: `ffn_{gate,up,down}_exps.bias`; layers/clamped_swiglu.hpp), its router has
/// a bias (`ffn_gate_inp.bias`, `router_bias`), and the FFN's RMSNorm is
/// `post_attention_norm` (`norm_tensor`). llama.cpp fixes α = 1.702 and
/// L = 7 in its graph (LLM_FFN_SWIGLU_OAI_MOE): gpt-oss files carry no key
/// for them (`<arch>.swiglu_clamp_exp` is other architectures'), so the row
/// holds them (`clamp_alpha`, `clamp_limit`).
///
/// The fixed choices are those of llama.cpp's graph for the architecture
/// (llama-model.cpp: build_moe_ffn's norm_w, scale_w and gating_op per
/// architecture); deepseek2 reads them from `expert_weights_norm`,
/// `expert_weights_scale`, `expert_gating_func` (1 softmax, 2 sigmoid; absent:
/// softmax, llama.cpp's rule for DeepSeek-V2 files) and the group keys, whose
/// groups llama.cpp scores by their top-2 sum (GroupScore::Top2Sum).
/// Keys are `<arch>.` + the key named here; tensors `blk.N.` + the names below.

#include <cstddef>
#include <iterator>
#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "../moe/families.hpp"

namespace apex::gguf {

/// llama.cpp's tensor names of one MoE block (gguf-py constants.py
/// MODEL_TENSOR, llama-arch.cpp LLM_TENSOR_NAMES), under `blk.N.`.
namespace tensor_names {
inline constexpr const char* kRouter = "ffn_gate_inp.weight";             ///< ne [d, E]
inline constexpr const char* kGateExps = "ffn_gate_exps.weight";          ///< ne [d, f, E]
inline constexpr const char* kUpExps = "ffn_up_exps.weight";              ///< ne [d, f, E]
inline constexpr const char* kDownExps = "ffn_down_exps.weight";          ///< ne [f, d, E]
inline constexpr const char* kGateShexp = "ffn_gate_shexp.weight";        ///< ne [d, f_s]
inline constexpr const char* kUpShexp = "ffn_up_shexp.weight";            ///< ne [d, f_s]
inline constexpr const char* kDownShexp = "ffn_down_shexp.weight";        ///< ne [f_s, d]
inline constexpr const char* kSharedGate = "ffn_gate_inp_shexp.weight";   ///< ne [d] (qwen2moe)
inline constexpr const char* kProbsBias = "exp_probs_b.bias";             ///< ne [E] (deepseek2)
inline constexpr const char* kNorm = "ffn_norm.weight";                   ///< ne [d]
inline constexpr const char* kPostAttnNorm = "post_attention_norm.weight";  ///< ne [d] (gpt-oss's FFN norm)
inline constexpr const char* kRouterBias = "ffn_gate_inp.bias";           ///< ne [E] (gpt-oss)
inline constexpr const char* kGateExpsBias = "ffn_gate_exps.bias";        ///< ne [f, E] (gpt-oss)
inline constexpr const char* kUpExpsBias = "ffn_up_exps.bias";            ///< ne [f, E]
inline constexpr const char* kDownExpsBias = "ffn_down_exps.bias";        ///< ne [d, E]
/// The dense FFN of a deepseek2 leading block (refused by the MoE loaders).
inline constexpr const char* kDenseGate = "ffn_gate.weight";
}  // namespace tensor_names

/// `blk.<layer>.<name>`.
inline std::string block_tensor(Index layer, const char* name) {
  return "blk." + std::to_string(layer) + "." + name;
}

/// llama.cpp's metadata keys of an MoE layer (gguf-py constants.py Keys.LLM),
/// without the `<arch>.` prefix.
namespace keys {
inline constexpr const char* kArchitecture = "general.architecture";  ///< the only key without the prefix
inline constexpr const char* kBlockCount = "block_count";
inline constexpr const char* kEmbedding = "embedding_length";
inline constexpr const char* kFeedForward = "feed_forward_length";
inline constexpr const char* kExpertFeedForward = "expert_feed_forward_length";
inline constexpr const char* kSharedFeedForward = "expert_shared_feed_forward_length";
inline constexpr const char* kExpertCount = "expert_count";
inline constexpr const char* kExpertUsed = "expert_used_count";
inline constexpr const char* kSharedCount = "expert_shared_count";
inline constexpr const char* kWeightsScale = "expert_weights_scale";
inline constexpr const char* kWeightsNorm = "expert_weights_norm";
inline constexpr const char* kGatingFunc = "expert_gating_func";
inline constexpr const char* kGroupCount = "expert_group_count";
inline constexpr const char* kGroupUsed = "expert_group_used_count";
inline constexpr const char* kLeadingDense = "leading_dense_block_count";
inline constexpr const char* kRmsEps = "attention.layer_norm_rms_epsilon";
}  // namespace keys

/// llama.cpp's `expert_gating_func` values (llama-hparams.h).
enum class GatingFunc : unsigned { none = 0, softmax = 1, sigmoid = 2, softmax_weight = 3 };

/// gpt-oss's experts (LLM_FFN_SWIGLU_OAI_MOE): ExpertKind<ClampedSwiGLU<T>>.
inline constexpr ExpertKindName kClampedSwiGLUExperts{
    "clamped_swiglu", "clamped-SwiGLU (with biases)",
    "a ClampedSwiGLU layer (GptOssMoE / PackedMoE<S, ClampedSwiGLU<float>>)"};

/// How one architecture's MoE block is laid out and routed. The fields
/// after `probs_bias` have the plain SwiGLU blocks' values by default.
struct Architecture {
  const char* name;    ///< `general.architecture`
  const char* width_key;  ///< the routed experts' width f
  bool width_per_layer;   ///< the width key may be an array over blocks (llama's feed_forward_length)
  FamilySharedLayout shared;  ///< None; OneGated (qwen2moe); OneMLP: count × f wide (deepseek2)
  bool renormalize;  ///< llama.cpp's norm_w, where the architecture fixes it
  bool reads_routing_keys;  ///< deepseek2: norm, scale, gating func, groups from the metadata
  bool leading_dense;       ///< blocks below `leading_dense_block_count` are dense
  bool probs_bias;          ///< `exp_probs_b.bias` may be present (optional)
  Scoring scoring = Scoring::SoftmaxAll;  ///< the fixed scoring (deepseek2 reads its own)
  /// What its routed experts compute: the loaders' and savers' expert kind
  /// must be this one (the kind's GGUF form reads and writes its float parts).
  ExpertKindName experts = kSwiGLUExperts;
  bool router_bias = false;    ///< `ffn_gate_inp.bias` (required): the router's logit bias
  const char* norm_tensor = tensor_names::kNorm;  ///< the FFN's RMSNorm gain
  double clamp_alpha = 1.702;  ///< clamped SwiGLU's α (llama.cpp's constant)
  double clamp_limit = 7.0;    ///< and L

  std::string key(const char* k) const { return std::string(name) + "." + k; }
};

namespace detail {
inline const Architecture* architecture_rows(std::size_t& n) {
  using L = FamilySharedLayout;
  static const Architecture rows[] = {
      {"qwen3moe", keys::kExpertFeedForward, false, L::None, true, false, false, false},
      {"qwen2moe", keys::kExpertFeedForward, false, L::OneGated, false, false, false, false},
      {"olmoe", keys::kFeedForward, false, L::None, false, false, false, false},
      {"llama", keys::kFeedForward, true, L::None, true, false, false, false},
      {"deepseek2", keys::kExpertFeedForward, false, L::OneMLP, false, true, true, true},
      // llama.cpp's gating SOFTMAX_WEIGHT: top-K of ℓ + b_r, softmax over the K (no renormalisation)
      {"gpt-oss", keys::kExpertFeedForward, false, L::None, false, false, false, false, Scoring::SoftmaxSelected,
       kClampedSwiGLUExperts, true, tensor_names::kPostAttnNorm},
  };
  n = std::size(rows);
  return rows;
}
}  // namespace detail

/// Every supported architecture's name, ", "-separated (for errors).
inline std::string architecture_names() {
  std::size_t n = 0;
  const Architecture* rows = detail::architecture_rows(n);
  std::string s;
  for (std::size_t i = 0; i < n; ++i) s += std::string(i ? ", " : "") + rows[i].name;
  return s;
}

/// The row named `name`, or nullptr.
inline const Architecture* find_architecture(const std::string& name) {
  std::size_t n = 0;
  const Architecture* rows = detail::architecture_rows(n);
  for (std::size_t i = 0; i < n; ++i)
    if (name == rows[i].name) return &rows[i];
  return nullptr;
}

/// The row named `name`; ConfigError naming it and the supported ones otherwise.
inline const Architecture& architecture(const std::string& name, const std::string& where = "gguf::architecture") {
  if (const Architecture* a = find_architecture(name)) return *a;
  throw ConfigError(where + ": architecture '" + name + "' has no MoE layer the library reads (supported: " +
                    architecture_names() + ")");
}

/// The architecture of `family`'s row (moe/families.hpp); ConfigError for a
/// value that is no family, or a row naming no architecture of this table.
inline const Architecture& architecture_of(MoEFamily family, const std::string& where = "gguf::architecture_of") {
  return architecture(family_traits(family, where.c_str()).gguf_architecture, where);
}

/// The rows whose experts are of kind `kind` (ExpertKind<E>::kName), in
/// table order; ConfigError naming it if none.
inline std::vector<const Architecture*> architectures_of_kind(const ExpertKindName& kind,
                                                              const std::string& where = "gguf::architectures_of_kind") {
  std::size_t n = 0;
  const Architecture* rows = detail::architecture_rows(n);
  std::vector<const Architecture*> out;
  for (std::size_t i = 0; i < n; ++i)
    if (std::string(rows[i].experts.name) == kind.name) out.push_back(&rows[i]);
  if (out.empty()) throw ConfigError(where + ": no architecture has " + kind.label + " experts");
  return out;
}

/// How the rows call the experts of kind `name` (ExpertKind<E>::kName): the
/// first row's of that kind, else `name` labelled `label`.
inline ExpertKindName experts_named(const char* name, const char* label) {
  std::size_t n = 0;
  const Architecture* rows = detail::architecture_rows(n);
  for (std::size_t i = 0; i < n; ++i)
    if (std::string(rows[i].experts.name) == name) return rows[i].experts;
  return {name, label, label};
}

}  // namespace apex::gguf
