#pragma once
/// \file inference/files/gpt_oss/load.hpp
/// `load_packed_gpt_oss<Storage>`: a gpt-oss MoE block of a Hugging Face
/// checkpoint (io/gpt_oss_layout.hpp: one file or a sharded folder) as a
/// `PackedMoE<Storage, ClampedSwiGLU<float>>`, expert by expert, with no
/// float copy of the block:
///
/// - experts in OpenAI's MXFP4 form (`*_blocks` / `*_scales`, as openai
///   publishes gpt-oss) into MXFP4 panels (types mxfp4, the default for
///   Storage = packed::mxfp4): each 32-weight block moves into ggml's
///   block_mxfp4 by a nibble permutation (quant/mxfp4_openai.hpp), its codes
///   and scale unchanged — the file's weights exactly as shipped;
/// - into any other storage type: dequantized (exact), then packed as a
///   float layer is (bf16 rounding, ggml's reference quantizers);
/// - dense F32/BF16/F64 experts: read, de-interleaved and transposed, packed.
///
/// The router, its bias and the experts' biases stay float. Every check (the
/// file's tensors, forms, dtypes and shapes, memory) runs before the first
/// expert is read; each MXFP4 block is checked as its expert is read, by the
/// float loader's check (io/gpt_oss_layout.hpp gpt_oss_block: E8M0 code
/// 255, or a value beyond float's range); the biases and router are checked
/// finite before any expert is packed. The layer has no float source: check_source
/// refuses it.

#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "../../../core/errors.hpp"
#include "../../../io/gpt_oss_layout.hpp"
#include "../../../quant/mxfp4_openai.hpp"
#include "../../engine/kinds/clamped_swiglu.hpp"
#include "../checkpoint/load_options.hpp"
#include "../../engine/packed_moe.hpp"

namespace apex {
namespace detail::gpt_oss {

/// `n` stored bytes of tensor `name` from byte `offset` of its data.
inline void read_range(const GptOssSource& s, const std::string& name, std::uint64_t offset, std::size_t n,
                       void* out) {
  const auto& [file, info] = s.tensors.at(name);
  file->source().read(file->header().data_offset() + info->begin + offset, out, n);
}

/// Expert e of a dense weight [E, in, R] as float, in × R row-major.
inline std::vector<float> dense_slice(const GptOssSource& s, const std::string& name, Index e, Index in, Index R) {
  const safetensors::TensorInfo& t = *s.find(name);
  const std::size_t count = std::size_t(in * R), item = safetensors::dtype_size(t.dtype);
  std::vector<unsigned char> raw(count * item);
  read_range(s, name, std::uint64_t(e) * raw.size(), raw.size(), raw.data());
  std::vector<float> out(count);
  safetensors::detail::decode(t.dtype, raw.data(), count, out.data());
  check_gpt_oss_finite(s.where, name, out);
  return out;
}

/// Expert e of an MXFP4 weight (R rows of `in` weights) as ggml blocks, row by
/// row: R × in/32 blocks. ValueError for a block whose values are not finite
/// floats (gpt_oss_block, the float loader's check: E8M0 code 255, or 254
/// with FP4 6.0).
inline std::vector<quant::BlockMXFP4> mxfp4_slice(const GptOssSource& s, const std::string& name, Index e, Index R,
                                                  Index in) {
  const Index G = in / quant::kQK;
  std::vector<std::uint8_t> codes(std::size_t(R * G * 16)), scales(std::size_t(R * G));  // R × G × 16, R × G
  read_range(s, name + gpt_oss_names::kBlocks, std::uint64_t(e) * codes.size(), codes.size(), codes.data());
  read_range(s, name + gpt_oss_names::kScales, std::uint64_t(e) * scales.size(), scales.size(), scales.data());
  std::vector<quant::BlockMXFP4> out(scales.size());
  for (std::size_t b = 0; b < out.size(); ++b)
    out[b] = gpt_oss_block(s.where, name, &codes[b * 16], scales[b], e, Index(b) / G, Index(b) % G);
  return out;
}

/// The rows `first`, `first + step`, … (n of them) of `rows` (each `width` blocks).
inline std::vector<quant::BlockMXFP4> every_other(const std::vector<quant::BlockMXFP4>& rows, Index width,
                                                  Index first, Index step, Index n) {
  std::vector<quant::BlockMXFP4> out(std::size_t(n * width));
  for (Index j = 0; j < n; ++j)
    std::memcpy(&out[std::size_t(j * width)], &rows[std::size_t((first + j * step) * width)],
                std::size_t(width) * sizeof(quant::BlockMXFP4));
  return out;
}

/// ggml blocks (rows × in/32) dequantized: rows × in, row-major.
inline Matrix<float> dequantized(const std::vector<quant::BlockMXFP4>& blocks, Index rows, Index in) {
  Matrix<float> w(rows, in);  // rows × in
  for (Index r = 0; r < rows; ++r) quant::dequantize_row_mxfp4(&blocks[std::size_t(r * (in / quant::kQK))], w.row(r).data(), in);
  return w;
}

/// Routed expert e packed in `types`: gate rows are gate_up's even output
/// rows, up rows its odd ones (Hugging Face's interleaving).
inline packed::PackedExpert read_expert(const GptOssSource& s, const std::string& prefix, bool mxfp4, Index e,
                                        Index d, Index f, packed::ExpertDtypes types) {
  namespace nm = gpt_oss_names;
  if (mxfp4) {
    const auto gu = mxfp4_slice(s, prefix + nm::kGateUp, e, 2 * f, d);  // 2f rows of d/32 blocks
    const auto dn = mxfp4_slice(s, prefix + nm::kDown, e, d, f);        // d rows of f/32 blocks
    const Index gw = d / quant::kQK;
    const auto gate = every_other(gu, gw, 0, 2, f), up = every_other(gu, gw, 1, 2, f);
    if (types == packed::ExpertDtypes(packed::Dtype::mxfp4))  // the file's blocks, moved
      return packed::PackedExpert::from_file_rows(d, f, types, reinterpret_cast<const std::byte*>(gate.data()),
                                                  reinterpret_cast<const std::byte*>(up.data()),
                                                  reinterpret_cast<const std::byte*>(dn.data()));
    return packed::PackedExpert(dequantized(gate, f, d), dequantized(up, f, d), dequantized(dn, d, f), types);
  }
  const std::vector<float> gu = dense_slice(s, prefix + nm::kGateUp, e, d, 2 * f);  // d × 2f
  const std::vector<float> dn = dense_slice(s, prefix + nm::kDown, e, f, d);        // f × d
  Matrix<float> w_gate(f, d), w_up(f, d), w_down(d, f);
  for (Index i = 0; i < d; ++i)
    for (Index j = 0; j < f; ++j) {
      w_gate(j, i) = gu[std::size_t(i * 2 * f + 2 * j)];
      w_up(j, i) = gu[std::size_t(i * 2 * f + 2 * j + 1)];
    }
  for (Index j = 0; j < f; ++j)
    for (Index i = 0; i < d; ++i) w_down(i, j) = dn[std::size_t(j * d + i)];
  return packed::PackedExpert(w_gate, w_up, w_down, types);
}

}  // namespace detail::gpt_oss

/// A gpt-oss block from the Hugging Face checkpoint in `source` (see the
/// file comment) under `options.prefix` (e.g. "model.layers.3."), experts
/// in `options.types` or else Storage. Of `options`: prefix, allow_unexpected,
/// the clamped kind's expert_options (α and L, which files do not store),
/// types and limits; a family
/// is a ConfigError. Throws ConfigError for a config that is not a gpt-oss
/// block (router_bias, no shared experts) or does not fit in memory,
/// FormatError/ShapeError naming the tensor, ValueError for NaN/Inf or an
/// MXFP4 block whose values are not finite floats (gpt_oss_block).
template <class Storage>
PackedMoE<Storage, ClampedSwiGLU<float>> load_packed_gpt_oss(const std::string& path, const MoEConfig& config,
                                                             const PackedLoadOptions& options = {}) {
  namespace nm = gpt_oss_names;
  using Layer = PackedMoE<Storage, ClampedSwiGLU<float>>;
  const std::string& p = options.prefix;
  std::unique_ptr<safetensors::Reader> one;
  ShardIndex index;
  detail::GptOssSource s;
  if (detail::is_sharded_path(path)) {
    const std::string index_path = shard_index_path(path);
    index = read_shard_index(index_path, options.limits);
    s = detail::gpt_oss_source(index_path, index, p, options.limits);
  } else {
    one = std::make_unique<safetensors::Reader>(safetensors::Reader::map(path, options.limits));
    s = detail::gpt_oss_source(*one, p);
  }
  s.where = "load_packed_gpt_oss('" + path + "')";
  const char* where = s.where.c_str();
  detail::require_config(!options.family, where, "a gpt-oss checkpoint has its own names; options.family does not apply");
  detail::check_gpt_oss_config(where, config);
  const ClampedSwiGLUOptions kind_options = options.expert_options.get<ClampedSwiGLU<float>>();
  kind_options.validate_for<float>(where);
  const Index d = config.d_model, f = config.d_ffn, E = config.n_experts;
  const std::uint64_t ud = std::uint64_t(d), uf = std::uint64_t(f), uE = std::uint64_t(E);
  std::set<std::string> used{p + nm::kRouterWeight, p + nm::kRouterBias, p + nm::kGateUpBias, p + nm::kDownBias};
  detail::check_gpt_oss_dense(s, p + nm::kRouterWeight, {uE, ud});
  detail::check_gpt_oss_dense(s, p + nm::kRouterBias, {uE});
  detail::check_gpt_oss_dense(s, p + nm::kGateUpBias, {uE, 2 * uf});
  detail::check_gpt_oss_dense(s, p + nm::kDownBias, {uE, ud});
  const bool gu_mx = detail::check_gpt_oss_weight(s, p + nm::kGateUp, E, d, 2 * f, used);
  const bool dn_mx = detail::check_gpt_oss_weight(s, p + nm::kDown, E, f, d, used);
  if (gu_mx != dn_mx)
    throw FormatError(s.where + ": gate_up_proj and down_proj must both be MXFP4 or both dense");
  detail::gpt_oss_unexpected(s, used, p, options.allow_unexpected);
  const PackedTypes types = options.types ? *options.types : PackedTypes(Layer::kDtype);
  // Staging: one expert's float matrices (dense files, or MXFP4 into another type).
  Layer::check_fits(where, config, std::uint64_t(detail::checked_product(where, "staging bytes", {6, f, d, 4})), types);
  // The float parts: router, its bias, every expert's biases.
  const auto router_w = s.read<float>(p + nm::kRouterWeight), router_b = s.read<float>(p + nm::kRouterBias);
  const auto gu_b = s.read<float>(p + nm::kGateUpBias), dn_b = s.read<float>(p + nm::kDownBias);
  detail::check_gpt_oss_finite(s.where, p + nm::kRouterWeight, router_w);
  detail::check_gpt_oss_finite(s.where, p + nm::kRouterBias, router_b);
  detail::check_gpt_oss_finite(s.where, p + nm::kGateUpBias, gu_b);
  detail::check_gpt_oss_finite(s.where, p + nm::kDownBias, dn_b);
  std::vector<packed::PackedExpert> experts;
  std::vector<ClampedBiases> extras;
  for (Index e = 0; e < E; ++e) {
    experts.push_back(detail::gpt_oss::read_expert(s, p, gu_mx, e, d, f, types.routed));
    ClampedBiases b{RowVector<float>(f), RowVector<float>(f), RowVector<float>(d), kind_options};
    for (Index j = 0; j < f; ++j) {
      b.gate(j) = gu_b[std::size_t(e * 2 * f + 2 * j)];
      b.up(j) = gu_b[std::size_t(e * 2 * f + 2 * j + 1)];
    }
    for (Index i = 0; i < d; ++i) b.down(i) = dn_b[std::size_t(e * d + i)];
    extras.push_back(std::move(b));
  }
  const Matrix<float> router = Eigen::Map<const Matrix<float>>(router_w.data(), E, d);  // E × d
  Layer out(config, router, RowVector<float>::Zero(E), std::move(experts), std::move(extras), {});
  out.set_logit_bias(Eigen::Map<const RowVector<float>>(router_b.data(), E));
  return out;
}

}  // namespace apex
