#pragma once
/// \file adapters/peft_config.hpp
/// peft's `adapter_config.json`, read and written (docs/adapters.md#peft-adapter-files):
/// the keys that define a LoRA adapter's math — `r`, `lora_alpha`,
/// `use_rslora` — and which weights it adapts (`target_parameters`,
/// `target_modules`).
///
/// A config that would make the adapter compute something else than
///
///     W x + s·B(A x),   s = lora_alpha / r   (lora_alpha / √r with use_rslora)
///
/// on every adapted weight is refused with a ConfigError naming the key:
/// per-module ranks or scales (`rank_pattern`, `alpha_pattern`), DoRA, a
/// bias (`bias`, `lora_bias`), `fan_in_fan_out`, whole modules saved beside
/// the adapters (`modules_to_save`), `layer_replication`, an initialisation
/// that rewrites the base weights or the forward (`init_lora_weights` PiSSA,
/// OLoRA, CorDA, LoftQ, LoRA-GA, MiCA), and every other key peft may add
/// unless it holds its "off" value (null, false, an empty list or object):
/// a variant the library does not know is never read as plain LoRA.
/// `lora_dropout` is read past: the files are for inference and for
/// training on from the adapter, and an evaluation forward has no dropout.
/// Keys that only describe the run (`base_model_name_or_path`, `task_type`,
/// `peft_version`, `inference_mode`, the initialisers' own configs …) are
/// accepted as they are.

#include <cmath>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "../io/hf_config.hpp"
#include "../io/shard_index.hpp"

namespace apex {

/// The name of the config file in an adapter folder, and of its tensors.
inline constexpr const char* kPeftConfigName = "adapter_config.json";
inline constexpr const char* kPeftWeightsName = "adapter_model.safetensors";

/// What an adapter_config.json says of a LoRA adapter.
struct PeftAdapterConfig {
  Index rank = 0;                              ///< r
  double alpha = 0;                            ///< lora_alpha
  bool rslora = false;                         ///< use_rslora: s = α/√r
  std::vector<std::string> target_parameters;  ///< parameters adapted in place (peft's ParamWrapper)
  std::vector<std::string> target_modules;     ///< modules adapted (a list)
  std::string target_modules_regex;            ///< or one regular expression (peft's string form)
  std::string base_model_name_or_path;         ///< "" when null
  std::string task_type;                       ///< "" when null

  /// s = α/r, or α/√r with rslora.
  double scale() const { return rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank); }
};

namespace detail {

/// The keys read for the math, or accepted with any value since they only
/// describe the run or an initialisation that happened before the save.
inline const std::set<std::string>& peft_known_keys() {
  static const std::set<std::string> keys{
      "peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "target_parameters", "rank_pattern",
      "alpha_pattern", "use_dora", "bias", "lora_bias", "fan_in_fan_out", "init_lora_weights", "modules_to_save",
      "layer_replication", "exclude_modules", "lora_dropout", "base_model_name_or_path", "task_type", "revision",
      "inference_mode", "peft_version", "auto_mapping", "layers_to_transform", "layers_pattern", "megatron_config",
      "megatron_core", "qalora_group_size", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
      "ensure_weight_tying"};
  return keys;
}

/// null, false, "", [] or {}: a key peft writes when its feature is off.
inline bool peft_off(const nlohmann::json& v) {
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_string() && v.get<std::string>().empty()) ||
         ((v.is_array() || v.is_object()) && v.empty());
}

/// Typed reads of adapter_config.json; every error names the key and the file.
struct PeftKeys {
  const nlohmann::json& j;
  const std::string& where;

  [[noreturn]] void refuse(const std::string& key, const std::string& why) const {
    throw ConfigError(where + ": adapter_config.json's '" + key + "' " + why);
  }
  const nlohmann::json* find(const char* key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  std::string text_or(const char* key, const std::string& fallback) const {
    const nlohmann::json* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) throw FormatError(where + ": adapter_config.json's '" + key + "' is not a string");
    return v->get<std::string>();
  }
  bool flag_or(const char* key, bool fallback) const {
    const nlohmann::json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) throw FormatError(where + ": adapter_config.json's '" + key + "' is not true or false");
    return v->get<bool>();
  }
  std::vector<std::string> names(const char* key) const {
    std::vector<std::string> out;
    const nlohmann::json* v = find(key);
    if (!v) return out;
    if (!v->is_array()) throw FormatError(where + ": adapter_config.json's '" + key + "' is not a list");
    for (const auto& s : *v) {
      if (!s.is_string()) throw FormatError(where + ": adapter_config.json's '" + key + "' holds a non-string");
      out.push_back(s.get<std::string>());
    }
    return out;
  }
};

/// r, lora_alpha, use_rslora: present (r), typed and in range.
inline void read_peft_scale(const PeftKeys& k, PeftAdapterConfig& c) {
  const nlohmann::json* r = k.find("r");
  if (!r) throw FormatError(k.where + ": adapter_config.json has no 'r'");
  if (!r->is_number_integer() || r->get<std::int64_t>() < 1 || r->get<std::int64_t>() > (std::int64_t(1) << 31))
    k.refuse("r", "is " + r->dump().substr(0, 40) + ", expected an integer rank >= 1");
  c.rank = Index(r->get<std::int64_t>());
  const nlohmann::json* a = k.find("lora_alpha");
  if (a && !a->is_number()) throw FormatError(k.where + ": adapter_config.json's 'lora_alpha' is not a number");
  c.alpha = a ? a->get<double>() : 8.0;  // peft's default
  if (!(std::isfinite(c.alpha) && c.alpha > 0)) k.refuse("lora_alpha", "must be finite and > 0");
  c.rslora = k.flag_or("use_rslora", false);
}

/// ConfigError naming the first key that changes the math from plain LoRA.
inline void check_peft_plain_lora(const PeftKeys& k, const PeftAdapterConfig& c) {
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (const nlohmann::json* v = k.find(key); v && !peft_off(*v))
      k.refuse(key, "sets per-module ranks or scales, which this library does not read (one r and lora_alpha)");
  if (k.flag_or("use_dora", false)) k.refuse("use_dora", "is true: DoRA adapters are not plain LoRA");
  if (k.text_or("bias", "none") != "none") k.refuse("bias", "is not \"none\": trained biases are not supported");
  if (k.flag_or("lora_bias", false)) k.refuse("lora_bias", "is true: a bias on lora_B is not supported");
  if (k.flag_or("fan_in_fan_out", false)) k.refuse("fan_in_fan_out", "is true: transposed (Conv1D) weights are not supported");
  for (const char* key : {"modules_to_save", "layer_replication"})
    if (const nlohmann::json* v = k.find(key); v && !peft_off(*v))
      k.refuse(key, "is set: the adapter carries whole modules or replicated layers besides LoRA, not supported");
  if (const nlohmann::json* v = k.find("exclude_modules"); v && !peft_off(*v) && !c.target_parameters.empty())
    k.refuse("exclude_modules", "is set with target_parameters: which parameters peft wrapped would be unknown");
  if (const nlohmann::json* v = k.find("init_lora_weights"); v && !v->is_boolean()) {
    const std::string init = v->is_string() ? v->get<std::string>() : v->dump().substr(0, 40);
    if (init != "gaussian" && init != "eva" && init != "orthogonal")
      k.refuse("init_lora_weights", "is \"" + init +
                                        "\": that initialisation rewrites the base weights or the forward, so the "
                                        "adapter does not apply to the base model as published");
  }
  for (const auto& item : k.j.items())
    if (!peft_known_keys().count(item.key()) && !peft_off(item.value()))
      k.refuse(item.key(), "is set (" + item.value().dump().substr(0, 40) +
                               "): a peft feature this library does not read, which may change the adapter's math");
}

}  // namespace detail

/// Parses the text of an adapter_config.json; `where` starts every message.
/// FormatError for invalid JSON or a mistyped key, ConfigError for a key
/// that is not plain LoRA (the file comment).
inline PeftAdapterConfig parse_peft_config(std::string_view text, const std::string& where) {
  const nlohmann::json j = detail::parse_config_object(text, where);
  const detail::PeftKeys k{j, where};
  const std::string type = k.text_or("peft_type", "");
  if (type.empty()) throw FormatError(where + ": adapter_config.json has no 'peft_type'");
  if (type != "LORA") k.refuse("peft_type", "is \"" + type.substr(0, 40) + "\"; only \"LORA\" adapters are read");
  PeftAdapterConfig c;
  detail::read_peft_scale(k, c);
  c.target_parameters = k.names("target_parameters");
  if (const nlohmann::json* t = k.find("target_modules"); t && t->is_string())
    c.target_modules_regex = t->get<std::string>();
  else
    c.target_modules = k.names("target_modules");
  c.base_model_name_or_path = k.text_or("base_model_name_or_path", "");
  c.task_type = k.text_or("task_type", "");
  detail::check_peft_plain_lora(k, c);
  return c;
}

/// Reads `path`: an adapter folder or its adapter_config.json (a regular
/// file of at most `limits.max_index_bytes`).
inline PeftAdapterConfig read_peft_config(const std::string& path, const safetensors::Limits& limits = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string file = fs::is_directory(path, ec) ? (fs::path(path) / kPeftConfigName).string() : path;
  const std::string where = "read_peft_config('" + file + "')";
  return parse_peft_config(detail::read_small_file(where, file, kPeftConfigName, limits), where);
}

/// The adapter_config.json a save writes for `c`: the keys peft writes for
/// plain LoRA (sorted, as peft's json.dumps(sort_keys=True) writes them),
/// without `peft_version` (the file is not peft's) and with lora_dropout 0.
/// ValueError for text that is not valid UTF-8.
inline std::string peft_config_text(const PeftAdapterConfig& c) {
  using nlohmann::json;
  const auto text_or_null = [](const std::string& s) { return s.empty() ? json(nullptr) : json(s); };
  json j = json::object();
  j["peft_type"] = "LORA";
  j["r"] = c.rank;
  if (std::floor(c.alpha) == c.alpha && std::abs(c.alpha) < 9.0e15) j["lora_alpha"] = std::int64_t(c.alpha);
  else j["lora_alpha"] = c.alpha;
  j["use_rslora"] = c.rslora;
  j["target_parameters"] = c.target_parameters.empty() ? json(nullptr) : json(c.target_parameters);
  if (!c.target_modules_regex.empty()) j["target_modules"] = c.target_modules_regex;
  else j["target_modules"] = c.target_modules;
  j["base_model_name_or_path"] = text_or_null(c.base_model_name_or_path);
  j["task_type"] = text_or_null(c.task_type);
  j["revision"] = nullptr;
  j["inference_mode"] = true;
  j["lora_dropout"] = 0.0;
  j["bias"] = "none";
  j["lora_bias"] = false;
  j["use_dora"] = false;
  j["fan_in_fan_out"] = false;
  j["init_lora_weights"] = true;
  j["modules_to_save"] = nullptr;
  j["rank_pattern"] = json::object();
  j["alpha_pattern"] = json::object();
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["exclude_modules"] = nullptr;
  try {
    return j.dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {  // JSON text is UTF-8; nlohmann refuses other bytes
    throw ValueError("adapter_config.json: a name or text (base_model_name_or_path, task_type, a target) is not "
                     "valid UTF-8: " + std::string(e.what()));
  }
}

}  // namespace apex
