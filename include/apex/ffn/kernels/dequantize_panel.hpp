#pragma once
/// \file kernels/dequantize_panel.hpp
/// A block-format panel as floats in the f32 panel order, 32 reduction
/// steps at a time: what the forward with exact activations
/// (kernels/dequantized_product.hpp) multiplies with the f32 tiles.
///
///     dst[c·32 + l] = W(lane l, k = 32·chunk + c),   c, l < 32
///
/// Chunk `chunk` covers the same k as in kernels/unpack_columns.hpp (one
/// block of Q8_0, Q4_0 and MXFP4; one sub-block of Q4_K; two groups of 16
/// of Q6_K), with the same per-lane factors (ChunkFactors), but not turned
/// around: a slab already holds each lane's codes along k and the lanes
/// side by side, the order the f32 tiles read, so a SIMD dequantizer works
/// on 8 or 16 lanes at once without a transpose.
///
/// The values are PanelMatrix::unpack_row's, bit for bit: ggml's
/// dequantizer, separately rounded fp32 operations (fp-contract off here as
/// in quant/quantize_*.hpp):
///
///   Q8_0   float(q)·d                  Q4_0   float(q − 8)·d
///   MXFP4  float(v2[q])·2^(e−128)      (v2: the doubled E2M1 values)
///   Q4_K   (d·float(sc_j))·float(q) − dmin·float(m_j)   (two roundings, then the difference)
///   Q6_K   (d·float(sc_g))·float(q − 32)
///
/// This is the portable dequantizer, reading each code where
/// kernels/quant_layout.hpp puts it; kernels/arch/avx2_dequantize_panel.hpp
/// applies the same IEEE operations to the same operands, so every path
/// writes the same bytes (the tests compare them).

#include <cstddef>
#include <cstdint>

#include "../quant/formats.hpp"
#include "quant_layout.hpp"
#include "unpack_columns.hpp"
#include "weight_types.hpp"

namespace apex::packed::detail {

APEX_QUANT_FP_STRICT_BEGIN

/// Each lane's factors of chunk `chunk` of a block-format panel (the
/// scalar dequantizer's; ChunkFactors says what they multiply).
template <Dtype T>
void chunk_factors_scalar(const std::byte* scales, Index chunk, ChunkFactors& f) {
  APEX_QUANT_FP_STRICT_SCOPE
  using W = WeightType<T>;
  for (Index l = 0; l < kPanelLanes; ++l) {
    f.min[l] = 0.0f;
    if constexpr (T == Dtype::q4_k) {
      const std::byte* a = W::area(scales, chunk / 8);
      std::uint8_t packed_scales[12], sc, m;
      for (Index i = 0; i < 12; ++i) packed_scales[i] = byte_at(a, W::kScalePlanes + i * kPanelLanes + l);
      quant::q4_k_scale_min(int(chunk % 8), packed_scales, sc, m);
      f.lo[l] = f.hi[l] = quant::fp16_to_fp32(get_u16(a, l)) * float(sc);
      f.min[l] = quant::fp16_to_fp32(get_u16(a + W::kDminPlane, l)) * float(m);
    } else if constexpr (T == Dtype::q6_k) {
      const std::byte* a = W::area(scales, chunk / 8);
      const std::byte* group = a + W::kScalePlanes + 2 * (chunk % 8) * kPanelLanes;  // groups 2h, 2h + 1
      const float d = quant::fp16_to_fp32(get_u16(a, l));
      f.lo[l] = d * float(std::int8_t(byte_at(group, l)));
      f.hi[l] = d * float(std::int8_t(byte_at(group + kPanelLanes, l)));
    } else if constexpr (T == Dtype::mxfp4) {
      f.lo[l] = f.hi[l] = quant::e8m0_to_fp32_half(byte_at(W::area(scales, chunk), l));
    } else {
      f.lo[l] = f.hi[l] = quant::fp16_to_fp32(get_u16(W::area(scales, chunk), l));
    }
  }
}

/// The integer the factors multiply, of column c (< 32) of chunk `chunk`,
/// lane `lane`: Q8_0's q, Q4_0's q − 8, MXFP4's v2[q], Q4_K's q, Q6_K's q − 32.
template <Dtype T>
int chunk_value(const std::byte* codes, Index chunk, Index c, Index lane) {
  using W = WeightType<T>;
  if constexpr (T == Dtype::q4_k) return get_nibble(W::slab(codes, chunk / 8), 32 * (chunk % 8) + c, lane);
  else if constexpr (T == Dtype::q6_k) return int(W::code(codes, chunk / 8, 32 * (chunk % 8) + c, lane)) - 32;
  else return block32_value<T>(W::slab(codes, chunk), c, lane);
}

/// Chunk `chunk` of one block-format panel of type T (codes, scales) into
/// dst (32 k × 32 lanes, see the file comment).
template <Dtype T>
void dequantize_chunk_scalar(const std::byte* codes, const std::byte* scales, Index chunk, float* dst) {
  APEX_QUANT_FP_STRICT_SCOPE
  ChunkFactors f;
  chunk_factors_scalar<T>(scales, chunk, f);
  for (Index c = 0; c < kChunkColumns; ++c)
    for (Index l = 0; l < kPanelLanes; ++l) {
      float w = float(chunk_value<T>(codes, chunk, c, l)) * (c < 16 ? f.lo[l] : f.hi[l]);
      if constexpr (T == Dtype::q4_k) w = w - f.min[l];
      dst[c * kPanelLanes + l] = w;
    }
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::packed::detail
