#pragma once
/// \file io/family_names.hpp
/// The Hugging Face tensor names of the open MoE families, public: what an
/// MoEFFN parameter is called in a family's checkpoint, the family's
/// balancing-bias tensor, and which family a list of tensor names belongs to
/// (docs/routing.md#checkpoints).
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
/// Exists apart from the checkpoint functions (io/name_maps.hpp) because
/// every reader of family files needs the same names and the same one rule
/// for telling families apart: the float and packed loaders, the
/// expert-parallel layer (mpi/family_checkpoint.hpp), and a user's own
/// converter. Qwen3-MoE and OLMoE use the same names: their files cannot be
/// told apart by names, only the routing (renormalised or not) differs.

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "../core/errors.hpp"
#include "../core/state_names.hpp"
#include "../moe/config.hpp"
#include "../moe/families.hpp"

namespace apex {

/// The family's name of `internal`, a name of MoEFFN::param_values()
/// ("experts.3.w_up.weight" → "mlp.experts.3.up_proj.weight"), without a
/// layer prefix. ConfigError for a parameter the family's block does not
/// have (a second shared expert, a shared gate where the family has none).
inline std::string family_tensor_name(MoEFamily f, const std::string& internal) {
  namespace sn = state_names;
  const FamilyTensorNames& n = family_traits(f, "family_tensor_name").names;
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
  throw ConfigError(std::string("family_tensor_name: the ") + family_name(f) + " name map has no name for parameter '" +
                    internal + "'");
}

/// The name of a family's balancing-bias tensor under `prefix` (DeepSeek-V3's
/// `mlp.gate.e_score_correction_bias`, shape [E]), or "" for a family whose
/// checkpoints have none.
inline std::string family_bias_name(MoEFamily f, const std::string& prefix = "") {
  const char* bias = family_traits(f, "family_bias_name").names.bias;
  return bias ? prefix + bias : std::string();
}

/// ConfigError unless the layer's shared experts (and router) fit the family's block.
inline void check_family_fit(const char* where, const MoEConfig& c, MoEFamily f) {
  const FamilyTraits& row = family_traits(f, where);
  const std::string fam = row.model_type;
  detail::require_config(!c.router_bias, where, "the " + fam + " router has no bias (router_bias is on)");
  switch (row.shared_layout) {
    case FamilySharedLayout::OneMLP:
      detail::require_config(c.n_shared <= 1, where, "the " + fam + " name map holds the shared experts as one MLP "
                                                            "(n_shared <= 1, width d_shared_ffn), got n_shared = " +
                                                            std::to_string(c.n_shared));
      detail::require_config(!c.shared_expert_gate, where, "the " + fam + " block has no shared_expert_gate");
      break;
    case FamilySharedLayout::OneGated:
      detail::require_config(c.n_shared == 1 && c.shared_expert_gate, where,
                     "the " + fam + " block has one gated shared expert (n_shared = 1, shared_expert_gate)");
      break;
    case FamilySharedLayout::None:
      detail::require_config(c.n_shared == 0 && !c.shared_expert_gate, where,
                     "the " + fam + " block has no shared experts, got n_shared = " + std::to_string(c.n_shared));
  }
}

/// Whether some tensor name of a file starts with the given string: what
/// family detection asks of a file, a shard index or a GGUF header alike.
using NamePrefixQuery = std::function<bool(const std::string& start)>;

namespace detail {
/// "mlp.shared_expert_gate." of "mlp.shared_expert_gate.weight": a name's module.
inline std::string module_of(const char* name) {
  const std::string s = name;
  return s.substr(0, s.rfind('.') + 1);
}

/// The name starts only a family's files hold: its block when no other
/// family's has the same, its shared experts', its shared gate's module, its
/// bias. None for a family with the common names only (Qwen3-MoE, OLMoE).
inline std::vector<std::string> own_name_starts(const FamilyTraits& row) {
  std::vector<std::string> out;
  bool unique_block = true;
  for (MoEFamily f : kAllFamilies)
    unique_block &= f == row.family || std::string(family_traits(f).names.block) != row.names.block;
  if (unique_block) out.push_back(row.names.block);
  if (row.names.shared_block) out.push_back(row.names.shared_block);
  if (row.names.shared_gate) out.push_back(module_of(row.names.shared_gate));
  if (row.names.bias) out.push_back(row.names.bias);
  return out;
}

/// The file_kind of files with only the common names: the first family
/// that has no names of its own.
inline const char* common_file_kind() {
  for (MoEFamily f : kAllFamilies)
    if (own_name_starts(family_traits(f)).empty()) return family_traits(f).names.file_kind;
  return "";
}

/// The families' rows in the order detect_family tries them (their detection_rank).
inline std::vector<const FamilyTraits*> rows_in_detection_order() {
  std::vector<const FamilyTraits*> rows;
  for (MoEFamily f : kAllFamilies) rows.push_back(&family_traits(f));
  std::stable_sort(rows.begin(), rows.end(),
                   [](const FamilyTraits* a, const FamilyTraits* b) { return a->detection_rank < b->detection_rank; });
  return rows;
}
}  // namespace detail

/// Which family a file's tensor names under `prefix` belong to, as the
/// FamilyTensorNames::file_kind of the first family (in detection_rank
/// order) whose own names the file holds, else of the families with the
/// common names if it has their router (`<block>gate.weight`), else "".
inline std::string detect_family(const NamePrefixQuery& has_name_starting, const std::string& prefix = "") {
  for (const FamilyTraits* row : detail::rows_in_detection_order())
    for (const std::string& start : detail::own_name_starts(*row))
      if (has_name_starting(prefix + start)) return row->names.file_kind;
  for (MoEFamily f : kAllFamilies) {
    const FamilyTraits& row = family_traits(f);
    if (detail::own_name_starts(row).empty() && has_name_starting(prefix + row.names.block + "gate.weight"))
      return row.names.file_kind;
  }
  return "";
}

namespace detail {

/// FormatError naming the problem if the names under `prefix` are another
/// family's, or a DeepSeek-V3 (sigmoid router) file lacks its correction
/// bias (`has_tensor` answers for a whole name). Every loader of family
/// checkpoints — float, packed, sharded, expert-parallel — applies this one
/// rule.
inline void check_family_names(const std::string& where, const NamePrefixQuery& has_name_starting,
                               const std::function<bool(const std::string&)>& has_tensor, MoEFamily f,
                               const std::string& prefix) {
  check_family(where.c_str(), f);
  const std::string detected = detect_family(has_name_starting, prefix);
  const std::string bias_name = family_bias_name(f, prefix);
  // A file of the family's own kind, or one with only the common names, must hold the bias.
  const bool own_or_plain = detected == family_traits(f).names.file_kind || detected == common_file_kind();
  if (!bias_name.empty() && own_or_plain && !has_tensor(bias_name))
    throw FormatError(where + ": the sigmoid router of " + family_name(f) + " needs its correction bias '" + bias_name +
                      "', which the checkpoint lacks");
  if (!detected.empty() && detected != family_traits(f).names.file_kind)
    throw FormatError(where + ": the " + std::string(family_name(f)) +
                      " name map was applied to a checkpoint of another family (its tensor names are " + detected +
                      "'s)");
}

}  // namespace detail
}  // namespace apex
