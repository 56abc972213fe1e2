#pragma once
/// \file inference/files/gpt_oss/save.hpp
/// `save_packed_gpt_oss`: a packed gpt-oss block written under Hugging Face's
/// names (io/gpt_oss_layout.hpp), the inverse of load_packed_gpt_oss:
///
/// - MXFP4 experts as OpenAI publishes them, `*_blocks` U8 [E, R, in/32, 16]
///   and `*_scales` U8 [E, R, in/32]: each panel block back into OpenAI's
///   nibble order (quant/mxfp4_openai.hpp), so a checkpoint loaded and saved
///   again has the same bytes;
/// - experts of any other type dense, F32 `gate_up_proj` [E, d, 2f] and
///   `down_proj` [E, f, d], holding the packed values exactly (bf16 rounded,
///   block formats dequantized);
/// - router, its bias and the experts' biases F32; metadata "format": "pt".
///
/// Atomic (safetensors::write_file_atomic): a failed save leaves `path` as it
/// was. Transient memory: one copy of the experts in the written form.

#include <cstdint>
#include <string>
#include <vector>

#include "../../../io/gpt_oss_layout.hpp"
#include "../../../io/safetensors.hpp"
#include "../../../quant/mxfp4_openai.hpp"
#include "../../engine/kinds/clamped_swiglu.hpp"
#include "../../engine/packed_moe.hpp"

namespace apex {
namespace detail::gpt_oss {

/// OpenAI's blocks and scales of R rows of ggml blocks (`width` per row), appended.
inline void append_openai(const quant::BlockMXFP4* rows, Index n_blocks, std::vector<std::uint8_t>& codes,
                          std::vector<std::uint8_t>& scales) {
  for (Index b = 0; b < n_blocks; ++b) {
    std::uint8_t packed[16], scale = 0;
    quant::mxfp4_to_openai(rows[b], packed, scale);
    codes.insert(codes.end(), packed, packed + 16);
    scales.push_back(scale);
  }
}

}  // namespace detail::gpt_oss

/// Saves `layer` to `path` under Hugging Face's gpt-oss names, each prefixed
/// by `prefix` (e.g. "model.layers.3."). ConfigError unless the layer is a
/// gpt-oss block (router_bias, no shared experts).
template <class Storage>
void save_packed_gpt_oss(const std::string& path, const PackedMoE<Storage, ClampedSwiGLU<float>>& layer,
                         const std::string& prefix = "") {
  namespace nm = gpt_oss_names;
  using safetensors::DType;
  const MoEConfig& c = layer.config();
  detail::check_gpt_oss_config("save_packed_gpt_oss", c);
  const Index d = c.d_model, f = c.d_ffn, E = c.n_experts;
  const auto u = [](Index n) { return std::uint64_t(n); };
  const bool mxfp4 = layer.types().routed == packed::ExpertDtypes(packed::Dtype::mxfp4);
  std::vector<float> gu_b(std::size_t(E * 2 * f)), dn_b(std::size_t(E * d));  // E × 2f (interleaved), E × d
  std::vector<float> gu, dn;                                                  // dense: E × d × 2f, E × f × d
  std::vector<std::uint8_t> gu_q, gu_s, dn_q, dn_s;                           // MXFP4: codes and scales
  const Index gw = d / 32, dw = f / 32;  // blocks per gate/up row and per down row (MXFP4 only)
  for (Index e = 0; e < E; ++e) {
    const packed::PackedExpert& x = layer.experts()[std::size_t(e)];
    const ClampedBiases& b = layer.extras()[std::size_t(e)];
    for (Index j = 0; j < f; ++j) {
      gu_b[std::size_t(e * 2 * f + 2 * j)] = b.gate(j);
      gu_b[std::size_t(e * 2 * f + 2 * j + 1)] = b.up(j);
    }
    for (Index i = 0; i < d; ++i) dn_b[std::size_t(e * d + i)] = b.down(i);
    if (mxfp4) {
      std::vector<quant::BlockMXFP4> gate(std::size_t(f * gw)), up(gate.size()), down(std::size_t(d * dw));
      x.file_rows(reinterpret_cast<std::byte*>(gate.data()), reinterpret_cast<std::byte*>(up.data()),
                  reinterpret_cast<std::byte*>(down.data()));
      for (Index j = 0; j < f; ++j) {  // output rows 2j (gate), 2j + 1 (up)
        detail::gpt_oss::append_openai(&gate[std::size_t(j * gw)], gw, gu_q, gu_s);
        detail::gpt_oss::append_openai(&up[std::size_t(j * gw)], gw, gu_q, gu_s);
      }
      detail::gpt_oss::append_openai(down.data(), d * dw, dn_q, dn_s);
      continue;
    }
    const Matrix<float> wg = x.w_gate(), wu = x.w_up(), wd = x.w_down();  // f × d, f × d, d × f
    for (Index i = 0; i < d; ++i)
      for (Index j = 0; j < f; ++j) gu.insert(gu.end(), {wg(j, i), wu(j, i)});
    for (Index j = 0; j < f; ++j)
      for (Index i = 0; i < d; ++i) dn.push_back(wd(i, j));
  }
  std::vector<safetensors::RawTensor> out;
  out.push_back(safetensors::raw_tensor(prefix + nm::kRouterWeight, DType::F32, {u(E), u(d)}, layer.router().weight().data()));
  out.push_back(safetensors::raw_tensor(prefix + nm::kRouterBias, DType::F32, {u(E)}, layer.router().logit_bias().data()));
  out.push_back(safetensors::raw_tensor(prefix + nm::kGateUpBias, DType::F32, {u(E), u(2 * f)}, gu_b.data()));
  out.push_back(safetensors::raw_tensor(prefix + nm::kDownBias, DType::F32, {u(E), u(d)}, dn_b.data()));
  if (mxfp4) {
    const std::string g = prefix + nm::kGateUp, w = prefix + nm::kDown;
    out.push_back(safetensors::raw_tensor(g + nm::kBlocks, DType::U8, {u(E), u(2 * f), u(gw), 16}, gu_q.data()));
    out.push_back(safetensors::raw_tensor(g + nm::kScales, DType::U8, {u(E), u(2 * f), u(gw)}, gu_s.data()));
    out.push_back(safetensors::raw_tensor(w + nm::kBlocks, DType::U8, {u(E), u(d), u(dw), 16}, dn_q.data()));
    out.push_back(safetensors::raw_tensor(w + nm::kScales, DType::U8, {u(E), u(d), u(dw)}, dn_s.data()));
  } else {
    out.push_back(safetensors::raw_tensor(prefix + nm::kGateUp, DType::F32, {u(E), u(d), u(2 * f)}, gu.data()));
    out.push_back(safetensors::raw_tensor(prefix + nm::kDown, DType::F32, {u(E), u(f), u(d)}, dn.data()));
  }
  safetensors::Metadata meta{{"format", "pt"}};
  safetensors::write_file_atomic(path, [&](safetensors::ByteSink& sink) { safetensors::write_raw(sink, out, meta); });
}

}  // namespace apex
