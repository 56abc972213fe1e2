#pragma once
/// \file io/optimizer_state.hpp
/// AdamW's state (optim/adamw.hpp) saved to and loaded from a safetensors
/// file, so that training resumed from a checkpoint continues bitwise as the
/// uninterrupted run would have:
///
///     apex::save_checkpoint("model.safetensors", model.param_values());
///     apex::save_optimizer_state("adamw.safetensors", adamw);
///     …  // later, in a fresh process, over the same parameter list
///     apex::load_checkpoint("model.safetensors", model.param_values());
///     apex::AdamW<float> adamw(model.params(), options);
///     apex::load_optimizer_state("adamw.safetensors", adamw);
///
/// The file (safetensors, io/safetensors.hpp):
///
///     <param>.exp_avg      rows × cols   m of parameter <param> (PyTorch's state name)
///     <param>.exp_avg_sq   rows × cols   v
///     __metadata__         optimizer "AdamW", step, beta1, beta2, eps,
///                          weight_decay (the shortest decimal that reads
///                          back exactly), no_decay (JSON array of the names λ skips)
///
/// Tensors are stored in the optimiser's own type (F32 for float, F64 for
/// double) and load only into that type: the state must round-trip exactly.
///
/// Saves are atomic (safetensors::write_file_atomic): the previous file stays
/// whole unless the new one is complete. Loads are all or nothing: the
/// metadata, every name, dtype and shape, the options and the values are
/// checked before the optimiser changes, so a rejected file leaves it as it
/// was. Options that differ from the optimiser's are a ConfigError naming
/// the field, unless `take_file_options` adopts the file's.

#include <nlohmann/json.hpp>

#include <charconv>
#include <cstdint>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "../optim/adamw.hpp"
#include "checkpoint.hpp"
#include "file/json_text.hpp"
#include "safetensors.hpp"

namespace apex {

/// How load_optimizer_state matches a file to an optimiser.
struct OptimizerStateOptions {
  /// Adopt the file's beta1, beta2, eps, weight_decay and no_decay instead
  /// of requiring them equal to the optimiser's.
  bool take_file_options = false;
  /// Caps applied while reading the file.
  safetensors::Limits limits;
};

namespace detail {

inline constexpr const char* kOptimizerKey = "optimizer";

/// `v` as the shortest decimal text that reads back as the same double
/// ("0.999", "1e-08"; std::to_chars, independent of the locale).
inline std::string exact_number(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

/// The metadata value `key` of `file`; FormatError naming it if absent.
inline const std::string& metadata_at(const std::string& where, const safetensors::Reader& file,
                                      const std::string& key) {
  const auto it = file.metadata().find(key);
  if (it == file.metadata().end())
    throw FormatError(where + ": the file's metadata has no '" + key + "' (not an AdamW state file?)");
  return it->second;
}

/// Parses the whole of `text` as a `V` (std::from_chars); FormatError naming `key` otherwise.
template <class V>
V parse_metadata(const std::string& where, const std::string& key, const std::string& text) {
  V v{};
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size())
    throw FormatError(where + ": metadata '" + key + "' is " + safetensors::quote_name(text) + ", not a number");
  return v;
}

/// The decay flags a file's `no_decay` list gives `params`; FormatError for
/// a list that is not a JSON array of strings or names no parameter.
template <class T>
std::vector<bool> file_decay_flags(const std::string& where, const std::string& text, const ParamList<T>& params) {
  io::detail::require_no_nul(text, where + ": metadata 'no_decay'");  // nlohmann/json would stop at it
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  bool strings = j.is_array();
  for (std::size_t i = 0; strings && i < j.size(); ++i) strings = j[i].is_string();
  if (!strings) throw FormatError(where + ": metadata 'no_decay' is not a JSON array of parameter names");
  std::set<std::string> no_decay;
  for (const auto& name : j) no_decay.insert(name.get<std::string>());
  std::vector<bool> decay;
  for (const auto& p : params) decay.push_back(no_decay.erase(p.name) == 0);
  if (!no_decay.empty())
    throw FormatError(where + ": metadata 'no_decay' names " + safetensors::quote_name(*no_decay.begin()) +
                      ", which is not a parameter");
  return decay;
}

/// FormatError unless `file` says it holds an AdamW state.
inline void require_adamw_file(const std::string& where, const safetensors::Reader& file) {
  const std::string& kind = metadata_at(where, file, kOptimizerKey);
  if (kind != "AdamW")
    throw FormatError(where + ": the file holds the state of " + safetensors::quote_name(kind) + ", not of AdamW");
}

/// The options and step of a state file, its `no_decay` list as flags.
template <class T>
AdamWState<T> read_state_metadata(const std::string& where, const safetensors::Reader& file,
                                  const ParamList<T>& params) {
  AdamWState<T> s;
  const auto number = [&](const char* key) { return parse_metadata<double>(where, key, metadata_at(where, file, key)); };
  s.options.beta1 = number("beta1");
  s.options.beta2 = number("beta2");
  s.options.eps = number("eps");
  s.options.weight_decay = number("weight_decay");
  const long long step = parse_metadata<long long>(where, "step", metadata_at(where, file, "step"));
  if (step < 0) throw FormatError(where + ": metadata 'step' is " + std::to_string(step) + ", expected >= 0");
  s.step = long(step);
  s.decay = file_decay_flags(where, metadata_at(where, file, "no_decay"), params);
  return s;
}

/// ConfigError naming the first option or decay flag in which `file`
/// differs from `opt`'s.
template <class T>
void require_same_options(const std::string& where, const AdamWState<T>& file, const AdamW<T>& opt) {
  const AdamWOptions& a = file.options;
  const AdamWOptions& b = opt.options();
  const std::pair<const char*, std::pair<double, double>> fields[] = {
      {"beta1", {a.beta1, b.beta1}}, {"beta2", {a.beta2, b.beta2}},
      {"eps", {a.eps, b.eps}}, {"weight_decay", {a.weight_decay, b.weight_decay}}};
  const std::string hint = " (set take_file_options to adopt the file's)";
  for (const auto& [field, v] : fields)
    if (!(v.first == v.second))
      throw ConfigError(where + ": " + field + " is " + exact_number(v.first) + " in the file, " +
                        exact_number(v.second) + " in the optimiser" + hint);
  for (std::size_t i = 0; i < opt.params().size(); ++i)
    if (file.decay[i] != opt.decays(i))
      throw ConfigError(where + ": no_decay: the optimiser " + (opt.decays(i) ? "decays " : "does not decay ") +
                        safetensors::quote_name(opt.params()[i].name) + ", the file " +
                        (file.decay[i] ? "does" : "does not") + hint);
}

/// The two tensor names of every parameter, in order: m then v.
template <class T>
std::vector<std::string> state_tensor_names(const ParamList<T>& params) {
  std::vector<std::string> names;
  for (const auto& p : params) {
    names.push_back(p.name + ".exp_avg");
    names.push_back(p.name + ".exp_avg_sq");
  }
  return names;
}

/// FormatError for missing or unexpected tensors or another dtype than T's,
/// ShapeError for tensors of another shape than their parameter (leading 1s
/// aside, as load_checkpoint), each naming every offending tensor.
template <class T>
void require_state_tensors(const std::string& where, const safetensors::Reader& file, const ParamList<T>& params,
                           const std::vector<std::string>& names) {
  const std::set<std::string> wanted(names.begin(), names.end());
  std::vector<std::string> missing, unexpected, bad_dtype, bad_shape;
  for (std::size_t k = 0; k < names.size(); ++k) {
    const safetensors::TensorInfo* t = file.header().find(names[k]);
    if (!t) {
      missing.push_back(names[k]);
      continue;
    }
    if (t->dtype != safetensors::dtype_of<T>())
      bad_dtype.push_back(names[k] + " (" + safetensors::dtype_name(t->dtype) + ")");
    const Param<T>& p = params[k / 2];
    const std::vector<std::uint64_t> want{std::uint64_t(p.rows), std::uint64_t(p.cols)};
    if (drop_leading_ones(t->shape) != drop_leading_ones(want))
      bad_shape.push_back(safetensors::quote_name(names[k]) + " is " + safetensors::shape_string(t->shape) +
                          " in the file, the parameter " + safetensors::shape_string(want));
  }
  for (const auto& t : file.tensors())
    if (!wanted.count(t.name)) unexpected.push_back(t.name);
  if (!missing.empty() || !unexpected.empty()) {
    std::string msg = where + ": the file does not match the optimiser's parameters:";
    if (!missing.empty()) msg += " missing " + name_list(missing) + ";";
    if (!unexpected.empty()) msg += " unexpected " + name_list(unexpected) + ";";
    throw FormatError(msg);
  }
  if (!bad_dtype.empty())
    throw FormatError(where + ": the state of an AdamW<" + scalar_name<T>() + "> loads only from " +
                      safetensors::dtype_name(safetensors::dtype_of<T>()) + " tensors: " + name_list(bad_dtype));
  if (!bad_shape.empty()) {
    std::string msg = where + ": shape mismatch:";
    for (std::size_t i = 0; i < bad_shape.size() && i < 12; ++i) msg += (i ? "; " : " ") + bad_shape[i];
    if (bad_shape.size() > 12) msg += "; and " + std::to_string(bad_shape.size() - 12) + " more";
    throw ShapeError(msg);
  }
}

/// ValueError for what the load refuses: duplicate parameter names (the file
/// is keyed by name) or moments that fail its value rule (require_valid_moments).
template <class T>
void require_savable_state(const AdamW<T>& opt) {
  check_unique_names("save_optimizer_state", opt.params());
  for (std::size_t i = 0; i < opt.params().size(); ++i)
    require_valid_moments("save_optimizer_state", opt.params()[i], opt.exp_avg(i), opt.exp_avg_sq(i));
}

/// write_optimizer_state once require_savable_state has passed.
template <class T>
void write_checked_state(safetensors::ByteSink& out, const AdamW<T>& opt) {
  const ParamList<T>& params = opt.params();
  const std::vector<std::string> names = state_tensor_names(params);
  std::vector<safetensors::TensorRef<T>> tensors;
  std::vector<std::string> no_decay;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::vector<std::uint64_t> shape{std::uint64_t(params[i].rows), std::uint64_t(params[i].cols)};
    tensors.push_back({names[2 * i], shape, opt.exp_avg(i).data()});
    tensors.push_back({names[2 * i + 1], shape, opt.exp_avg_sq(i).data()});
    if (!opt.decays(i)) no_decay.push_back(params[i].name);
  }
  const AdamWOptions& o = opt.options();
  safetensors::Metadata meta{{detail::kOptimizerKey, "AdamW"},
                             {"step", std::to_string(opt.steps())},
                             {"beta1", detail::exact_number(o.beta1)},
                             {"beta2", detail::exact_number(o.beta2)},
                             {"eps", detail::exact_number(o.eps)},
                             {"weight_decay", detail::exact_number(o.weight_decay)}};
  try {
    meta["no_decay"] = nlohmann::json(no_decay).dump();
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(std::string("save_optimizer_state: a parameter name is not valid UTF-8: ") + e.what());
  }
  safetensors::write(out, tensors, safetensors::dtype_of<T>(), meta);
}

}  // namespace detail

/// Serialises `opt`'s state to `out` (layout in the file comment). ValueError
/// for duplicate parameter names (the file is keyed by name), names that are
/// not valid UTF-8, or moments the load refuses (NaN, Inf, a negative v).
template <class T>
void write_optimizer_state(safetensors::ByteSink& out, const AdamW<T>& opt) {
  detail::require_savable_state(opt);
  detail::write_checked_state(out, opt);
}

/// Saves `opt`'s state to `path` atomically. FormatError on I/O failure,
/// plus the errors of write_optimizer_state (raised before any file is made).
template <class T>
void save_optimizer_state(const std::string& path, const AdamW<T>& opt) {
  detail::require_savable_state(opt);  // before the temporary file: the previous one stays as it was
  safetensors::write_file_atomic(path, [&](safetensors::ByteSink& out) { detail::write_checked_state(out, opt); });
}

/// Loads `opt`'s state from a validated file, all or nothing. FormatError
/// for a file that is not an AdamW state, malformed metadata, missing or
/// unexpected tensors, or a dtype other than the optimiser's; ShapeError
/// naming each tensor of another shape than its parameter (leading 1s
/// aside, as load_checkpoint); ConfigError naming an option that differs
/// (unless take_file_options); ValueError for a NaN, Inf or negative v in
/// the moments. The optimiser is unchanged by any of them.
template <class T>
void load_optimizer_state(const safetensors::Reader& file, AdamW<T>& opt, const OptimizerStateOptions& options = {}) {
  const std::string where = "load_optimizer_state(" + file.source().description() + ")";
  const ParamList<T>& params = opt.params();
  detail::check_unique_names("load_optimizer_state", params);
  detail::require_adamw_file(where, file);
  const std::vector<std::string> names = detail::state_tensor_names(params);
  detail::require_state_tensors(where, file, params, names);

  AdamWState<T> s = detail::read_state_metadata(where, file, params);
  if (options.take_file_options) {
    check_adamw_options<T>(s.options, where.c_str());
  } else {
    detail::require_same_options(where, s, opt);
    s.options = opt.options();  // equal; keeps a -0.0 the optimiser was given
  }

  for (std::size_t i = 0; i < params.size(); ++i) {
    s.exp_avg.emplace_back(params[i].rows, params[i].cols);
    s.exp_avg_sq.emplace_back(params[i].rows, params[i].cols);
    file.read(file.at(names[2 * i]), s.exp_avg.back().data());
    file.read(file.at(names[2 * i + 1]), s.exp_avg_sq.back().data());
  }
  try {
    opt.restore(std::move(s));  // checks the values, then commits
  } catch (const ValueError& e) {
    throw ValueError(where + ": " + e.what());
  }
}

/// Opens, validates and loads `path` (see the overload above). FormatError
/// for an unreadable or malformed file.
template <class T>
void load_optimizer_state(const std::string& path, AdamW<T>& opt, const OptimizerStateOptions& options = {}) {
  const safetensors::Reader file(path, options.limits);
  load_optimizer_state(file, opt, options);
}

}  // namespace apex
