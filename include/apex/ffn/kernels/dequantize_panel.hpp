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

/// Chunk `chunk` of one block-format panel of type T (codes, scales) into
/// dst (32 k × 32 lanes, see the file comment): each lane's codes and
/// factors are the type's entry's (WeightType::chunk_codes, chunk_factors),
/// as kernels/unpack_columns.hpp reads them; only the order of dst differs.
template <Dtype T>
void dequantize_chunk_scalar(const std::byte* codes, const std::byte* scales, Index chunk, float* dst) {
  APEX_QUANT_FP_STRICT_SCOPE
  using W = WeightType<T>;
  static_assert(W::kQuantized, "dequantize_chunk_scalar: a block format");
  for (Index l = 0; l < kPanelLanes; ++l) {
    std::int8_t q[kChunkColumns];
    float lo, hi, min = 0.0f;
    W::chunk_codes(reinterpret_cast<const typename W::Element*>(codes), chunk, l, q);
    W::chunk_factors(scales, chunk, l, lo, hi, min);
    for (Index c = 0; c < kChunkColumns; ++c) {
      float w = float(q[c]) * (c < kChunkColumns / 2 ? lo : hi);
      if constexpr (W::kChunkMin) w = w - min;  // two roundings: fp-contract is off here
      dst[c * kPanelLanes + l] = w;
    }
  }
}

APEX_QUANT_FP_STRICT_END

}  // namespace apex::packed::detail
