#pragma once
/// \file io/name_maps.hpp
/// Checkpoints of an MoEFFN (or any layer with its `config()`,
/// `param_values()`, `params()` and `balancer()`) under the Hugging Face
/// tensor names of an open MoE family (docs/routing.md#checkpoints), on top of io/checkpoint.hpp: the
/// layer's `param_values()` renamed, plus the balancing bias where the family
/// stores one (DeepSeek-V3's `e_score_correction_bias`, kept as stored).
/// Strict by default, as load_checkpoint, and as it a rejected load leaves
/// the layer as it was.
///
///     apex name                    DeepSeek-V3 / Qwen2-MoE / Qwen3-MoE / OLMoE   Mixtral
///     router.weight                mlp.gate.weight                               block_sparse_moe.gate.weight
///     experts.e.w_gate.weight      mlp.experts.e.gate_proj.weight                block_sparse_moe.experts.e.w1.weight
///     experts.e.w_up.weight        mlp.experts.e.up_proj.weight                  block_sparse_moe.experts.e.w3.weight
///     experts.e.w_down.weight      mlp.experts.e.down_proj.weight                block_sparse_moe.experts.e.w2.weight
///     shared_experts.0.w_*.weight  mlp.shared_experts.*_proj.weight (DeepSeek-V3), mlp.shared_expert.*_proj.weight (Qwen2-MoE)
///     shared_expert_gate.weight    mlp.shared_expert_gate.weight (Qwen2-MoE)
///     balancer bias (1 × E)        mlp.gate.e_score_correction_bias, shape [E] (DeepSeek-V3)
///
/// `prefix` is the layer's path in a whole-model file, e.g. "model.layers.3.";
/// load such a file with `allow_unexpected` for the other layers' tensors.
/// Qwen3-MoE and OLMoE use the same names: their files cannot be told apart
/// by names, only the routing (renormalised or not) differs.

#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "../core/errors.hpp"
#include "../moe/families.hpp"
#include "../core/state_names.hpp"
#include "../moe/config.hpp"

namespace apex {

namespace detail {

/// The family name of `internal` (a name of MoEFFN::param_values()); ConfigError
/// for a parameter the family's block does not have.
inline std::string family_tensor_name(MoEFamily f, const std::string& internal) {
  namespace sn = state_names;
  const FamilyTensorNames& n = family_traits(f, "family_params").names;
  const std::string block = n.block;
  auto proj = [&](const std::string& w) -> std::string {
    return w == sn::kGate ? n.gate_proj : w == sn::kUp ? n.up_proj : n.down_proj;
  };
  const std::string routed = sn::kRoutedPrefix, shared = sn::shared_expert(0);
  if (internal == sn::kRouter) return block + "gate.weight";
  if (internal.rfind(routed, 0) == 0) {
    const auto dot = internal.find('.', routed.size());
    if (dot != std::string::npos && sn::is_projection(internal.substr(dot + 1)))
      return block + internal.substr(0, dot + 1) + proj(internal.substr(dot + 1));
  }
  if (n.shared_block && internal.rfind(shared, 0) == 0 && sn::is_projection(internal.substr(shared.size())))
    return n.shared_block + proj(internal.substr(shared.size()));
  if (n.shared_gate && internal == sn::kSharedGate) return n.shared_gate;
  throw ConfigError(std::string("family_params: the ") + family_name(f) + " name map has no name for parameter '" +
                    internal + "'");
}

/// ConfigError unless the layer's shared experts fit the family's block.
inline void check_family_fit(const char* where, const MoEConfig& c, MoEFamily f) {
  const FamilyTraits& row = family_traits(f, where);
  const std::string fam = row.model_type;
  switch (row.shared_layout) {
    case FamilySharedLayout::OneMLP:
      require_config(c.n_shared <= 1, where, "the " + fam + " name map holds the shared experts as one MLP "
                                                            "(n_shared <= 1, width d_shared_ffn), got n_shared = " +
                                                            std::to_string(c.n_shared));
      require_config(!c.shared_expert_gate, where, "the " + fam + " block has no shared_expert_gate");
      break;
    case FamilySharedLayout::OneGated:
      require_config(c.n_shared == 1 && c.shared_expert_gate, where,
                     "the " + fam + " block has one gated shared expert (n_shared = 1, shared_expert_gate)");
      break;
    case FamilySharedLayout::None:
      require_config(c.n_shared == 0 && !c.shared_expert_gate, where,
                     "the " + fam + " block has no shared experts, got n_shared = " + std::to_string(c.n_shared));
  }
}

/// The part of a tensor name up to its last dot ("mlp.shared_expert_gate."
/// of "mlp.shared_expert_gate.weight"): files are told apart by such stems.
inline std::string name_stem(const char* name) {
  const std::string s = name;
  return s.substr(0, s.rfind('.') + 1);
}

/// Which family a file's tensor names under `prefix` belong to, as the
/// FamilyTensorNames::file_kind of the first family whose own names it holds
/// ("" if none of the signatures is present).
inline std::string detect_family(const safetensors::Reader& file, const std::string& prefix) {
  auto has = [&](const std::string& start) {
    for (const auto& t : file.tensors())
      if (t.name.rfind(prefix + start, 0) == 0) return true;
    return false;
  };
  const FamilyTensorNames& mixtral = family_traits(MoEFamily::Mixtral).names;
  const FamilyTensorNames& qwen2 = family_traits(MoEFamily::Qwen2MoE).names;
  const FamilyTensorNames& deepseek = family_traits(MoEFamily::DeepSeekV3).names;
  const FamilyTensorNames& plain = family_traits(MoEFamily::Qwen3MoE).names;  // names only the common ones
  if (has(mixtral.block)) return mixtral.file_kind;
  if (has(qwen2.shared_block) || has(name_stem(qwen2.shared_gate))) return qwen2.file_kind;
  if (has(deepseek.bias) || has(deepseek.shared_block)) return deepseek.file_kind;
  if (has(std::string(plain.block) + "gate.weight")) return plain.file_kind;
  return "";
}

inline bool family_matches(MoEFamily f, const std::string& detected) {
  if (detected.empty()) return true;  // the strict load names what is missing
  return detected == family_traits(f).names.file_kind;
}

/// The name of a family's balancing-bias tensor under `prefix` (DeepSeek-V3's
/// `mlp.gate.e_score_correction_bias`, shape [E]), or "" for a family whose
/// checkpoints have none.
inline std::string family_bias_name(MoEFamily f, const std::string& prefix) {
  const char* bias = family_traits(f).names.bias;
  return bias ? prefix + bias : std::string();
}

/// FormatError naming the problem if the file's names under `prefix` are
/// another family's, or a DeepSeek-V3 (sigmoid router) file lacks its
/// correction bias. Every loader of family checkpoints (float and packed)
/// applies this one rule.
inline void check_family_file(const std::string& where, const safetensors::Reader& file, MoEFamily f,
                              const std::string& prefix) {
  check_family(where.c_str(), f);
  const std::string detected = detect_family(file, prefix);
  const std::string bias_name = family_bias_name(f, prefix);
  // A file of the family's own kind, or one with only the common names, must hold the bias.
  const bool own_or_plain = detected == family_traits(f).names.file_kind ||
                            detected == family_traits(MoEFamily::Qwen3MoE).names.file_kind;
  if (!bias_name.empty() && own_or_plain &&
      !file.header().find(bias_name))
    throw FormatError(where + ": the sigmoid router of " + family_name(f) + " needs its correction bias '" + bias_name +
                      "', which the checkpoint lacks");
  if (!family_matches(f, detected))
    throw FormatError(where + ": the " + std::string(family_name(f)) +
                      " name map was applied to a checkpoint of another family (its tensor names are " + detected +
                      "'s)");
}

}  // namespace detail

namespace detail {
/// `list` (the layer's params() or param_values()) under the family's names.
template <class T>
ParamList<T> renamed(ParamList<T> list, MoEFamily f, const std::string& prefix) {
  for (auto& p : list) p.name = prefix + detail::family_tensor_name(f, p.name);
  return list;
}
}  // namespace detail

/// The layer's parameters with their gradients (MoEFFN::params, which
/// allocates them) under the family's names (prefix prepended). ConfigError
/// if the layer's shared experts do not fit the family or an expert has a
/// parameter the family lacks.
template <class Layer, class T = typename Layer::Scalar>
ParamList<T> family_params(Layer& moe, MoEFamily f, const std::string& prefix = "") {
  detail::check_family_fit("family_params", moe.config(), f);
  return detail::renamed(moe.params(), f, prefix);
}

/// As family_params, values only (MoEFFN::param_values): never allocates
/// gradients. What the family checkpoints below read and write.
template <class Layer, class T = typename Layer::Scalar>
ParamList<T> family_param_values(Layer& moe, MoEFamily f, const std::string& prefix = "") {
  detail::check_family_fit("family_param_values", moe.config(), f);
  return detail::renamed(moe.param_values(), f, prefix);
}

/// Saves the layer under the family's names; DeepSeek-V3 adds the balancing
/// bias as `mlp.gate.e_score_correction_bias` of shape [E].
template <class Layer, class T = typename Layer::Scalar>
void save_family_checkpoint(const std::string& path, Layer& moe, MoEFamily f,
                            const std::string& prefix = "", SaveOptions options = {}) {
  ParamList<T> params = family_param_values(moe, f, prefix);
  RowVector<T> bias = moe.balancer().bias();  // 1 × E
  const std::string name = detail::family_bias_name(f, prefix);
  if (!name.empty()) {
    params.push_back(Param<T>{name, bias.data(), nullptr, 1, bias.cols()});
    options.shapes[name] = {std::uint64_t(bias.cols())};
  }
  save_checkpoint(path, params, options);
}

namespace detail {
/// Reads the family file's balancing bias `name` into `bias` (1 × E) with
/// load_checkpoint's checks of dtype and shape, and throws ValueError naming
/// the tensor if it holds NaN or Inf (what LoadBalancer::set_bias rejects):
/// everything that could reject the bias, found before the layer is written.
/// False, and `bias` untouched, if the file has no such tensor.
template <class T>
bool read_family_bias(const std::string& where, const safetensors::Reader& file, const std::string& name,
                      RowVector<T>& bias, const LoadOptions& options) {
  if (!file.header().find(name)) return false;
  LoadOptions one = options;
  one.allow_unexpected = true;  // the layer's tensors: the full load below matches them
  load_checkpoint(file, ParamList<T>{Param<T>{name, bias.data(), nullptr, 1, bias.cols()}}, one);
  if (!bias.allFinite())
    throw ValueError(where + ": tensor " + safetensors::quote_name(name) +
                     " contains NaN or Inf (the balancer's bias must be finite)");
  return true;
}
}  // namespace detail

/// Loads a family checkpoint into the layer (strict unless `options` say
/// otherwise). Throws FormatError naming the problem if the file's names are
/// another family's, or a DeepSeek-V3 (sigmoid router) file lacks its
/// `e_score_correction_bias`, ValueError if that bias holds NaN or Inf;
/// otherwise as load_checkpoint. Every check runs before the first write, so
/// a rejected load leaves the layer as it was. The bias is stored exactly as
/// the file has it (LoadBalancer::set_bias: the balancer's [−1, 1] bounds its
/// own update steps, not a loaded bias), as load_packed_moe reads it.
template <class Layer, class T = typename Layer::Scalar>
LoadResult load_family_checkpoint(const safetensors::Reader& file, Layer& moe, MoEFamily f,
                                  const std::string& prefix = "", const LoadOptions& options = {}) {
  const std::string where = "load_family_checkpoint(" + file.source().description() + ")";
  detail::check_family_file(where, file, f, prefix);
  const std::string bias_name = detail::family_bias_name(f, prefix);
  ParamList<T> params = family_param_values(moe, f, prefix);
  RowVector<T> bias = moe.balancer().bias();
  const bool has_bias = !bias_name.empty() && detail::read_family_bias(where, file, bias_name, bias, options);
  // Named in the full load too, so the strict name match counts it (it reads the same values again).
  if (!bias_name.empty()) params.push_back(Param<T>{bias_name, bias.data(), nullptr, 1, bias.cols()});
  LoadResult r = load_checkpoint(file, params, options);
  if (has_bias) moe.balancer().set_bias(bias);  // shape and values checked above: cannot throw
  return r;
}

template <class Layer, class T = typename Layer::Scalar>
LoadResult load_family_checkpoint(const std::string& path, Layer& moe, MoEFamily f,
                                  const std::string& prefix = "", const LoadOptions& options = {}) {
  const safetensors::Reader file(path, options.limits);
  return load_family_checkpoint(file, moe, f, prefix, options);
}

}  // namespace apex
