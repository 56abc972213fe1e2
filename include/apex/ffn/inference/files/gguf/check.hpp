#pragma once
/// \file inference/files/gguf/check.hpp
/// plan(): every check of a GGUF MoE load, reading metadata and tensor infos
/// only (no weight byte), in the order they are reported:
///
///  1. `general.architecture` is a row of io/gguf_architectures.hpp, whose
///     experts are of the kind asked for (ConfigError naming both);
///  2. the block exists (`block_count`) and is an MoE block (deepseek2's
///     `leading_dense_block_count`): ConfigError naming it;
///  3. the layer's keys are present (FormatError naming a missing one) and of
///     an integer, float or bool type (FormatError from the reader), and form
///     a valid MoEConfig (ConfigError: MoEConfig::validate);
///  4. `expert_gating_func` is one the library computes (ConfigError);
///  5. every tensor is present (FormatError listing the missing: gpt-oss's
///     router and expert biases too), of a type
///     with storage (FormatError naming the type), of the ggml shape the
///     metadata implies (ShapeError naming both shapes);
///  6. gate and up share a type (ConfigError), and the layer fits in memory.

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "../../../io/gguf_architectures.hpp"
#include "../../../moe/config.hpp"
#include "../../engine/expert_kind.hpp"
#include "../../engine/expert_kinds.hpp"
#include "../../engine/packed_moe.hpp"
#include "plan.hpp"

namespace apex::detail::gguf_moe {

/// `v` of key `k` as an Index; ConfigError past 2^40, which no layer has
/// (and which would overflow the byte counts).
inline Index checked_count(const std::string& where, const std::string& k, std::uint64_t v) {
  if (v > std::uint64_t(1) << 40)
    throw ConfigError(where + ": metadata key '" + k + "' = " + std::to_string(v) + " is too large for a layer");
  return Index(v);
}

/// An unsigned count from key `k` of the architecture; `fallback` if absent
/// and not `required` (FormatError naming the key if required).
inline Index count_key(const std::string& where, const gguf::File& file, const std::string& k, bool required,
                       Index fallback = 0) {
  if (!file.find(k)) {
    if (required) throw FormatError(where + ": the file has no metadata key '" + k + "'");
    return fallback;
  }
  return checked_count(where, k, file.get<std::uint64_t>(k));
}

/// The routed experts' width: the architecture's width key, a per-block
/// array for llama's feed_forward_length.
inline Index width_key(const std::string& where, const gguf::File& file, const gguf::Architecture& a, Index layer) {
  const std::string k = a.key(a.width_key);
  const gguf::Value* value = file.find(k);
  if (a.width_per_layer && value && value->type() == gguf::ValueType::array) {
    const std::vector<std::uint64_t> v = value->as_vector<std::uint64_t>();
    if (Index(v.size()) <= layer)
      throw FormatError(where + ": metadata key '" + k + "' has " + std::to_string(v.size()) +
                        " entries, block " + std::to_string(layer) + " has none");
    return checked_count(where, k, v[std::size_t(layer)]);
  }
  return count_key(where, file, k, true);
}

/// The routing of a deepseek2 block from its keys (gating func, norm, scale, groups).
inline void deepseek_routing(const std::string& where, const gguf::File& file, const gguf::Architecture& a,
                             MoEConfig& c) {
  RoutingConfig& r = c.routing;
  const Index gating = count_key(where, file, a.key(gguf::keys::kGatingFunc), false, 0);
  switch (gguf::GatingFunc(gating)) {
    case gguf::GatingFunc::none:  // llama.cpp's rule for DeepSeek-V2 files without the key
    case gguf::GatingFunc::softmax: r.scoring = Scoring::SoftmaxAll; break;
    case gguf::GatingFunc::sigmoid: r.scoring = Scoring::Sigmoid; break;
    case gguf::GatingFunc::softmax_weight:  // logits select, softmax over the K selected raw logits
      r.scoring = Scoring::SoftmaxSelected;
      c.weights_from_unbiased = true;
      break;
    default:
      throw ConfigError(where + ": metadata key '" + a.key(gguf::keys::kGatingFunc) + "' = " +
                        std::to_string(gating) + " is no gating function the library computes (1 softmax, 2 sigmoid, "
                        "3 softmax over the selected)");
  }
  r.renormalize = file.find(a.key(gguf::keys::kWeightsNorm)) ? file.get<bool>(a.key(gguf::keys::kWeightsNorm)) : false;
  const std::string scale = a.key(gguf::keys::kWeightsScale);
  if (!file.find(scale)) throw FormatError(where + ": the file has no metadata key '" + scale + "'");
  r.routed_scale = file.get<double>(scale);
  const Index groups = count_key(where, file, a.key(gguf::keys::kGroupCount), false, 0);
  r.n_groups = groups > 1 ? groups : 1;
  r.topk_group = r.n_groups > 1 ? count_key(where, file, a.key(gguf::keys::kGroupUsed), true) : 1;
  r.group_score = GroupScore::Top2Sum;  // llama.cpp: the sum of each group's two best biased scores
}

/// The MoEConfig of block `layer` (steps 1–4 of the file comment).
inline void plan_config(const std::string& where, const gguf::File& file, Index layer, Plan& p) {
  const gguf::Architecture& a = gguf::architecture(file.architecture(), where);
  p.arch = &a;
  p.layer = layer;
  const Index blocks = count_key(where, file, a.key(gguf::keys::kBlockCount), false, -1);
  if (layer < 0 || (blocks >= 0 && layer >= blocks))
    throw ConfigError(where + ": block " + std::to_string(layer) + " does not exist (" + a.key(gguf::keys::kBlockCount) +
                      " = " + std::to_string(blocks) + ")");
  if (a.leading_dense) {
    const Index dense = count_key(where, file, a.key(gguf::keys::kLeadingDense), false, 0);
    if (layer < dense)
      throw ConfigError(where + ": block " + std::to_string(layer) + " is a dense FFN block (" +
                        a.key(gguf::keys::kLeadingDense) + " = " + std::to_string(dense) +
                        "): ask for an MoE block (" + std::to_string(dense) + " or later)");
  }
  MoEConfig& c = p.config;
  c.d_model = count_key(where, file, a.key(gguf::keys::kEmbedding), true);
  c.n_experts = count_key(where, file, a.key(gguf::keys::kExpertCount), true);
  if (c.n_experts == 0)
    throw ConfigError(where + ": " + a.key(gguf::keys::kExpertCount) + " = 0: a dense model has no MoE layer");
  c.n_active = count_key(where, file, a.key(gguf::keys::kExpertUsed), true);
  c.d_ffn = width_key(where, file, a, layer);
  c.routing.scoring = a.scoring;
  c.routing.renormalize = a.renormalize;
  c.router_bias = a.router_bias;
  if (a.reads_routing_keys) deepseek_routing(where, file, a, c);
  if (a.shared == FamilySharedLayout::OneGated) {
    c.n_shared = 1;
    c.shared_expert_gate = true;
    const std::string k = a.key(gguf::keys::kSharedFeedForward);  // llama.cpp falls back to feed_forward_length
    c.d_shared_ffn = file.find(k) ? count_key(where, file, k, true) : count_key(where, file, a.key(gguf::keys::kFeedForward), true);
  } else if (a.shared == FamilySharedLayout::OneMLP) {
    const Index count = count_key(where, file, a.key(gguf::keys::kSharedCount), false, 0);
    c.n_shared = count > 0 ? 1 : 0;  // llama.cpp fuses them into one MLP count × f wide
    c.d_shared_ffn = checked_product(where.c_str(), "shared width", {count, c.d_ffn});
  }
  c.validate_for<float>(where.c_str());
  const std::string eps = a.key(gguf::keys::kRmsEps);
  p.rms_eps = file.find(eps) ? file.get<double>(eps) : 0.0;
}

/// "[2048, 768, 128]": ggml ne order.
inline std::string ne_string(const std::vector<std::uint64_t>& ne) {
  std::string s = "[";
  for (std::size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

/// "'a', 'b'": names for messages.
inline std::string names(const std::vector<std::string>& list) {
  std::string s;
  for (std::size_t i = 0; i < list.size(); ++i) s += (i ? ", '" : "'") + list[i] + "'";
  return s;
}

/// Looks up one tensor (step 5), recording what is wrong in the lists.
struct TensorChecks {
  const gguf::File& file;
  Index layer;
  std::vector<std::string> missing, bad_type, bad_shape;

  Tensor want(const char* base, std::vector<std::uint64_t> ne, bool required = true) {
    const std::string name = gguf::block_tensor(layer, base);
    Tensor t;
    t.info = file.find_tensor(name);
    if (!t.info) {
      if (required) missing.push_back(name);
      return t;
    }
    if (const std::optional<packed::Dtype> dtype = packed_type_of(t.info->type)) t.dtype = *dtype;
    else bad_type.push_back(name + " (" + type_label(t.info->type) + ")");
    std::vector<std::uint64_t> have(t.info->ne.begin(), t.info->ne.end());
    while (have.size() > ne.size() && have.back() == 1) have.pop_back();  // ggml pads ne with 1
    if (have != ne) bad_shape.push_back(name + " is " + ne_string(have) + ", the metadata implies " + ne_string(ne));
    return t;
  }
  void report(const std::string& where) const {
    if (!missing.empty()) throw FormatError(where + ": the file has no tensor " + names(missing));
    if (!bad_type.empty())
      throw FormatError(where + ": no storage for the tensor type of " + names(bad_type) +
                        " (supported: " + packed_type_names() + ")");
    if (!bad_shape.empty()) {
      std::string msg = where + ": shape mismatch (ggml ne order):";
      for (std::size_t i = 0; i < bad_shape.size(); ++i) msg += (i ? "; " : " ") + bad_shape[i];
      throw ShapeError(msg);
    }
  }
};

/// The experts' types of a gate/up/down triple; ConfigError if gate and up differ.
inline packed::ExpertDtypes expert_types(const std::string& where, const Tensor& g, const Tensor& u, const Tensor& d) {
  if (g.dtype != u.dtype || g.info->type != u.info->type)
    throw ConfigError(where + ": " + g.info->name + " is " + type_label(g.info->type) + " but " + u.info->name + " is " +
                      type_label(u.info->type) + ": gate and up share one packed panel and need one type");
  return {g.dtype, d.dtype};
}

/// ConfigError unless the file's architecture `a` has experts of `Expert`'s
/// kind, naming the architecture, its experts and the kind asked for.
template <class Expert>
void check_expert_kind(const std::string& where, const gguf::Architecture& a) {
  using Kind = ExpertKind<Expert>;
  static_assert(inference::kind_has_gguf<Kind>,
                "GGUF MoE blocks: this expert kind has no llama.cpp form (its ExpertKind row's Gguf is NoGgufForm)");
  if (std::string(a.experts.name) != Kind::kName)
    throw ConfigError(where + ": architecture '" + a.name + "' has " + a.experts.label +
                      " experts, the layer asked for has " + gguf::experts_named(Kind::kName, Kind::kLabel).label +
                      " experts: load it as " + a.experts.layer);
}

/// Every check of the file comment for a layer of `Expert` experts (the
/// expert type, any scalar; its kind's Gguf form); reads metadata and tensor infos only.
/// `whole_layer` false skips the memory check of step 6: an expert-parallel
/// rank holds only its experts (mpi/gguf_checkpoint.hpp).
template <class Expert = SwiGLU<float>>
Plan plan(const std::string& where, const gguf::File& file, Index layer, bool need_norm, bool whole_layer = true) {
  using Kind = ExpertKind<Expert>;
  Plan p;
  check_expert_kind<Expert>(where, gguf::architecture(file.architecture(), where));
  plan_config(where, file, layer, p);
  const MoEConfig& c = p.config;
  namespace tn = gguf::tensor_names;
  const auto d = std::uint64_t(c.d_model), f = std::uint64_t(c.d_ffn), e = std::uint64_t(c.n_experts);
  const auto fs = std::uint64_t(c.shared_ffn());
  TensorChecks t{file, layer, {}, {}, {}};
  p.router = t.want(tn::kRouter, {d, e});
  p.gate = t.want(tn::kGateExps, {d, f, e});
  p.up = t.want(tn::kUpExps, {d, f, e});
  p.down = t.want(tn::kDownExps, {f, d, e});
  if (c.n_shared > 0) {
    p.shared_gate_w = t.want(tn::kGateShexp, {d, fs});
    p.shared_up = t.want(tn::kUpShexp, {d, fs});
    p.shared_down = t.want(tn::kDownShexp, {fs, d});
  }
  if (c.shared_expert_gate) p.shared_gate = t.want(tn::kSharedGate, {d});
  if (p.arch->probs_bias) p.bias = t.want(tn::kProbsBias, {e}, false);
  if (p.arch->router_bias) p.router_bias = t.want(tn::kRouterBias, {e});
  for (const ExpertExtraTensor& x : Kind::Gguf::extra_tensors(c.d_model, c.d_ffn))  // ne [cols, E]: row e is expert e's
    p.extras.push_back(t.want(x.name, {std::uint64_t(x.cols), e}));
  for (const ExpertExtraTensor& x : Kind::extra_tensors(c.d_model, c.d_ffn)) p.extra_names.emplace_back(x.name);
  if (need_norm) p.norm = t.want(p.arch->norm_tensor, {d});
  t.report(where);
  if (need_norm && !(p.rms_eps > 0))
    throw FormatError(where + ": the file has no metadata key '" + p.arch->key(gguf::keys::kRmsEps) +
                      "' (> 0), which the sublayer's RMSNorm needs");
  const packed::ExpertDtypes routed = expert_types(where, p.gate, p.up, p.down);
  p.types = PackedTypes(routed, c.n_shared > 0 ? expert_types(where, p.shared_gate_w, p.shared_up, p.shared_down) : routed);
  if (!whole_layer) return p;
  // The rows move from the mapping into the panels: no staging. Also refuses
  // widths that are not whole blocks of their type.
  PackedMoE<float, typename Kind::Packed>::check_fits(where.c_str(), c, 0, p.types);
  return p;
}

}  // namespace apex::detail::gguf_moe
