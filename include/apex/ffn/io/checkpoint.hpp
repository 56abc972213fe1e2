#pragma once
/// \file io/checkpoint.hpp
/// Checkpoints of any layer or model: its parameter list saved to and
/// loaded from a safetensors file, one tensor per parameter under the name
/// PyTorch's `state_dict` gives it (`router.weight`,
/// `experts.3.w_gate.weight`, …), so a file moves between apex-ffn and
/// PyTorch unchanged.
///
///     apex::save_checkpoint("moe.safetensors", moe.param_values());    // F64 for a double layer
///     apex::save_checkpoint("moe.bf16.safetensors", moe.param_values(), {apex::safetensors::DType::BF16});
///     apex::load_checkpoint("moe.safetensors", moe.param_values());    // strict: names, shapes, dtypes
///
/// Pass `param_values()`, the values-only view: a checkpoint reads and
/// writes values only, and `params()` would allocate the layer's gradients
/// (core/param.hpp), doubling the memory of a layer that is only loaded to serve.
/// Either list works; only values are touched.
///
/// Saves are atomic (safetensors::write_file_atomic). Loads validate the
/// whole file and match every name, dtype and shape before the first
/// parameter is written, so a rejected file leaves the layer as it was.
///
/// State that is not a parameter (the MoE balancing bias) can travel in the
/// same file: append a values-only `Param` (`grad_data` nullptr) viewing a
/// buffer of it to the list, then apply the buffer after loading.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "../core/param.hpp"
#include "safetensors.hpp"
#include "../core/types.hpp"

namespace apex {

/// How save_checkpoint writes.
struct SaveOptions {
  /// On-disk dtype: F32, F64 or BF16 (rounded to nearest even). Unset: the
  /// layer's own scalar type, which round-trips exactly.
  std::optional<safetensors::DType> dtype;
  /// Strings stored under `__metadata__` (e.g. {"format", "pt"}).
  safetensors::Metadata metadata;
  /// On-disk shape of a parameter where `[rows, cols]` is not what PyTorch
  /// expects, e.g. `{"norm.weight", {d}}` for a 1-D gain held as 1 × d.
  /// The element count must be the same.
  std::map<std::string, std::vector<std::uint64_t>> shapes;
};

/// How load_checkpoint matches a file to a parameter list.
struct LoadOptions {
  /// Ignore tensors the list does not name (PyTorch `strict=False`, one half).
  bool allow_unexpected = false;
  /// Leave parameters the file lacks unchanged (the other half).
  bool allow_missing = false;
  /// Caps applied while reading the file.
  safetensors::Limits limits;
};

/// What load_checkpoint did.
struct LoadResult {
  std::vector<std::string> loaded;      ///< parameters read from the file
  std::vector<std::string> missing;     ///< parameters the file lacks (only with allow_missing)
  std::vector<std::string> unexpected;  ///< file tensors no parameter names (only with allow_unexpected)
  safetensors::Metadata metadata;       ///< the file's `__metadata__`
};

namespace detail {

/// "'a', 'b', 'c' and 7 more": bounded, since the names come from a file.
inline std::string name_list(const std::vector<std::string>& names) {
  constexpr std::size_t kShown = 12;
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) s += (i ? ", " : "") + safetensors::quote_name(names[i]);
  if (names.size() > kShown) s += " and " + std::to_string(names.size() - kShown) + " more";
  return s;
}

/// Dimensions with the leading 1s dropped: `[1, d]`, `[d]` and a 1 × d
/// parameter are the same tensor (PyTorch keeps biases and gains 1-D).
inline std::vector<std::uint64_t> drop_leading_ones(std::vector<std::uint64_t> s) {
  std::size_t i = 0;
  while (i < s.size() && s[i] == 1) ++i;
  s.erase(s.begin(), s.begin() + std::ptrdiff_t(i));
  return s;
}

template <class T>
void check_unique_names(const char* where, const ParamList<T>& params) {
  std::set<std::string> seen;
  for (const auto& p : params)
    if (!seen.insert(p.name).second)
      throw ValueError(std::string(where) + ": the parameter list names " + safetensors::quote_name(p.name) +
                       " twice");
}

}  // namespace detail

/// Serialises `params` (values only) to `out`. Throws ValueError on a
/// duplicate or reserved name, an unknown name in `options.shapes`, or an
/// unsupported dtype; ShapeError on a shape override of the wrong size.
template <class T>
void write_checkpoint(safetensors::ByteSink& out, const ParamList<T>& params, const SaveOptions& options = {}) {
  constexpr const char* where = "save_checkpoint";
  detail::check_unique_names(where, params);
  std::vector<safetensors::TensorRef<T>> tensors;
  tensors.reserve(params.size());
  std::size_t overrides_used = 0;
  for (const auto& p : params) {
    std::vector<std::uint64_t> shape{std::uint64_t(p.rows), std::uint64_t(p.cols)};
    if (auto it = options.shapes.find(p.name); it != options.shapes.end()) {
      std::uint64_t n = 1;
      for (auto s : it->second) n *= s;
      if (n != std::uint64_t(p.size()))
        throw ShapeError(std::string(where) + ": shape override " + safetensors::shape_string(it->second) + " of " +
                         safetensors::quote_name(p.name) + " has " + std::to_string(n) +
                         " elements, the parameter " + std::to_string(p.size()));
      shape = it->second;
      ++overrides_used;
    }
    tensors.push_back({p.name, std::move(shape), p.value_data});
  }
  if (overrides_used != options.shapes.size())
    for (const auto& [name, shape] : options.shapes) {
      bool found = false;
      for (const auto& p : params) found = found || p.name == name;
      if (!found)
        throw ValueError(std::string(where) + ": shape override for " + safetensors::quote_name(name) +
                         ", which is not a parameter");
    }
  safetensors::write(out, tensors, options.dtype.value_or(safetensors::dtype_of<T>()), options.metadata);
}

/// Saves `params` to `path` atomically: the previous file stays intact
/// unless the new one is complete and durable. Throws FormatError on I/O
/// failure, plus the errors of write_checkpoint.
template <class T>
void save_checkpoint(const std::string& path, const ParamList<T>& params, const SaveOptions& options = {}) {
  safetensors::write_file_atomic(path, [&](safetensors::ByteSink& out) { write_checkpoint(out, params, options); });
}

/// Loads `params` from a validated file. Every parameter must have a tensor
/// of the same name (unless allow_missing), every tensor a parameter (unless
/// allow_unexpected), each of dtype F32, F64 or BF16 and of the parameter's
/// shape (leading 1s aside). Violations throw FormatError (names, dtypes)
/// or ShapeError (shapes) naming every offending tensor, before any
/// parameter is written.
template <class T>
LoadResult load_checkpoint(const safetensors::Reader& file, const ParamList<T>& params,
                           const LoadOptions& options = {}) {
  const std::string where = "load_checkpoint(" + file.source().description() + ")";
  detail::check_unique_names("load_checkpoint", params);
  LoadResult result;
  result.metadata = file.metadata();
  std::vector<std::pair<const Param<T>*, const safetensors::TensorInfo*>> plan;
  std::vector<std::string> bad_dtype, bad_shape;
  std::set<std::string> wanted;
  for (const auto& p : params) {
    wanted.insert(p.name);
    const safetensors::TensorInfo* t = file.header().find(p.name);
    if (!t) {
      result.missing.push_back(p.name);
      continue;
    }
    if (!safetensors::is_float_convertible(t->dtype))
      bad_dtype.push_back(p.name + " (" + safetensors::dtype_name(t->dtype) + ")");
    const std::vector<std::uint64_t> want{std::uint64_t(p.rows), std::uint64_t(p.cols)};
    if (detail::drop_leading_ones(t->shape) != detail::drop_leading_ones(want))
      bad_shape.push_back(safetensors::quote_name(p.name) + " is " + safetensors::shape_string(t->shape) +
                          " in the file, the parameter " + safetensors::shape_string(want));
    plan.emplace_back(&p, t);
  }
  for (const auto& t : file.tensors())
    if (!wanted.count(t.name)) result.unexpected.push_back(t.name);

  const bool missing_bad = !result.missing.empty() && !options.allow_missing;
  const bool unexpected_bad = !result.unexpected.empty() && !options.allow_unexpected;
  if (missing_bad || unexpected_bad) {
    std::string msg = where + ": the file does not match the parameters:";
    if (missing_bad) msg += " missing " + detail::name_list(result.missing) + ";";
    if (unexpected_bad) msg += " unexpected " + detail::name_list(result.unexpected) + ";";
    throw FormatError(msg);
  }
  if (!bad_dtype.empty())
    throw FormatError(where + ": only F32, F64 and BF16 tensors load into parameters: " +
                      detail::name_list(bad_dtype));
  if (!bad_shape.empty()) {
    std::string msg = where + ": shape mismatch:";
    for (std::size_t i = 0; i < bad_shape.size() && i < 12; ++i) msg += (i ? "; " : " ") + bad_shape[i];
    if (bad_shape.size() > 12) msg += "; and " + std::to_string(bad_shape.size() - 12) + " more";
    throw ShapeError(msg);
  }
  for (const auto& [p, t] : plan) {
    file.read(*t, p->value_data);
    result.loaded.push_back(p->name);
  }
  return result;
}

/// Opens, validates and loads `path` (see the overload above). Throws
/// FormatError for an unreadable or malformed file.
template <class T>
LoadResult load_checkpoint(const std::string& path, const ParamList<T>& params, const LoadOptions& options = {}) {
  const safetensors::Reader file(path, options.limits);
  return load_checkpoint(file, params, options);
}

}  // namespace apex
