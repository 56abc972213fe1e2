#pragma once
/// \file io/hf_config.hpp
/// A Hugging Face model folder's `config.json`, read into the MoE layer
/// configuration of its family: `read_hf_config(folder or config.json)`
/// gives the family, the MoEConfig of its MoE blocks, which blocks are MoE,
/// the block count and the RMSNorm ε — what a loader needs beside the
/// shards (io/name_maps.hpp, `load_family_checkpoint(folder, …)`).
///
/// The keys read, per `model_type` (the families' published configs and the
/// defaults of transformers' configuration classes where a key is absent):
///
///     key                            deepseek_v3   mixtral            qwen2_moe   qwen3_moe   olmoe
///     d_model                        hidden_size (all)
///     d_ffn                          moe_intermediate_size  intermediate_size  moe_…  moe_…  intermediate_size
///     n_experts                      n_routed_experts  num_local_experts  num_experts (qwen2/3, olmoe;
///                                                                     transformers 5 writes Qwen3-MoE's as num_local_experts)
///     n_active                       num_experts_per_tok (all)
///     renormalise                    norm_topk_prob (default true)  always  norm_topk_prob (default false)
///     shared experts                 n_shared_experts × moe_intermediate_size (one MLP)
///                                                                     shared_expert_intermediate_size (gated)
///     groups, scale                  n_group, topk_group, routed_scaling_factor
///     MoE blocks                     first_k_dense_replace, moe_layer_freq
///                                                                     decoder_sparse_step, mlp_only_layers
///     ε                              rms_norm_eps (all)
///
/// The table is the families' rows (moe/families.hpp): each row's `config`
/// (FamilyConfigKeys) names its keys, and one function reads any row's, so
/// a new family's keys are data in its row. Everything else of the family's
/// block (scoring, group score, the bias) is the row's too. A config the library cannot
/// compute exactly is a ConfigError naming the key: DeepSeek-V3 with a
/// `scoring_func` other than sigmoid or a `topk_method` other than
/// noaux_tc, a Qwen2-MoE block without its shared expert, an ε, scale, α
/// or L that is not a positive float (rms_norm_eps -1 or 0,
/// routed_scaling_factor 1e39: +inf in float), a shared width
/// n_shared_experts × moe_intermediate_size beyond a 64-bit index (every
/// count is at most 2^40, so only that product can overflow). A missing key is a
/// FormatError naming it; the file is read as the shard index is (regular
/// files only, bounded size, bounded nesting, no repeated keys).
///
/// gpt-oss (model_type "gpt_oss") has its own reader, read_gpt_oss_config:
/// its experts are clamped SwiGLUs with options of their own
/// (ClampedSwiGLUOptions: swiglu_alpha, swiglu_limit) and it is not a row
/// of the family table; read_hf_config refuses it with a ConfigError naming
/// read_gpt_oss_config.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "../core/checked_size.hpp"
#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"
#include "../moe/config.hpp"
#include "../layers/clamped_swiglu.hpp"
#include "../moe/families.hpp"
#include "../moe/gpt_oss.hpp"
#include "shard_index.hpp"

namespace apex {

/// What a family's config.json says of its MoE blocks.
struct HfModelConfig {
  MoEFamily family = MoEFamily::Qwen3MoE;
  MoEConfig moe;              ///< every MoE block's layer configuration
  Index n_layers = 0;         ///< num_hidden_layers
  double rms_eps = 1e-6;      ///< rms_norm_eps
  Index first_moe_layer = 0;  ///< blocks below are dense (DeepSeek-V3's first_k_dense_replace)
  Index moe_every = 1;  ///< MoE every n-th block: (layer + 1) % n == 0 (Qwen's decoder_sparse_step), layer % n == 0 (DeepSeek-V3's moe_layer_freq)
  std::vector<Index> dense_layers;  ///< blocks listed as dense (Qwen's mlp_only_layers)

  /// Whether block `layer` (0-based) has an MoE FFN.
  bool is_moe_layer(Index layer) const {
    if (layer < 0 || layer >= n_layers || layer < first_moe_layer) return false;
    for (Index d : dense_layers)
      if (d == layer) return false;
    const FamilyTraits* row = detail::find_family(family);
    return row && row->config.moe_every_from_zero ? layer % moe_every == 0 : (layer + 1) % moe_every == 0;
  }
};

namespace detail {

/// Typed reads of config.json keys; every error names the key and the file.
struct HfKeys {
  const nlohmann::json& j;
  const std::string& where;

  const nlohmann::json* find(const char* key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  Index count(const char* key) const {
    const nlohmann::json* v = find(key);
    if (!v) throw FormatError(where + ": config.json has no '" + key + "'");
    return count_of(key, *v);
  }
  Index count_or(const char* key, Index fallback) const { return find(key) ? count(key) : fallback; }
  Index count_of(const char* key, const nlohmann::json& v) const {
    if (!v.is_number_integer() || v.get<std::int64_t>() < 0 || v.get<std::int64_t>() > (std::int64_t(1) << 40))
      throw FormatError(where + ": config.json's '" + key + "' is " + v.dump().substr(0, 40) +
                        ", expected an integer in [0, 2^40]");
    return Index(v.get<std::int64_t>());
  }
  double number_or(const char* key, double fallback) const {
    const nlohmann::json* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) throw FormatError(where + ": config.json's '" + key + "' is not a number");
    return v->get<double>();
  }
  /// A key the layer computes with in float and that must be positive (ε,
  /// a scale, α, L): ConfigError naming it for -1, 0, NaN, 1e39 (+inf in
  /// float) or 1e-50 (0 in float).
  double positive_float_or(const char* key, double fallback) const {
    const double v = number_or(key, fallback);
    const std::string problem = positive_float_problem(v);
    if (!problem.empty()) throw ConfigError(where + ": config.json's '" + key + "' " + problem);
    return v;
  }
  bool flag_or(const char* key, bool fallback) const {
    const nlohmann::json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) throw FormatError(where + ": config.json's '" + key + "' is not true or false");
    return v->get<bool>();
  }
  std::string text_or(const char* key, const std::string& fallback) const {
    const nlohmann::json* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) throw FormatError(where + ": config.json's '" + key + "' is not a string");
    return v->get<std::string>();
  }
};

/// The family's keys (its row's FamilyConfigKeys, moe/family_traits.hpp) of
/// `k` into `out`, in the order the row lists them.
inline void read_family_keys(const HfKeys& k, HfModelConfig& out) {
  const FamilyTraits& row = family_traits(out.family, k.where.c_str());
  const FamilyConfigKeys& key = row.config;
  MoEConfig& c = out.moe;
  const char* where = k.where.c_str();
  c.d_ffn = k.count(key.d_ffn);
  c.n_experts = key.n_experts_alt && !k.find(key.n_experts) && k.find(key.n_experts_alt) ? k.count(key.n_experts_alt)
                                                                                          : k.count(key.n_experts);
  if (key.shared_count) {
    const Index shared = k.count_or(key.shared_count, 0);
    c.n_shared = shared > 0 ? 1 : 0;  // the shared experts as one MLP of the summed width
    c.d_shared_ffn = checked_product(
        where, (std::string("the shared MLP's width ") + key.shared_count + " x " + key.d_ffn).c_str(), {shared, c.d_ffn});
  }
  if (key.groups) {
    c.routing.n_groups = k.count_or("n_group", c.routing.n_groups);
    c.routing.topk_group = k.count_or("topk_group", c.routing.topk_group);
    c.routing.routed_scale = k.positive_float_or("routed_scaling_factor", c.routing.routed_scale);
  }
  if (key.renormalize) c.routing.renormalize = k.flag_or(key.renormalize, key.renormalize_default);
  for (const FamilyFixedKey& fixed : key.fixed)
    if (fixed.key)
      detail::require_config(k.text_or(fixed.key, fixed.value) == fixed.value, where,
                             std::string("config.json's '") + fixed.key + "' must be \"" + fixed.value + "\" (" +
                                 fixed.why + ")");
  if (key.first_moe_layer) out.first_moe_layer = k.count_or(key.first_moe_layer, 0);
  if (key.moe_every) out.moe_every = k.count_or(key.moe_every, 1);
  if (key.dense_layers)
    if (const nlohmann::json* dense = k.find(key.dense_layers)) {
      if (!dense->is_array()) throw FormatError(k.where + ": config.json's '" + key.dense_layers + "' is not a list");
      for (const auto& v : *dense) out.dense_layers.push_back(k.count_of(key.dense_layers, v));
    }
  if (key.shared_width) {
    c.d_shared_ffn = k.count(key.shared_width);
    detail::require_config(c.d_shared_ffn > 0, where,
                           std::string("config.json's '") + key.shared_width + "' is 0: the library's " + row.title +
                               " block has its gated shared expert");
  }
  detail::require_config(out.moe_every >= 1, where, "config.json's MoE block frequency must be at least 1");
}


/// `path` itself, or its config.json if it is a folder.
inline std::string config_json_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  return fs::is_directory(path, ec) ? (fs::path(path) / "config.json").string() : path;
}
/// The parsed JSON object of a config.json's text.
inline nlohmann::json parse_config_object(std::string_view text, const std::string& where) {
  io::detail::require_no_nul(text, where);
  nlohmann::json j;
  try {
    detail::ShardIndexGuard guard(where, "config.json");
    j = nlohmann::json::parse(text.begin(), text.end(), std::ref(guard));
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw FormatError(where + ": config.json is not a JSON object");
  return j;
}
}  // namespace detail

/// Parses the text of a config.json; `where` starts every message.
inline HfModelConfig parse_hf_config(std::string_view text, const std::string& where) {
  const nlohmann::json j = detail::parse_config_object(text, where);
  const detail::HfKeys k{j, where};
  HfModelConfig out;
  const std::string model_type = k.text_or("model_type", "");
  detail::require_config(model_type != "gpt_oss", where.c_str(),
                         "model_type \"gpt_oss\" is read by read_gpt_oss_config (its experts and block differ)");
  out.family = family_by_name(model_type);  // ConfigError for another model_type
  out.moe = family_preset(out.family);  // the family's routing and shared layout; shapes below
  out.moe.d_model = k.count("hidden_size");
  out.moe.n_active = k.count("num_experts_per_tok");
  out.n_layers = k.count("num_hidden_layers");
  out.rms_eps = k.positive_float_or("rms_norm_eps", 1e-6);
  detail::read_family_keys(k, out);
  out.moe.validate(where.c_str());
  return out;
}

/// Reads `path` (a model folder, or its config.json) as the shard index is
/// read: a regular file, at most `limits.max_index_bytes`. ConfigError for
/// model_type "gpt_oss" (read_gpt_oss_config reads those).
inline HfModelConfig read_hf_config(const std::string& path, const safetensors::Limits& limits = {}) {
  const std::string file = detail::config_json_path(path);
  const std::string where = "read_hf_config('" + file + "')";
  const std::string text = detail::read_small_file(where, file, "config.json", limits);
  return parse_hf_config(text, where);
}

/// What a gpt-oss config.json says of its MoE blocks (every block is MoE).
struct GptOssModelConfig {
  MoEConfig moe;                 ///< gpt_oss_moe(hidden_size, intermediate_size, num_local_experts, num_experts_per_tok)
  ClampedSwiGLUOptions experts;  ///< swiglu_alpha (default 1.702), swiglu_limit (default 7)
  Index n_layers = 0;            ///< num_hidden_layers
  double rms_eps = 1e-5;         ///< rms_norm_eps (transformers' GptOssConfig default)
};

/// Parses the text of a gpt-oss config.json; `where` starts every message.
/// ConfigError for another model_type or out-of-range values, FormatError
/// for a missing or mistyped key (named).
inline GptOssModelConfig parse_gpt_oss_config(std::string_view text, const std::string& where) {
  const nlohmann::json j = detail::parse_config_object(text, where);
  const detail::HfKeys k{j, where};
  const std::string model_type = k.text_or("model_type", "");
  detail::require_config(model_type == "gpt_oss", where.c_str(),
                         "model_type is \"" + model_type.substr(0, 40) +
                             "\", not \"gpt_oss\" (read_hf_config reads the other families)");
  GptOssModelConfig out;
  const Index d = k.count("hidden_size"), f = k.count("intermediate_size");  // in order: the first missing key is named
  const Index experts = k.count("num_local_experts"), active = k.count("num_experts_per_tok");
  out.moe = gpt_oss_moe(d, f, experts, active);
  out.experts.alpha = k.positive_float_or("swiglu_alpha", out.experts.alpha);
  out.experts.limit = k.positive_float_or("swiglu_limit", out.experts.limit);
  out.n_layers = k.count("num_hidden_layers");
  out.rms_eps = k.positive_float_or("rms_norm_eps", out.rms_eps);
  out.moe.validate(where.c_str());
  out.experts.validate(where.c_str());
  return out;
}

/// Reads a gpt-oss `path` (a model folder, or its config.json) as read_hf_config does.
inline GptOssModelConfig read_gpt_oss_config(const std::string& path, const safetensors::Limits& limits = {}) {
  const std::string file = detail::config_json_path(path);
  const std::string where = "read_gpt_oss_config('" + file + "')";
  return parse_gpt_oss_config(detail::read_small_file(where, file, "config.json", limits), where);
}

}  // namespace apex
