#pragma once
/// \file io/gpt_oss_layout.hpp
/// How gpt-oss checkpoints hold one MoE block (docs/routing.md#gpt-oss-checkpoints):
/// Hugging Face's tensor names, the fused in × out layout with gate and up
/// interleaved, OpenAI's MXFP4 form of the expert weights, and the checks of
/// each tensor's presence, dtype and shape. What the float loader
/// (io/gpt_oss_checkpoint.hpp) and the packed loader
/// (inference/files/gpt_oss/load.hpp) both read a file through.

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
#include "../moe/config.hpp"
#include "../optim/non_finite.hpp"
#include "../quant/blocks.hpp"
#include "../quant/half.hpp"
#include "../quant/mxfp4_openai.hpp"
#include "../quant/quantize_mxfp4.hpp"

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

/// ValueError naming `name` and the first element if `v` holds NaN or Inf
/// (detail::require_finite_values): the value rule of the loads, which
/// save_gpt_oss_checkpoint applies to the values as it stores them.
template <class T>
void check_gpt_oss_finite(const std::string& where, const std::string& name, const std::vector<T>& v) {
  require_finite_values(where, "tensor " + safetensors::quote_name(name), v.data(), v.data(), Index(v.size()), 0);
}

/// Block [e, r, g] of the MXFP4 weight `name` (its 16 code bytes in
/// OpenAI's order, its E8M0 `scale`) as ggml's block, or ValueError naming
/// the scales tensor and the block unless it is a number and every value a
/// finite float: code 255 is NaN (OCP MX), and 254 with an FP4 value of
/// magnitude ≥ 2 or 253 with ≥ 4 overflows float (6·2^127:
/// quant::mxfp4_block_finite).
/// The one check of both gpt-oss loaders: the float one
/// (dequantize_gpt_oss) and the packed one (inference/files/gpt_oss/load.hpp).
inline quant::BlockMXFP4 gpt_oss_block(const std::string& where, const std::string& name, const std::uint8_t* codes,
                                       std::uint8_t scale, Index e, Index r, Index g) {
  const quant::BlockMXFP4 b = quant::mxfp4_from_openai(codes, scale);
  if (scale != 0xFF && quant::mxfp4_block_finite(b)) return b;
  throw ValueError(where + ": tensor " + safetensors::quote_name(name + gpt_oss_names::kScales) + " holds E8M0 code " +
                   std::to_string(scale) +
                   (scale == 0xFF ? " (NaN)" : " with an FP4 value whose product overflows float") + " at [" +
                   std::to_string(e) + ", " + std::to_string(r) + ", " + std::to_string(g) +
                   "]: the block's values would not be finite");
}

/// The MXFP4 weight `name` (`_blocks` E × R × G × 16, `_scales` E × R × G)
/// dequantized into Hugging Face's dense layout E × 32G × R (in × out).
/// Exact: a value is a 2-bit significand times a power of two. A block
/// whose values are not finite floats is a ValueError (gpt_oss_block).
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
        const std::uint8_t* b = &q[std::size_t(((e * R + r) * G + g) * 16)];
        (void)gpt_oss_block(s.where, name, b, code, e, r, g);
        // kMxfp4Values are the FP4 values doubled, e8m0_to_fp32_half halves the scale: FP4·2^(s−127).
        const T scale = T(quant::e8m0_to_fp32_half(code));
        for (Index i = 0; i < quant::kQK; ++i) {
          const unsigned nib = i % 2 ? b[i / 2] >> 4 : b[i / 2] & 0x0F;
          T v = T(quant::kMxfp4Values[nib & 7]) * scale;
          if (nib & 8) v = -v;  // code 8 is −0: the table stores it as 0, the sign bit restores it
          out[std::size_t((e * in + g * quant::kQK + i) * R + r)] = v;
        }
      }
  return out;
}

/// ConfigError unless the layer is a gpt-oss block: the router's bias on, no shared experts.
inline void check_gpt_oss_config(const char* where, const MoEConfig& c) {
  require_config(c.router_bias, where, "a gpt-oss block needs MoEConfig::router_bias (the router's logit bias)");
  require_config(c.n_shared == 0 && !c.shared_expert_gate, where,
                 "a gpt-oss block has no shared experts, got n_shared = " + std::to_string(c.n_shared));
}

/// Checks one expert weight in either form, refusing both or neither:
/// dense `name` [E, in, R] (F32/F64/BF16), or MXFP4 `name_blocks` U8
/// [E, R, in/32, 16] with `name_scales` U8 [E, R, in/32]. Adds the names to
/// `used`; returns whether it is MXFP4. Reads nothing.
inline bool check_gpt_oss_weight(const GptOssSource& s, const std::string& name, Index E, Index in, Index R,
                                 std::set<std::string>& used) {
  const std::string blocks = name + gpt_oss_names::kBlocks, scales = name + gpt_oss_names::kScales;
  const bool dense = s.find(name) != nullptr, packed = s.find(blocks) || s.find(scales);
  if (dense && packed)
    throw FormatError(s.where + ": tensor " + safetensors::quote_name(name) + " is stored both dense and as MXFP4 " +
                      safetensors::quote_name(blocks) + "/" + safetensors::quote_name(scales) + "; keep one");
  if (!packed) {
    check_gpt_oss_dense(s, name, {std::uint64_t(E), std::uint64_t(in), std::uint64_t(R)});
    used.insert(name);
    return false;
  }
  if (in % quant::kQK != 0)
    throw ShapeError(s.where + ": MXFP4 tensor " + safetensors::quote_name(blocks) + " needs its input width " +
                     std::to_string(in) + " to be a multiple of 32");
  const std::uint64_t e = std::uint64_t(E), r = std::uint64_t(R), g = std::uint64_t(in / quant::kQK);
  check_gpt_oss_u8(s, blocks, {e, r, g, 16});
  check_gpt_oss_u8(s, scales, {e, r, g});
  used.insert(blocks), used.insert(scales);
  return true;
}

/// The tensors of `s` a block's load did not use (`used`): FormatError
/// naming them unless `allow`; else returned.
inline std::vector<std::string> gpt_oss_unexpected(const GptOssSource& s, const std::set<std::string>& used,
                                                   const std::string& prefix, bool allow) {
  std::vector<std::string> out;
  for (const auto& [name, where] : s.tensors)
    if (!used.count(name)) out.push_back(name);
  out.insert(out.end(), s.outside.begin(), s.outside.end());
  if (!out.empty() && !allow)
    throw FormatError(s.where + ": unexpected " + name_list(out) + ", which the block under prefix '" + prefix +
                      "' does not use (allow_unexpected to ignore other tensors)");
  return out;
}

}  // namespace detail
}  // namespace apex
