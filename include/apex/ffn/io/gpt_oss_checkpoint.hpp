#pragma once
/// \file io/gpt_oss_checkpoint.hpp
/// Checkpoints of a gpt-oss MoE block (GptOssMoE, moe/gpt_oss.hpp) under
/// Hugging Face's names (docs/routing.md#gpt-oss-checkpoints). Unlike the other
/// families (io/name_maps.hpp), gpt-oss stores its experts fused, one tensor
/// per kind for all E experts, in × out, with gate and up interleaved:
///
///     HF name (under prefix)             shape         apex parameters
///     mlp.router.weight                  [E, d]        router.weight (E × d)
///     mlp.router.bias                    [E]           router.bias (1 × E)
///     mlp.experts.gate_up_proj           [E, d, 2f]    column 2j: experts.e.w_gate.weight row j, 2j+1: w_up
///     mlp.experts.gate_up_proj_bias      [E, 2f]       2j: experts.e.w_gate.bias, 2j+1: w_up.bias
///     mlp.experts.down_proj              [E, f, d]     experts.e.w_down.weight transposed (d × f)
///     mlp.experts.down_proj_bias         [E, d]        experts.e.w_down.bias
///
/// or, as openai publishes the models, the two expert weights in MXFP4:
/// `<w>_blocks` U8 [E, R, in/32, 16] and `<w>_scales` U8 [E, R, in/32]
/// (R = output rows: 2f for gate_up, d for down; byte j of a 32-block holds
/// element 2j in its low nibble, 2j+1 in its high; value FP4[code]·2^(s−127)),
/// dequantized exactly into T (quant/blocks.hpp's value table, quant/half.hpp's
/// E8M0 scale). Biases and router load as stored (F32, F64 or BF16).
///
/// A load checks everything — names, both forms present, dtypes, shapes,
/// MXFP4 dims, NaN/Inf, the layer's config — before the first write: a
/// rejected load leaves the layer as it was (transient memory: one copy of
/// the block's values in T, plus the MXFP4 bytes). A save writes the dense names
/// atomically (io/checkpoint.hpp), so PyTorch / transformers load the file.

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "sharded_checkpoint.hpp"
#include "../core/errors.hpp"
#include "../moe/gpt_oss.hpp"
#include "gpt_oss_layout.hpp"

namespace apex {

namespace detail {

/// The layer's parameter list by name.
template <class T>
std::map<std::string, Param<T>> gpt_oss_by_name(const ParamList<T>& list) {
  std::map<std::string, Param<T>> m;
  for (const auto& p : list) m.emplace(p.name, p);
  return m;
}

inline std::string gpt_oss_expert(Index e, const char* what) { return "experts." + std::to_string(e) + "." + what; }

}  // namespace detail

/// The layer's values (or, with `grads`, its gradients, which must exist)
/// in Hugging Face's fused layout: what a save writes, and what a test
/// compares with a reference's gradients.
template <class T>
detail::GptOssFused<T> gpt_oss_fused(GptOssMoE<T>& moe, bool grads = false) {
  const MoEConfig& c = moe.config();
  const Index d = c.d_model, f = c.d_ffn, E = c.n_experts;
  const auto p = detail::gpt_oss_by_name(grads ? moe.params() : moe.param_values());
  auto m = [&](const std::string& n) { return grads ? p.at(n).grad() : p.at(n).value(); };
  detail::GptOssFused<T> h;
  const auto rw = m("router.weight");  // E × d
  h.router_w.assign(rw.data(), rw.data() + E * d);
  const auto rb = m("router.bias");  // 1 × E
  h.router_b.assign(rb.data(), rb.data() + E);
  h.gate_up.resize(std::size_t(E * d * 2 * f)), h.gate_up_b.resize(std::size_t(E * 2 * f));
  h.down.resize(std::size_t(E * f * d)), h.down_b.resize(std::size_t(E * d));
  for (Index e = 0; e < E; ++e) {
    const auto wg = m(detail::gpt_oss_expert(e, "w_gate.weight")), wu = m(detail::gpt_oss_expert(e, "w_up.weight"));
    const auto wd = m(detail::gpt_oss_expert(e, "w_down.weight"));  // f × d, f × d, d × f
    const auto bg = m(detail::gpt_oss_expert(e, "w_gate.bias")), bu = m(detail::gpt_oss_expert(e, "w_up.bias"));
    const auto bd = m(detail::gpt_oss_expert(e, "w_down.bias"));  // 1 × f, 1 × f, 1 × d
    for (Index i = 0; i < d; ++i)
      for (Index j = 0; j < f; ++j) {
        h.gate_up[std::size_t((e * d + i) * 2 * f + 2 * j)] = wg(j, i);
        h.gate_up[std::size_t((e * d + i) * 2 * f + 2 * j + 1)] = wu(j, i);
        h.down[std::size_t((e * f + j) * d + i)] = wd(i, j);
      }
    for (Index j = 0; j < f; ++j)
      h.gate_up_b[std::size_t(e * 2 * f + 2 * j)] = bg(0, j), h.gate_up_b[std::size_t(e * 2 * f + 2 * j + 1)] = bu(0, j);
    for (Index i = 0; i < d; ++i) h.down_b[std::size_t(e * d + i)] = bd(0, i);
  }
  return h;
}

namespace detail {

/// Writes Hugging Face's fused tensors into the layer: the inverse of gpt_oss_fused. Cannot throw.
template <class T>
void commit_gpt_oss(const GptOssFused<T>& h, GptOssMoE<T>& moe) {
  const MoEConfig& c = moe.config();
  const Index d = c.d_model, f = c.d_ffn, E = c.n_experts;
  const auto p = gpt_oss_by_name(moe.param_values());
  auto m = [&](const std::string& n) { return p.at(n).value(); };
  std::copy(h.router_w.begin(), h.router_w.end(), m("router.weight").data());
  std::copy(h.router_b.begin(), h.router_b.end(), m("router.bias").data());
  for (Index e = 0; e < E; ++e) {
    auto wg = m(gpt_oss_expert(e, "w_gate.weight")), wu = m(gpt_oss_expert(e, "w_up.weight"));
    auto wd = m(gpt_oss_expert(e, "w_down.weight"));
    auto bg = m(gpt_oss_expert(e, "w_gate.bias")), bu = m(gpt_oss_expert(e, "w_up.bias"));
    auto bd = m(gpt_oss_expert(e, "w_down.bias"));
    for (Index i = 0; i < d; ++i)
      for (Index j = 0; j < f; ++j) {
        wg(j, i) = h.gate_up[std::size_t((e * d + i) * 2 * f + 2 * j)];
        wu(j, i) = h.gate_up[std::size_t((e * d + i) * 2 * f + 2 * j + 1)];
        wd(i, j) = h.down[std::size_t((e * f + j) * d + i)];
      }
    for (Index j = 0; j < f; ++j)
      bg(0, j) = h.gate_up_b[std::size_t(e * 2 * f + 2 * j)], bu(0, j) = h.gate_up_b[std::size_t(e * 2 * f + 2 * j + 1)];
    for (Index i = 0; i < d; ++i) bd(0, i) = h.down_b[std::size_t(e * d + i)];
  }
}

/// One expert weight (dense or MXFP4) checked (check_gpt_oss_weight) and
/// read into Hugging Face's layout E × in × R.
template <class T>
std::vector<T> read_gpt_oss_weight(const GptOssSource& s, const std::string& name, Index E, Index in, Index R,
                                   std::set<std::string>& used) {
  if (!check_gpt_oss_weight(s, name, E, in, R, used)) {
    std::vector<T> v = s.read<T>(name);
    check_gpt_oss_finite(s.where, name, v);
    return v;
  }
  return dequantize_gpt_oss<T>(s, name, E, R, in);  // finite floats: gpt_oss_block checks each block
}

/// A bias or the router's weight: checked, read, finite.
template <class T>
std::vector<T> read_gpt_oss_dense(const GptOssSource& s, const std::string& name, const Shape& want,
                                  std::set<std::string>& used) {
  check_gpt_oss_dense(s, name, want);
  used.insert(name);
  std::vector<T> v = s.read<T>(name);
  check_gpt_oss_finite(s.where, name, v);
  return v;
}

/// Every check and read of a load, then the commit.
template <class T>
LoadResult load_gpt_oss(const GptOssSource& s, GptOssMoE<T>& moe, const std::string& prefix,
                        const LoadOptions& options, const safetensors::Metadata& metadata) {
  namespace nm = gpt_oss_names;
  check_gpt_oss_config(s.where.c_str(), moe.config());
  const Index d = moe.config().d_model, f = moe.config().d_ffn, E = moe.config().n_experts;
  const std::uint64_t ud = std::uint64_t(d), uf = std::uint64_t(f), uE = std::uint64_t(E);
  std::set<std::string> used;
  GptOssFused<T> h;
  h.router_w = read_gpt_oss_dense<T>(s, prefix + nm::kRouterWeight, {uE, ud}, used);
  h.router_b = read_gpt_oss_dense<T>(s, prefix + nm::kRouterBias, {uE}, used);
  h.gate_up = read_gpt_oss_weight<T>(s, prefix + nm::kGateUp, E, d, 2 * f, used);
  h.gate_up_b = read_gpt_oss_dense<T>(s, prefix + nm::kGateUpBias, {uE, 2 * uf}, used);
  h.down = read_gpt_oss_weight<T>(s, prefix + nm::kDown, E, f, d, used);
  h.down_b = read_gpt_oss_dense<T>(s, prefix + nm::kDownBias, {uE, ud}, used);
  LoadResult r;
  r.metadata = metadata;
  r.loaded.assign(used.begin(), used.end());
  r.unexpected = gpt_oss_unexpected(s, used, prefix, options.allow_unexpected);
  commit_gpt_oss(h, moe);  // every check passed: nothing below throws
  return r;
}

}  // namespace detail

/// Loads a gpt-oss block from a validated safetensors file (the table in
/// the file comment; `prefix` e.g. "model.layers.3."). Strict: every tensor
/// of the file must be one of the block's unless `options.allow_unexpected`
/// (`allow_missing` is not honoured: a block is loaded whole). Throws
/// ConfigError if the layer lacks router_bias or has shared experts;
/// FormatError naming the tensor if it is missing, stored both dense and as
/// MXFP4, of a wrong dtype, or unexpected; ShapeError naming the shape found
/// and wanted (and for MXFP4 widths not multiples of 32); ValueError for NaN
/// or Inf. All before the first write: a rejected load changes nothing.
template <class T>
LoadResult load_gpt_oss_checkpoint(const safetensors::Reader& file, GptOssMoE<T>& moe, const std::string& prefix = "",
                                   const LoadOptions& options = {}) {
  return detail::load_gpt_oss(detail::gpt_oss_source(file, prefix), moe, prefix, options, file.metadata());
}

/// Loads from `path`: one safetensors file, or a Hugging Face sharded
/// checkpoint (its folder or `model.safetensors.index.json`), each shard
/// holding tensors under `prefix` opened once. In a sharded load only the
/// index's names under `prefix` count as unexpected (the other layers'
/// tensors are in the same shards).
template <class T>
LoadResult load_gpt_oss_checkpoint(const std::string& path, GptOssMoE<T>& moe, const std::string& prefix = "",
                                   const LoadOptions& options = {}) {
  if (!detail::is_sharded_path(path)) {
    const safetensors::Reader file(path, options.limits);
    return load_gpt_oss_checkpoint(file, moe, prefix, options);
  }
  const std::string index_path = shard_index_path(path);
  const ShardIndex index = read_shard_index(index_path, options.limits);
  return detail::load_gpt_oss(detail::gpt_oss_source(index_path, index, prefix, options.limits), moe, prefix, options,
                              index.metadata);
}

/// Saves the block under the dense Hugging Face names (gate/up interleaved,
/// in × out) atomically, in `options.dtype` (default T: a bit-exact round
/// trip); metadata "format": "pt" unless `options.metadata` sets it.
/// ConfigError as the load for a layer that is not a gpt-oss block;
/// ValueError, before any file is made, for a value the load refuses: NaN
/// or Inf in the layer, or beyond the range of the dtype it is stored in.
template <class T>
void save_gpt_oss_checkpoint(const std::string& path, GptOssMoE<T>& moe, const std::string& prefix = "",
                             SaveOptions options = {}) {
  namespace nm = gpt_oss_names;
  detail::check_gpt_oss_config("save_gpt_oss_checkpoint", moe.config());
  const Index d = moe.config().d_model, f = moe.config().d_ffn, E = moe.config().n_experts;
  detail::GptOssFused<T> h = gpt_oss_fused(moe);
  const std::uint64_t ud = std::uint64_t(d), uf = std::uint64_t(f), uE = std::uint64_t(E);
  const safetensors::DType dtype = options.dtype.value_or(safetensors::dtype_of<T>());
  ParamList<T> list;
  auto add = [&](const char* name, std::vector<T>& v, detail::Shape shape) {
    list.push_back(Param<T>{prefix + name, v.data(), nullptr, 1, Index(v.size())});
    options.shapes[prefix + name] = std::move(shape);
    if (!safetensors::is_float_convertible(dtype)) return;  // save_checkpoint refuses the dtype
    const std::vector<T> stored = safetensors::detail::as_stored(dtype, v.data(), v.size());
    detail::require_finite_values("save_gpt_oss_checkpoint", "tensor " + safetensors::quote_name(prefix + name),
                                  stored.data(), v.data(), Index(v.size()), 0,
                                  std::string("as ") + safetensors::dtype_name(dtype) + " stores it; the load refuses it");
  };
  add(nm::kRouterWeight, h.router_w, {uE, ud});
  add(nm::kRouterBias, h.router_b, {uE});
  add(nm::kGateUp, h.gate_up, {uE, ud, 2 * uf});
  add(nm::kGateUpBias, h.gate_up_b, {uE, 2 * uf});
  add(nm::kDown, h.down, {uE, uf, ud});
  add(nm::kDownBias, h.down_b, {uE, ud});
  options.metadata.emplace("format", "pt");
  save_checkpoint(path, list, options);
}

}  // namespace apex
