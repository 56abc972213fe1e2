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
#include "../quant/blocks.hpp"
#include "../quant/half.hpp"

namespace apex {

/// The gpt-oss tensor names, without the layer prefix.
namespace gpt_oss_names {
inline constexpr const char* kRouterWeight = "mlp.router.weight";
inline constexpr const char* kRouterBias = "mlp.router.bias";
inline constexpr const char* kGateUp = "mlp.experts.gate_up_proj";
inline constexpr const char* kGateUpBias = "mlp.experts.gate_up_proj_bias";
inline constexpr const char* kDown = "mlp.experts.down_proj";
inline constexpr const char* kDownBias = "mlp.experts.down_proj_bias";
inline constexpr const char* kBlocks = "_blocks";  ///< suffix of an MXFP4 weight's codes
inline constexpr const char* kScales = "_scales";  ///< suffix of its E8M0 scales
}  // namespace gpt_oss_names

namespace detail {

using Shape = std::vector<std::uint64_t>;

/// The six tensors of a gpt-oss block in Hugging Face's layout, row-major.
template <class T>
struct GptOssFused {
  std::vector<T> router_w;   ///< E × d
  std::vector<T> router_b;   ///< E
  std::vector<T> gate_up;    ///< E × d × 2f (in × out, gate/up interleaved)
  std::vector<T> gate_up_b;  ///< E × 2f
  std::vector<T> down;       ///< E × f × d (in × out)
  std::vector<T> down_b;     ///< E × d
};

/// Every tensor of a checkpoint under `prefix`, whether in one file or in
/// the shards of an index: the readers (owned for shards) and each entry.
struct GptOssSource {
  std::string where;
  std::vector<std::unique_ptr<safetensors::Reader>> owned;
  std::map<std::string, std::pair<const safetensors::Reader*, const safetensors::TensorInfo*>> tensors;
  std::vector<std::string> outside;  ///< tensors of a one-file checkpoint not under the prefix

  const safetensors::TensorInfo* find(const std::string& name) const {
    auto it = tensors.find(name);
    return it == tensors.end() ? nullptr : it->second.second;
  }
  template <class T>
  std::vector<T> read(const std::string& name) const {
    const auto& [file, info] = tensors.at(name);
    std::vector<T> out(std::size_t(info->numel()));
    file->read(*info, out.data());
    return out;
  }
  std::vector<std::uint8_t> bytes(const std::string& name) const {
    const auto& [file, info] = tensors.at(name);
    std::vector<std::uint8_t> out(std::size_t(info->nbytes()));
    file->read_bytes(*info, out.data());
    return out;
  }
};

inline GptOssSource gpt_oss_source(const safetensors::Reader& file, const std::string& prefix) {
  GptOssSource s{"load_gpt_oss_checkpoint(" + file.source().description() + ")", {}, {}, {}};
  for (const auto& t : file.tensors()) {
    if (t.name.rfind(prefix, 0) == 0) s.tensors[t.name] = {&file, &t};
    else s.outside.push_back(t.name);
  }
  return s;
}

/// The tensors the index places under `prefix`, each shard opened once.
/// FormatError if a shard lacks a tensor the index places in it.
inline GptOssSource gpt_oss_source(const std::string& index_path, const ShardIndex& index, const std::string& prefix,
                                   const safetensors::Limits& limits) {
  namespace fs = std::filesystem;
  GptOssSource s{"load_gpt_oss_checkpoint('" + index_path + "')", {}, {}, {}};
  std::map<std::string, const safetensors::Reader*> opened;
  for (auto it = index.weight_map.lower_bound(prefix); it != index.weight_map.end(); ++it) {
    if (it->first.rfind(prefix, 0) != 0) break;
    const safetensors::Reader*& r = opened[it->second];
    if (!r) {
      s.owned.push_back(std::make_unique<safetensors::Reader>(
          (fs::path(index_path).parent_path() / it->second).string(), limits));
      r = s.owned.back().get();
    }
    const safetensors::TensorInfo* t = r->header().find(it->first);
    if (!t)
      throw FormatError(s.where + ": the index places tensor " + safetensors::quote_name(it->first) + " in '" +
                        it->second + "', which lacks it");
    s.tensors[it->first] = {r, t};
  }
  return s;
}

/// FormatError unless `name` is present as a float tensor (F32, F64, BF16);
/// ShapeError unless its shape is `want` (leading 1s aside).
inline void check_gpt_oss_dense(const GptOssSource& s, const std::string& name, const Shape& want) {
  const safetensors::TensorInfo* t = s.find(name);
  if (!t) throw FormatError(s.where + ": missing tensor " + safetensors::quote_name(name));
  if (!safetensors::is_float_convertible(t->dtype))
    throw FormatError(s.where + ": tensor " + safetensors::quote_name(name) + " is " +
                      safetensors::dtype_name(t->dtype) + ", wanted F32, F64 or BF16");
  if (drop_leading_ones(t->shape) != drop_leading_ones(want))
    throw ShapeError(s.where + ": tensor " + safetensors::quote_name(name) + " has shape " +
                     safetensors::shape_string(t->shape) + ", wanted " + safetensors::shape_string(want));
}

/// As check_gpt_oss_dense, for a U8 tensor of exactly `want`.
inline void check_gpt_oss_u8(const GptOssSource& s, const std::string& name, const Shape& want) {
  const safetensors::TensorInfo* t = s.find(name);
  if (!t) throw FormatError(s.where + ": missing tensor " + safetensors::quote_name(name) + " (MXFP4 form)");
  if (t->dtype != safetensors::DType::U8)
    throw FormatError(s.where + ": tensor " + safetensors::quote_name(name) + " is " +
                      safetensors::dtype_name(t->dtype) + ", wanted U8 (MXFP4 form)");
  if (t->shape != want)
    throw ShapeError(s.where + ": tensor " + safetensors::quote_name(name) + " has shape " +
                     safetensors::shape_string(t->shape) + ", wanted " + safetensors::shape_string(want));
}

/// ValueError naming `name` if `v` holds NaN or Inf.
template <class T>
void check_gpt_oss_finite(const std::string& where, const std::string& name, const std::vector<T>& v) {
  for (T x : v)
    if (!std::isfinite(x))
      throw ValueError(where + ": tensor " + safetensors::quote_name(name) + " contains NaN or Inf");
}

/// The MXFP4 weight `name` (`_blocks` E × R × G × 16, `_scales` E × R × G)
/// dequantized into Hugging Face's dense layout E × 32G × R (in × out).
/// Exact: a value is a 2-bit significand times a power of two. E8M0 code
/// 255 is NaN (OCP MX): ValueError naming the scales tensor.
template <class T>
std::vector<T> dequantize_gpt_oss(const GptOssSource& s, const std::string& name, Index E, Index R, Index in) {
  const Index G = in / quant::kQK;
  const std::vector<std::uint8_t> q = s.bytes(name + gpt_oss_names::kBlocks);   // E × R × G × 16
  const std::vector<std::uint8_t> sc = s.bytes(name + gpt_oss_names::kScales);  // E × R × G
  std::vector<T> out(std::size_t(E * in * R));                                  // E × in × R
  for (Index e = 0; e < E; ++e)
    for (Index r = 0; r < R; ++r)
      for (Index g = 0; g < G; ++g) {
        const std::uint8_t code = sc[std::size_t((e * R + r) * G + g)];
        if (code == 0xFF)
          throw ValueError(s.where + ": tensor " + safetensors::quote_name(name + gpt_oss_names::kScales) +
                           " holds E8M0 code 255 (NaN)");
        // kMxfp4Values are the FP4 values doubled, e8m0_to_fp32_half halves the scale: FP4·2^(s−127).
        const T scale = T(quant::e8m0_to_fp32_half(code));
        const std::uint8_t* b = &q[std::size_t(((e * R + r) * G + g) * 16)];
        for (Index i = 0; i < quant::kQK; ++i) {
          const unsigned nib = i % 2 ? b[i / 2] >> 4 : b[i / 2] & 0x0F;
          T v = T(quant::kMxfp4Values[nib & 7]) * scale;
          if (nib & 8) v = -v;  // code 8 is −0: the table stores it as 0, the sign bit restores it
          out[std::size_t((e * in + g * quant::kQK + i) * R + r)] = v;
        }
      }
  return out;
}

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

/// ConfigError unless the layer is a gpt-oss block: the router's bias on, no shared experts.
inline void check_gpt_oss_config(const char* where, const MoEConfig& c) {
  require_config(c.router_bias, where, "a gpt-oss block needs MoEConfig::router_bias (the router's logit bias)");
  require_config(c.n_shared == 0 && !c.shared_expert_gate, where,
                 "a gpt-oss block has no shared experts, got n_shared = " + std::to_string(c.n_shared));
}

/// One expert weight (dense or MXFP4, refusing both or neither) checked and
/// read into Hugging Face's layout E × in × R.
template <class T>
std::vector<T> read_gpt_oss_weight(const GptOssSource& s, const std::string& name, Index E, Index in, Index R,
                                   std::set<std::string>& used) {
  const std::string blocks = name + gpt_oss_names::kBlocks, scales = name + gpt_oss_names::kScales;
  const bool dense = s.find(name) != nullptr, packed = s.find(blocks) || s.find(scales);
  if (dense && packed)
    throw FormatError(s.where + ": tensor " + safetensors::quote_name(name) + " is stored both dense and as MXFP4 " +
                      safetensors::quote_name(blocks) + "/" + safetensors::quote_name(scales) + "; keep one");
  if (!packed) {
    check_gpt_oss_dense(s, name, {std::uint64_t(E), std::uint64_t(in), std::uint64_t(R)});
    used.insert(name);
    std::vector<T> v = s.read<T>(name);
    check_gpt_oss_finite(s.where, name, v);
    return v;
  }
  if (in % quant::kQK != 0)
    throw ShapeError(s.where + ": MXFP4 tensor " + safetensors::quote_name(blocks) + " needs its input width " +
                     std::to_string(in) + " to be a multiple of 32");
  const std::uint64_t e = std::uint64_t(E), r = std::uint64_t(R), g = std::uint64_t(in / quant::kQK);
  check_gpt_oss_u8(s, blocks, {e, r, g, 16});
  check_gpt_oss_u8(s, scales, {e, r, g});
  used.insert(blocks), used.insert(scales);
  std::vector<T> v = dequantize_gpt_oss<T>(s, name, E, R, in);
  check_gpt_oss_finite(s.where, blocks, v);  // a float T overflows at the largest scales
  return v;
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
  for (const auto& [name, where] : s.tensors)
    if (!used.count(name)) r.unexpected.push_back(name);
  r.unexpected.insert(r.unexpected.end(), s.outside.begin(), s.outside.end());
  if (!r.unexpected.empty() && !options.allow_unexpected)
    throw FormatError(s.where + ": unexpected " + name_list(r.unexpected) + ", which the block under prefix '" +
                      prefix + "' does not use (LoadOptions::allow_unexpected to ignore other tensors)");
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
/// ConfigError as the load for a layer that is not a gpt-oss block.
template <class T>
void save_gpt_oss_checkpoint(const std::string& path, GptOssMoE<T>& moe, const std::string& prefix = "",
                             SaveOptions options = {}) {
  namespace nm = gpt_oss_names;
  detail::check_gpt_oss_config("save_gpt_oss_checkpoint", moe.config());
  const Index d = moe.config().d_model, f = moe.config().d_ffn, E = moe.config().n_experts;
  detail::GptOssFused<T> h = gpt_oss_fused(moe);
  const std::uint64_t ud = std::uint64_t(d), uf = std::uint64_t(f), uE = std::uint64_t(E);
  ParamList<T> list;
  auto add = [&](const char* name, std::vector<T>& v, detail::Shape shape) {
    list.push_back(Param<T>{prefix + name, v.data(), nullptr, 1, Index(v.size())});
    options.shapes[prefix + name] = std::move(shape);
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
