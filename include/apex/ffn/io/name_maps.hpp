#pragma once
/// \file io/name_maps.hpp
/// Checkpoints of an MoEFFN (or any layer with its `config()`,
/// `param_values()`, `params()` and `balancer()`) under the Hugging Face
/// tensor names of an open MoE family (io/family_names.hpp has the names;
/// docs/routing.md#checkpoints), on top of io/checkpoint.hpp: the layer's
/// `param_values()` renamed, plus the balancing bias where the family stores
/// one (DeepSeek-V3's `e_score_correction_bias`, kept as stored). A family
/// checkpoint is one safetensors file or a Hugging Face sharded folder
/// (`model.safetensors.index.json`), as the families publish their models.
/// Strict by default, as load_checkpoint, and as it a rejected load leaves
/// the layer as it was.
///
/// `prefix` is the layer's path in a whole-model file, e.g. "model.layers.3.";
/// load such a file with `allow_unexpected` for the other layers' tensors.

#include <set>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "family_names.hpp"
#include "sharded_checkpoint.hpp"
#include "../core/errors.hpp"
#include "../moe/families.hpp"
#include "../moe/config.hpp"
#include "../optim/non_finite.hpp"

namespace apex {

namespace detail {

/// check_family_names over a safetensors file's tensor names.
inline void check_family_file(const std::string& where, const safetensors::Reader& file, MoEFamily f,
                              const std::string& prefix) {
  check_family_names(
      where,
      [&](const std::string& start) {
        for (const auto& t : file.tensors())
          if (t.name.rfind(start, 0) == 0) return true;
        return false;
      },
      [&](const std::string& name) { return file.header().find(name) != nullptr; }, f, prefix);
}

/// check_family_names over the names of a shard index's weight map.
inline void check_family_index(const std::string& where, const ShardIndex& index, MoEFamily f,
                               const std::string& prefix) {
  check_family_names(
      where,
      [&](const std::string& start) {
        auto it = index.weight_map.lower_bound(start);  // sorted: the first name >= start
        return it != index.weight_map.end() && it->first.rfind(start, 0) == 0;
      },
      [&](const std::string& name) { return index.weight_map.count(name) > 0; }, f, prefix);
}

/// FormatError naming the first tensor of the index under `prefix` that
/// none of `params` (nor the bias) names: the strict rule of a one-file
/// load, applied to the index, since the shards are read only for the
/// tensors the layer names.
template <class T>
void check_no_unexpected(const std::string& where, const ShardIndex& index, const ParamList<T>& params,
                         const std::string& prefix, const std::string& bias_name) {
  std::set<std::string> known{bias_name};
  for (const auto& p : params) known.insert(p.name);
  for (auto it = index.weight_map.lower_bound(prefix); it != index.weight_map.end(); ++it) {
    if (it->first.rfind(prefix, 0) != 0) break;
    if (!known.count(it->first))
      throw FormatError(where + ": unexpected tensor " + safetensors::quote_name(it->first) + " under prefix '" +
                        prefix + "' (LoadOptions::allow_unexpected to ignore the other layers' tensors)");
  }
}

}  // namespace detail

namespace detail {
/// `list` (the layer's params() or param_values()) under the family's names.
template <class T>
ParamList<T> renamed(ParamList<T> list, MoEFamily f, const std::string& prefix) {
  for (auto& p : list) p.name = prefix + family_tensor_name(f, p.name);
  return list;
}

/// The loads' value rule for the balancing bias (LoadBalancer::set_bias's),
/// which the save applies to the bias as `stored` (empty: as it is) holds it.
template <class T>
void require_finite_bias(const std::string& where, const std::string& name, const T* checked, const T* shown, Index n,
                         const std::string& stored) {
  require_finite_values(where, "tensor " + safetensors::quote_name(name), checked, shown, n, 0,
                        "the balancer's bias must be finite" + (stored.empty() ? "" : " as " + stored + " stores it"));
}
}  // namespace detail

/// The layer's parameters with their gradients (MoEFFN::params, which
/// allocates them) under the family's names (prefix prepended). ConfigError
/// if the layer's shared experts do not fit the family or an expert has a
/// parameter the family lacks.
template <class Layer, class T = typename Layer::Scalar>
ParamList<T> family_params(Layer& moe, MoEFamily f, const std::string& prefix = "") {
  check_family_fit("family_params", moe.config(), f);
  return detail::renamed(moe.params(), f, prefix);
}

/// As family_params, values only (MoEFFN::param_values): never allocates
/// gradients. What the family checkpoints below read and write.
template <class Layer, class T = typename Layer::Scalar>
ParamList<T> family_param_values(Layer& moe, MoEFamily f, const std::string& prefix = "") {
  check_family_fit("family_param_values", moe.config(), f);
  return detail::renamed(moe.param_values(), f, prefix);
}

/// Saves the layer under the family's names; DeepSeek-V3 adds the balancing
/// bias as `mlp.gate.e_score_correction_bias` of shape [E]. ValueError,
/// before any file is made, for a bias the load refuses: not finite as
/// `options.dtype` stores it (a double bias beyond float's range as F32).
template <class Layer, class T = typename Layer::Scalar>
void save_family_checkpoint(const std::string& path, Layer& moe, MoEFamily f,
                            const std::string& prefix = "", SaveOptions options = {}) {
  ParamList<T> params = family_param_values(moe, f, prefix);
  RowVector<T> bias = moe.balancer().bias();  // 1 × E
  const std::string name = family_bias_name(f, prefix);
  if (!name.empty()) {
    const safetensors::DType dtype = options.dtype.value_or(safetensors::dtype_of<T>());
    if (safetensors::is_float_convertible(dtype))  // else save_checkpoint refuses the dtype
      detail::require_finite_bias("save_family_checkpoint", name,
                                  safetensors::detail::as_stored(dtype, bias.data(), std::size_t(bias.cols())).data(),
                                  bias.data(), bias.cols(), safetensors::dtype_name(dtype));
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
  require_finite_bias(where, name, bias.data(), bias.data(), bias.cols(), "");
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
  const std::string bias_name = family_bias_name(f, prefix);
  ParamList<T> params = family_param_values(moe, f, prefix);
  RowVector<T> bias = moe.balancer().bias();
  const bool has_bias = !bias_name.empty() && detail::read_family_bias(where, file, bias_name, bias, options);
  // Named in the full load too, so the strict name match counts it (it reads the same values again).
  if (!bias_name.empty()) params.push_back(Param<T>{bias_name, bias.data(), nullptr, 1, bias.cols()});
  LoadResult r = load_checkpoint(file, params, options);
  if (has_bias) moe.balancer().set_bias(bias);  // shape and values checked above: cannot throw
  return r;
}

/// Loads a family checkpoint from `path`: one safetensors file, or a Hugging
/// Face sharded checkpoint (its folder or its `model.safetensors.index.json`),
/// each shard read for the tensors the index places in it. The checks and
/// all-or-nothing rule of the file overload; a sharded load stages every
/// tensor first (transient memory: one copy of the layer's values).
template <class Layer, class T = typename Layer::Scalar>
LoadResult load_family_checkpoint(const std::string& path, Layer& moe, MoEFamily f,
                                  const std::string& prefix = "", const LoadOptions& options = {}) {
  if (!detail::is_sharded_path(path)) {
    const safetensors::Reader file(path, options.limits);
    return load_family_checkpoint(file, moe, f, prefix, options);
  }
  const std::string index_path = shard_index_path(path);
  const ShardIndex index = read_shard_index(index_path, options.limits);
  const std::string where = "load_family_checkpoint('" + index_path + "')";
  detail::check_family_index(where, index, f, prefix);
  ParamList<T> params = family_param_values(moe, f, prefix);
  if (!options.allow_unexpected) detail::check_no_unexpected(where, index, params, prefix, family_bias_name(f, prefix));
  RowVector<T> bias = moe.balancer().bias();  // 1 × E
  const std::string bias_name = family_bias_name(f, prefix);
  const bool has_bias = !bias_name.empty() && index.weight_map.count(bias_name) > 0;
  if (has_bias) params.push_back(Param<T>{bias_name, bias.data(), nullptr, 1, bias.cols()});
  const detail::Staged<T> staged(params);
  LoadResult r = detail::load_shards_into(index_path, index, staged.views, options);
  if (has_bias) {
    const auto& b = staged.values.back();
    detail::require_finite_bias(where, bias_name, b.data(), b.data(), Index(b.size()), "");
  }
  staged.commit(params, r.loaded);  // every check passed: nothing below throws
  if (has_bias) moe.balancer().set_bias(bias);
  return r;
}

}  // namespace apex
